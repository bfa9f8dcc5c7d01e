"""Drive one simulated run: a workload through ``EngineCore`` on a ``SimExecutor``.

The same ``Scheduler``, ``CacheController`` (bookkeeping-only, its transfers
landing in virtual time) and engine step the real engine runs; requests are
submitted when their arrival time has come (multi-turn turns once their previous
turn finished), and time jumps to the next event when nothing can run.  Nothing
here imports jax.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strata_jax.api import SamplingParams, StreamChunk
from strata_jax.cache.config import CacheConfig, KVTierFormat, WritePolicy
from strata_jax.cache.controller import CacheController
from strata_jax.engine.core import EngineCore
from strata_jax.engine.requests import TrackedRequest
from strata_jax.engine.sinks import OutputSink
from strata_jax.scheduler.config import SchedulerConfig
from strata_jax.scheduler.cost_model import CostModel, CostPrior
from strata_jax.scheduler.scheduler import Scheduler
from strata_jax.sim.cost import SimCostModel
from strata_jax.sim.executor import SimClock, SimExecutor, SimTimer, StepTimes
from strata_jax.sim.host_model import HostModel
from strata_jax.sim.model_spec import ModelSpec
from strata_jax.sim.profile import HardwareProfile
from strata_jax.sim.systems import SystemSpec
from strata_jax.sim.workloads import SimRequest, cached_sequence_tokens

_OUTPUT_BASE = 1 << 40  # output token ids: far from every prompt id, unique per request and position


@dataclass(frozen=True)
class SimSetup:
    """Machine, model and cache sizing of a simulation (``None``: derived from the profile)."""

    model: ModelSpec
    profile: HardwareProfile
    page_size: int = 32
    device_tokens: int | None = None
    host_tokens: int | None = None
    write_policy: WritePolicy = "write_through"
    max_batch_tokens: int = 8192
    host: HostModel | None = None  # the engine's host path per step (None: free)
    pipeline: bool = True  # the engine's loop overlaps the host with the device
    tier_format: KVTierFormat = "full"  # L2/L3 format: full (bf16), fp8 or int8 (loads and L2 hold the smaller pages)
    # A window-aware hierarchy (models with sliding-window layers): loads move only the pages each
    # layer's window needs (sim/cost.py), and L1/L2 hold a cached page at ``cached_share`` of its
    # bytes (None: with window_loads, the workload's, ModelSpec.cached_share over
    # workloads.cached_sequence_tokens; else 1.0).  device_tokens/host_tokens, when given,
    # are taken as they are (tokens of cached sequences, whatever their bytes).
    window_loads: bool = False
    cached_share: float | None = None
    # storage reads window-sized too (None: as window_loads); False mirrors the engine, whose L3
    # objects hold every layer of a page (sim/cost.py)
    storage_window_reads: bool | None = None


@dataclass
class RunResult:
    system: str
    rate: float
    ttft_mean: float
    ttft_p99: float
    throughput_rps: float
    output_tps: float
    load_stall_fraction: float
    hit_rate: float
    finished: int = 0
    simulated_s: float = 0.0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # each measured request in arrival order: arrival, TTFT, what each tier gave it (kept out of
    # ``row()``: a study's JSON need not carry a record per request)
    per_request: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict:
        keys = (
            "system",
            "rate",
            "ttft_mean",
            "ttft_p99",
            "throughput_rps",
            "output_tps",
            "load_stall_fraction",
            "hit_rate",
        )
        return {k: getattr(self, k) for k in keys} | {
            "finished": self.finished,
            "simulated_s": self.simulated_s,
            **self.extra,
        }


class _Sink(OutputSink):
    final_only = True  # the run's metrics need the last chunk of each request

    def __init__(self, on_finish: Callable[[StreamChunk], None]) -> None:
        self.on_finish = on_finish

    def push(self, chunk: StreamChunk) -> None:
        if chunk.finished:
            self.on_finish(chunk)

    def fail(self, exc: BaseException) -> None:
        raise RuntimeError(f"a simulated request failed: {exc}") from exc


def build_core(
    system: SystemSpec,
    setup: SimSetup,
    *,
    token_for: Callable[[str, int], int],
    next_arrival: Callable[[], float | None],
    replay: StepTimes | None = None,
    cost_prior: CostPrior | None = None,
    scheduler_overrides: dict | None = None,
) -> tuple[EngineCore, SimExecutor, SimTimer]:
    clock = SimClock()
    share = 1.0 if setup.cached_share is None else setup.cached_share
    cost = SimCostModel(
        setup.profile,
        setup.model,
        setup.page_size,
        setup.tier_format,
        setup.window_loads,
        share,
        storage_window_reads=setup.storage_window_reads,
    )
    timer = SimTimer(clock, cost, system.io_path)
    page_bytes = cost.tier_page_bytes  # what L2 holds and a load moves per page
    device_tokens = setup.device_tokens or cost.device_kv_tokens()
    host_tokens = setup.host_tokens if setup.host_tokens is not None else cost.host_kv_tokens()
    cache_config = CacheConfig(
        page_size=setup.page_size,
        device_tokens=device_tokens // setup.page_size * setup.page_size,
        host_bytes=max(1, host_tokens // setup.page_size) * page_bytes,
        tiers=system.tiers,
        write_policy=setup.write_policy,
        kv_tier_format=setup.tier_format,
    )
    ctl = CacheController.simulated(cache_config, page_bytes=page_bytes, clock=clock.now, timer=timer)
    prior = cost_prior or CostPrior(
        bytes_per_token=max(1, page_bytes // setup.page_size),  # the tier's: the scheduler weighs real bytes
        link_bytes_per_s=setup.profile.link_peak_bytes_per_s * setup.profile.coalesced_efficiency,
        storage_bytes_per_s=setup.profile.storage_read_bytes_per_s,
        transfer_overhead_s=setup.profile.transfer_overhead_s,
    )
    sched_cfg = SchedulerConfig(
        **{
            "max_batch_tokens": setup.max_batch_tokens,
            "max_waiting": 1 << 30,
            **system.scheduler_kwargs(),
            **(scheduler_overrides or {}),
        }
    )
    scheduler = Scheduler(sched_cfg, CostModel(prior))

    def next_event() -> float | None:
        times = [t for t in (next_arrival(), ctl.next_landing()) if t is not None]
        return min(times) if times else None

    executor = SimExecutor(
        clock,
        cost,
        timer,
        layerwise=system.layerwise,
        token_for=token_for,
        next_event=next_event,
        replay=replay,
        host=setup.host,
    )
    core = EngineCore(
        scheduler,
        ctl,
        executor,
        eos_token_ids=(),
        max_context_tokens=setup.model.config.max_context_tokens,
        pipeline=setup.pipeline,
    )
    return core, executor, timer


def simulate(
    requests: list[SimRequest],
    system: SystemSpec,
    setup: SimSetup,
    rate: float,
    *,
    progress: Callable[[int], None] | None = None,
    scheduler_overrides: dict[str, Any] | None = None,
) -> RunResult:
    """Run ``requests`` (arrival times already set) through ``system``; returns the run's metrics.
    ``scheduler_overrides``: ``SchedulerConfig`` fields over the system's (``bench twin``: the engine's).

    Warm-up requests (``SimRequest.warmup``) run first, all at t=0, until they drain;
    the measured requests' arrival times then count from that moment, and every
    metric (TTFT, throughput, hit rate, stall share, counters) covers them alone.
    """
    wall0 = time.perf_counter()
    if setup.window_loads and setup.cached_share is None:
        share = setup.model.cached_share(cached_sequence_tokens(requests), setup.page_size)
        setup = dataclasses.replace(setup, cached_share=share)
    measured = [i for i, r in enumerate(requests) if not r.warmup]
    dependents: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.depends_on is not None:
            dependents.setdefault(r.depends_on, []).append(i)
    prompts: dict[int, list[int]] = {i: r.prompt for i, r in enumerate(requests) if r.depends_on is None}
    outputs: dict[int, list[int]] = {}
    heap: list[tuple[float, int]] = [(0.0, i) for i, r in enumerate(requests) if r.warmup]
    offset = 0.0  # when the measured stream starts on the virtual clock
    per_request: list[dict[str, Any]] = []  # each measured request: arrival, TTFT, what each tier gave it
    finished_at: list[float] = []
    out_tokens = 0
    prompt_tokens = 0
    reported: dict[str, int] = {}  # cached tokens per tier as the requests' outputs report them

    def token_for(rid: str, index: int) -> int:
        return _OUTPUT_BASE + int(rid[1:]) * (1 << 20) + index

    core, executor, _ = build_core(
        system,
        setup,
        token_for=token_for,
        next_arrival=lambda: heap[0][0] if heap else None,
        scheduler_overrides=scheduler_overrides,
    )
    clock = executor.clock

    def on_finish(i: int, chunk: StreamChunk) -> None:
        nonlocal out_tokens
        outputs[i] = [token_for(f"r{i}", k) for k in range(chunk.completion_tokens)]
        for j in dependents.pop(i, ()):
            prompts[j] = prompts[i] + outputs[i] + requests[j].new_tokens
            heapq.heappush(heap, (max(requests[j].arrival_s + offset, clock.t), j))
        prompts.pop(i, None)
        if requests[i].warmup:
            return
        assert chunk.ttft_s is not None  # set on every last chunk
        per_request.append(
            {"arrival_s": requests[i].arrival_s, "ttft_s": chunk.ttft_s, "cached_tokens": dict(chunk.cached_tokens)}
        )
        for tier, n in chunk.cached_tokens.items():
            reported[tier] = reported.get(tier, 0) + n
        finished_at.append(clock.t)
        out_tokens += chunk.completion_tokens
        if progress is not None:
            progress(1)

    def drain() -> None:
        nonlocal prompt_tokens
        heapq.heapify(heap)
        while heap or core.has_live_requests() or core.has_pending_step():
            while heap and heap[0][0] <= clock.t:
                arrival, i = heapq.heappop(heap)
                prompt = prompts[i]  # kept until it finishes if a later turn extends it
                if not requests[i].warmup:
                    prompt_tokens += len(prompt)
                t = TrackedRequest(
                    request_id=f"r{i}",
                    prompt_ids=prompt,
                    namespace="",
                    params=SamplingParams(max_tokens=requests[i].output_len, ignore_eos=True),
                    sink=_Sink(functools.partial(on_finish, i)),
                    detok=None,
                    submitted_at=arrival,
                )
                core.admit(t)
                if i not in dependents:
                    prompts.pop(i)
            if core.scheduler.has_work() or core.has_pending_step():
                core.step()
            elif heap:
                executor.stats.idle_s += max(0.0, heap[0][0] - clock.t)
                clock.advance_to(heap[0][0])

    drain()  # the warm-up, if any
    offset = clock.t
    before = _Counters.read(core, executor)
    heap[:] = [(requests[i].arrival_s + offset, i) for i in measured if requests[i].depends_on is None]
    drain()
    c = _Counters.read(core, executor).minus(before)
    first = min((requests[i].arrival_s for i in measured), default=0.0) + offset
    span = max(1e-9, (max(finished_at) if finished_at else first) - first)
    ttft = [r["ttft_s"] for r in per_request]
    ttft_sorted = sorted(ttft)
    p99 = ttft_sorted[min(len(ttft_sorted) - 1, math.ceil(0.99 * len(ttft_sorted)) - 1)] if ttft_sorted else 0.0
    hits = sum(c.hit_tokens.values())
    return RunResult(
        system=system.name,
        rate=rate,
        ttft_mean=sum(ttft) / len(ttft) if ttft else 0.0,
        ttft_p99=p99,
        throughput_rps=len(finished_at) / span,
        output_tps=out_tokens / span,
        load_stall_fraction=c.stall_s / c.prefill_s if c.prefill_s else 0.0,
        hit_rate=hits / prompt_tokens if prompt_tokens else 0.0,
        finished=len(finished_at),
        simulated_s=clock.t - offset,
        wall_s=time.perf_counter() - wall0,
        extra={
            "ttft_p90": ttft_sorted[min(len(ttft_sorted) - 1, math.ceil(0.9 * len(ttft_sorted)) - 1)]
            if ttft_sorted
            else 0.0,
            "hit_tokens": dict(c.hit_tokens),
            "reported_cached_tokens": reported,
            "deferrals": c.deferrals,
            "set_asides": c.set_asides,
            "bundle_hits": c.bundle_hits,
            "decode_first_rounds": c.decode_first_rounds,
            "mixed_rounds": c.mixed_rounds,
            "load_or_recompute_requests": c.load_or_recompute_requests,
            "load_or_recompute_tokens": c.load_or_recompute_tokens,
            "prefill_busy_s": c.prefill_s,
            "prefill_stall_s": c.stall_s,
            "decode_busy_s": c.decode_s,
            "h2d_link_busy_s": c.h2d_busy_s,
            "loaded_pages": c.loaded_pages,
            "backed_up_pages": c.backed_up_pages,
            "requests": len(measured),
            "warmup_requests": len(requests) - len(measured),
            "warmup_s": offset,
            "cached_share": 1.0 if setup.cached_share is None else setup.cached_share,
            "l1_tokens": core.ctl.device_alloc.num_pages * setup.page_size,
            "l2_tokens": core.ctl.host_alloc.num_pages * setup.page_size,
        },
        per_request=sorted(per_request, key=lambda r: r["arrival_s"]),
    )


@dataclass(frozen=True)
class _Counters:
    """The run's cumulative counters at one moment; ``minus`` gives a phase's share."""

    hit_tokens: dict
    deferrals: int
    set_asides: int
    bundle_hits: int
    decode_first_rounds: int
    mixed_rounds: int
    load_or_recompute_requests: int
    load_or_recompute_tokens: int
    prefill_s: float
    stall_s: float
    decode_s: float
    h2d_busy_s: float
    loaded_pages: int
    backed_up_pages: int

    @classmethod
    def read(cls, core: EngineCore, executor: SimExecutor) -> _Counters:
        s, st = core.scheduler.stats(), executor.stats
        return cls(
            hit_tokens=dict(s.hit_tokens),
            deferrals=s.deferrals,
            set_asides=s.set_asides,
            bundle_hits=s.bundle_hits,
            decode_first_rounds=s.decode_first_rounds,
            mixed_rounds=s.mixed_rounds,
            load_or_recompute_requests=s.load_or_recompute_recomputed,
            load_or_recompute_tokens=s.load_or_recompute_tokens,
            prefill_s=st.prefill_s,
            stall_s=st.stall_s,
            decode_s=st.decode_s,
            h2d_busy_s=executor.timer.h2d.busy_s,
            loaded_pages=core.ctl.counters["loaded_pages"],
            backed_up_pages=core.ctl.counters["backed_up_pages"],
        )

    def minus(self, earlier: _Counters) -> _Counters:
        values: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            now, then = getattr(self, name), getattr(earlier, name)
            values[name] = {k: v - then.get(k, 0) for k, v in now.items()} if isinstance(now, dict) else now - then
        return _Counters(**values)
