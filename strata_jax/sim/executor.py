"""``SimExecutor``: the ``strata_jax.engine.executor.Executor`` of a simulated machine, on a virtual clock.

Resources: the GPU (one stream: extend and decode steps queue on it), the
host->device link, the device->host link (PCIe is full duplex) and the storage
link, each a FIFO (``Link``).  ``SimTimer`` is the controller's
``TransferTimer``: a transfer's landing time is when its link gets to it plus its
modelled duration.

An extend step waits for the loads of its batch: with ``layerwise`` overlap
(layer ``l + 1`` loads while layer ``l`` computes) it ends at
``max(start + compute, landed + compute / layers)``, without it at
``max(start, landed) + compute``.  The time it waited beyond its compute is its
*load stall*; ``stats.stall_s / stats.prefill_s`` is the share of prefill time
stalled on loading.  While a coalesced transfer (a layout-conversion kernel on the
GPU) overlaps a step, the step is slowed by ``transfer_kernel_slowdown`` over the
overlapped part.  Step times can also come from a ``StepTimes`` replay (the
measured times of a real run), so the scheduler sees exactly what it saw there.

The host: before each step is dispatched the clock moves on by the engine's host
path for that step (``begin_step``; a ``HostModel`` measured on this engine by
``strata-jax bench host``).  The engine is pipelined, so that time runs while the GPU
works through what is queued: the GPU waits only when a step's host path outlasts
the step before it (with ``pipeline=False`` it waits for all of it, every step).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

from strata_jax.cache.handles import TransferHandle
from strata_jax.engine.executor import ExtendChunk, SeqRow, StepOutput
from strata_jax.sim.cost import SimCostModel
from strata_jax.sim.host_model import HostModel

_computed = operator.attrgetter("computed")
_id_and_generated = operator.attrgetter("request_id", "generated")

_NO_SPAN: nullcontext = nullcontext()


class SimClock:
    """Virtual seconds; only moves forward."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        if t > self.t:
            self.t = t


class Link:
    """A FIFO transfer resource: a transfer starts when the link is free."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def reserve(self, issued_at: float, seconds: float) -> tuple[float, float]:
        start = max(issued_at, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return start, self.free_at


class SimTimer:
    """``TransferTimer`` over the simulated links; remembers coalesced transfers for the slowdown."""

    def __init__(self, clock: SimClock, cost: SimCostModel, io_path: str) -> None:
        self.clock = clock
        self.cost = cost
        self.io_path = io_path
        self.h2d, self.d2h, self.storage = Link(), Link(), Link()
        self.kernel_intervals: list[tuple[float, float]] = []  # GPU-side conversion kernels (coalesced path)

    def land_time(self, kind: str, num_pages: int, nbytes: int, issued_at: float) -> float:
        if kind == "prefetch":
            return self.storage.reserve(issued_at, self.cost.storage_read_seconds(num_pages))[1]
        link = self.h2d if kind == "load" else self.d2h
        start, end = link.reserve(issued_at, self.cost.link_seconds(num_pages, self.io_path))
        if self.io_path == "coalesced":
            self.kernel_intervals.append((start, end))
        return end

    def wait_until(self, t: float) -> None:
        self.clock.advance_to(t)

    def overlap(self, start: float, end: float) -> float:
        """Seconds of [start, end) during which a conversion kernel ran (intervals before start are dropped)."""
        keep = [(a, b) for a, b in self.kernel_intervals if b > start]
        self.kernel_intervals = keep
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in keep)


@dataclass
class SimStats:
    prefill_s: float = 0.0  # extend steps, start to end (stalls included)
    stall_s: float = 0.0  # of which waiting for loads beyond the compute
    decode_s: float = 0.0
    extend_steps: int = 0
    decode_steps: int = 0
    idle_s: float = 0.0
    host_s: float = 0.0  # the host model's time, charged before each step's dispatch


@dataclass(frozen=True)
class _SimStep:
    """A dispatched simulated step: (request id, sample index) per row, and when it runs."""

    rows: list[tuple[str, int]]
    start: float
    end: float


class StepTimes:
    """Measured step times replayed in order (``extend`` and ``decode`` separately)."""

    def __init__(self, extend: Sequence[float], decode: Sequence[float]) -> None:
        self.extend = list(extend)
        self.decode = list(decode)

    def next(self, kind: str) -> float:
        seq = self.extend if kind == "extend" else self.decode
        if not seq:
            raise RuntimeError(f"the replayed run had fewer {kind} steps than this one")
        return seq.pop(0)


class SimExecutor:
    def __init__(
        self,
        clock: SimClock,
        cost: SimCostModel,
        timer: SimTimer,
        *,
        layerwise: bool,
        token_for: Callable[[str, int], int],
        next_event: Callable[[], float | None] = lambda: None,
        replay: StepTimes | None = None,
        host: HostModel | None = None,
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.timer = timer
        self.layerwise = layerwise
        self.token_for = token_for
        self.next_event = next_event
        self.replay = replay
        self.host = host
        self.gpu_free_at = 0.0
        self.stats = SimStats()
        self._layers = cost.model.config.num_layers
        self._slowdown = cost.profile.transfer_kernel_slowdown

    def now(self) -> float:
        return self.clock.t

    def span(self, name: str) -> nullcontext:
        return _NO_SPAN  # reentrant and stateless: one for every span (seven per step)

    def open_sampling_state(self, request_id: str, prompt_ids, output_ids, params) -> bool:
        return True  # penalties / logit_bias are not modelled: tokens come from token_for

    def close_sampling_state(self, request_id: str) -> None:
        return None

    def idle(self) -> None:
        """Nothing ran: jump to the next event (an arrival or a landing), or a millisecond on."""
        nxt = self.next_event()
        now = self.clock.t
        target = nxt if nxt is not None and nxt > now else now + 1e-3
        self.stats.idle_s += target - now
        self.clock.advance_to(target)

    def begin_step(self, decode_rows: int, prefill_rows: int, prefill_tokens: int) -> None:
        """The engine's host path for a step of this size: the clock moves on by the host
        model's time before the step is dispatched (the device meanwhile runs what is queued)."""
        if self.host is None:
            return
        seconds = self.host.seconds(decode_rows, prefill_rows, prefill_tokens)
        self.stats.host_s += seconds
        self.clock.advance_to(self.clock.t + seconds)

    def open_sequence(self, request_id: str) -> None:
        return None  # no device state to keep

    def close_sequence(self, request_id: str) -> None:
        return None

    def page_table_changed(self, request_id: str, index: int) -> None:
        return None

    def rewind_row(self, request_id: str, last_token: int) -> None:
        return None  # (no device rows; the simulator does not speculate)

    def dispatch_extend(self, work: list[ExtendChunk[SeqRow]], loads: Sequence[TransferHandle]) -> _SimStep:
        issued = self.clock.t
        start = max(issued, self.gpu_free_at)
        landed = max((h.landed_at for h in loads if h.landed_at is not None), default=start)
        if self.replay is not None:
            end = start + self.replay.next("extend")
            stall = 0.0
        else:
            compute = self.cost.extend_seconds((len(w.token_ids), w.start) for w in work)
            end = self._end(start, compute, landed)
            if self._slowdown:
                compute *= 1 + self._slowdown * min(1.0, self.timer.overlap(start, end) / max(compute, 1e-12))
                end = self._end(start, compute, landed)
            stall = max(0.0, end - start - compute)
        self.stats.prefill_s += end - start
        self.stats.stall_s += stall
        self.stats.extend_steps += 1
        self.gpu_free_at = end
        return _SimStep([(w.row.request_id, w.row.generated) for w in work], start, end)

    def _end(self, start: float, compute: float, landed: float) -> float:
        if landed <= start:
            return start + compute
        if self.layerwise:
            return max(start + compute, landed + compute / self._layers)
        return landed + compute

    def dispatch_decode(self, rows: Sequence[SeqRow]) -> _SimStep:
        issued = self.clock.t
        start = max(issued, self.gpu_free_at)
        if self.replay is not None:
            seconds = self.replay.next("decode")
        else:
            seconds = self.cost.decode_seconds(len(rows), sum(map(_computed, rows)) + len(rows))
            if self._slowdown:
                seconds *= 1 + self._slowdown * min(
                    1.0, self.timer.overlap(start, start + seconds) / max(seconds, 1e-12)
                )
        end = start + seconds
        self.gpu_free_at = end
        self.stats.decode_s += seconds
        self.stats.decode_steps += 1
        return _SimStep(list(map(_id_and_generated, rows)), start, end)  # C-level loops: once per row per step

    def collect(self, pending: _SimStep) -> StepOutput:
        """Wait (in virtual time) for the step to end; its tokens come from ``token_for``."""
        self.clock.advance_to(pending.end)
        token_for = self.token_for
        return StepOutput([token_for(rid, index) for rid, index in pending.rows], pending.end - pending.start)
