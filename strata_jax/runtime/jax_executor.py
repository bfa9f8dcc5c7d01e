"""``JaxExecutor``: the ``strata_jax.engine.executor.Executor`` of the real model on real devices.

Dispatches extend work through ``ModelRunner.dispatch_extend`` in as few runner steps
as the runner's token/batch limits allow (one scheduler batch may exceed them) and
decodes through ``ModelRunner.dispatch_decode``, both without waiting (JAX async
dispatch); ``collect`` waits for a step and reads its tokens.  It keeps each running
request's row of device state in step with the request: a new row is written whole
before the request's first step, and afterwards only the page-table entries appended
(or replaced) since the last step travel with the next one.  The L2->L1 loads a batch
depends on need no waiting: the extend program reads the pool the loads wrote, so
JAX's data flow orders it after them.

Device time of a step (for the scheduler's cost model): a watcher thread blocks on each
dispatched step in turn and stamps when it finished, so the time is known even when the
host reads the step long after; a step's time runs from when the device could start it
(its dispatch, or the end of the step before) to that stamp.  ``device`` counts the
dispatches that found the device with nothing queued and the idle time before them (in a
pipelined loop, only when the host fell behind).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import numpy as np

from strata_jax.api import SamplingParams
from strata_jax.cache.handles import TransferHandle
from strata_jax.engine.executor import ExtendChunk, SeqRow, StepOutput
from strata_jax.runtime.logits_processors import initial_bias, initial_flags
from strata_jax.runtime.model_runner import ModelRunner, PendingStep, StepResult
from strata_jax.runtime.sampling_state import NoFreeSlotError
from strata_jax.runtime.sampling_step import to_token_logprob
from strata_jax.runtime.seq_state import RowParams, rng_base_for


@dataclass
class DeviceRow:
    """A running request's row of device state (``seq_state``): its slot, how many page-table
    entries the row holds (``synced``), whether it must be written whole (``dirty``), and the
    input token of its next decode when it is (``last_token``: known after a rewind; a new
    row's first step is an extend, which does not read it)."""

    slot: int
    synced: int = 0
    dirty: bool = True
    last_token: int = 0


@dataclass(eq=False)
class _Part:
    """One runner step of an executor step, and what each of its rows stands for."""

    step: PendingStep
    rows: Sequence[SeqRow]
    pieces: list[ExtendChunk[int]] | None = None  # extend: the chunk piece of each row
    items: list[int] | None = None  # extend: the work item of each piece
    last: list[bool] | None = None  # extend: the piece ends its work item


@dataclass(eq=False)
class _Dispatched:
    """One executor step: its runner steps (an extend may need several)."""

    parts: list[_Part]
    size: int  # work items (extend) or rows (decode)
    extend: bool
    dispatched_at: float
    finished: Future  # -> when the device finished it (the watcher's stamp)
    previous: Future | None  # the step dispatched just before (the device runs them in order)


@dataclass
class DeviceCounters:
    """How the device was fed: dispatches, how many found it with nothing queued, and the idle
    time before those whose previous step's end was seen (the host waited for it)."""

    dispatches: int = 0
    idle_dispatches: int = 0
    idle_s: float = 0.0
    idle_gaps: list[float] = field(default_factory=list)  # the last few gaps, seconds


class JaxExecutor:
    def __init__(self, runner: ModelRunner, *, eos_token_ids: Sequence[int] = ()) -> None:
        self.runner = runner
        self.eos_token_ids = tuple(eos_token_ids)
        self._slots: dict[str, int] = {}  # request id -> sampling-state slot
        self._rows: dict[str, DeviceRow] = {}  # request id -> its row of sequence state
        self._last: Future | None = None  # finish stamp of the step dispatched last
        self._watcher = ThreadPoolExecutor(1, thread_name_prefix="strata-step-watch")
        self.device = DeviceCounters()

    # ---- per-request device state ------------------------------------------------
    def open_sampling_state(
        self, request_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams
    ) -> bool:
        """Take a penalty/bias slot and write its rows once; False when every slot is held."""
        state = self.runner.sampling
        try:
            slot = state.acquire()
        except NoFreeSlotError:
            return False
        suppressed = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        flags = initial_flags(state.vocab_size, prompt_ids, suppressed if params.min_tokens else (), output_ids)
        state.seed(slot, flags, initial_bias(state.vocab_size, params.logit_bias))
        self._slots[request_id] = slot
        return True

    def close_sampling_state(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.runner.sampling.release(slot)

    def open_sequence(self, request_id: str) -> None:
        row = self._rows.get(request_id)
        if row is not None:  # (already running: written whole again)
            row.dirty = True
            return
        slot = self.runner.seqs.acquire()
        if slot is None:  # the scheduler caps running requests at the slot count
            raise RuntimeError(f"no sequence slot free for {request_id} ({self.runner.seqs.num_slots} running)")
        self._rows[request_id] = DeviceRow(slot)

    def close_sequence(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.runner.seqs.release(row.slot)

    def page_table_changed(self, request_id: str, index: int) -> None:
        row = self._rows.get(request_id)
        if row is not None:
            row.synced = min(row.synced, index)

    def rewind_row(self, request_id: str, last_token: int) -> None:
        row = self._rows.get(request_id)
        if row is not None:
            row.dirty = True
            row.last_token = last_token

    def slot_of(self, request_id: str) -> int | None:
        """The sequence slot a running request holds (None: not running)."""
        row = self._rows.get(request_id)
        return row.slot if row is not None else None

    def _row_params(self, row: SeqRow) -> RowParams:
        p = row.params
        return RowParams(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            sampling_slot=self._slots.get(row.request_id),
            min_tokens=p.min_tokens,
            want_logprobs=p.logprobs is not None,
            rng_base=rng_base_for(p.seed, row.request_id),
            constrained=row.grammar is not None,
            adapter_slot=row.adapter_slot,
        )

    def _sync_rows(self, rows: Sequence[SeqRow], capacity: int) -> tuple[list[int], np.ndarray | None]:
        """The rows' slots; new rows are written whole first.  Also returns the page-table
        entries changed since (``[k, 3]``), at most ``capacity`` of them (rows with more are
        rewritten whole instead)."""
        updates: list[tuple[int, int, int]] = []
        rewrite: list[tuple[SeqRow, DeviceRow, bool]] = []  # new rows, or page tables that changed too much
        slots = []
        for row in rows:
            dev = self._rows[row.request_id]
            slots.append(dev.slot)
            if dev.dirty:
                rewrite.append((row, dev, True))
                continue
            table = row.page_table
            n = len(table)
            if n > dev.synced:
                if n - dev.synced + len(updates) <= capacity:
                    slot = dev.slot
                    updates.extend((slot, i, table[i]) for i in range(dev.synced, n))
                    dev.synced = n
                else:
                    rewrite.append((row, dev, False))
        if rewrite:
            self.runner.seqs.write_rows(
                [
                    (
                        dev.slot,
                        row.page_table,
                        row.computed,
                        dev.last_token,
                        row.generated,
                        self._row_params(row) if whole else None,
                    )
                    for row, dev, whole in rewrite
                ]
            )
            for row, dev, _ in rewrite:
                dev.dirty = False
                dev.synced = len(row.page_table)
        constrained = [(slot, row) for slot, row in zip(slots, rows) if row.grammar is not None]
        if constrained:  # each one's mask for the token this step samples (computed when its last token was read)
            self.runner.seqs.write_masks(
                [slot for slot, _ in constrained], [row.grammar.mask for _, row in constrained]
            )
        return slots, np.asarray(updates, np.int32) if updates else None

    # ---- steps --------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str) -> jax.profiler.TraceAnnotation:
        return jax.profiler.TraceAnnotation(name)

    def idle(self) -> None:
        time.sleep(0.001)  # everything waits on a transfer or a deferral: don't spin

    def begin_step(self, decode_rows: int, prefill_rows: int, prefill_tokens: int) -> None:
        return None

    def dispatch_extend(self, work: list[ExtendChunk[SeqRow]], loads: Sequence[TransferHandle] = ()) -> _Dispatched:
        runner = self.runner
        limit_tokens, limit_seqs = runner.config.max_batch_tokens, runner.config.max_batch_size
        self._note_dispatch()
        parts: list[_Part] = []
        pending = [(i, w, list(w.token_ids), w.start) for i, w in enumerate(work)]
        while pending:
            batch: list[tuple[int, ExtendChunk[SeqRow], list[int], int, bool]] = []
            room, rest = limit_tokens, []
            for i, w, tokens, start in pending:
                # a verification is never split: its picks follow its tokens within one step
                # (RunnerConfig refuses k + 1 > max_batch_tokens, so an empty batch holds one)
                if room <= 0 or len(batch) >= limit_seqs or (w.verify and len(tokens) > room and batch):
                    rest.append((i, w, tokens, start))
                    continue
                piece = tokens[:room]
                last_piece = len(piece) == len(tokens)
                batch.append((i, w, piece, start, last_piece))
                room -= len(piece)
                if not last_piece:
                    rest.append((i, w, tokens[len(piece) :], start + len(piece)))
            rows = [w.row for _, w, _, _, _ in batch]
            capacity = runner.update_capacity(sum(len(p) for _, _, p, _, _ in batch), len(batch))
            slots, updates = self._sync_rows(rows, capacity)
            pieces = []
            for slot, (_, w, piece, start, last_piece) in zip(slots, batch):
                targets = None
                if w.verify:  # any target switches on the per-position head; its top id is the greedy token
                    targets = [0] * len(piece)
                elif w.prompt_logprob_targets is not None:
                    first = start - w.start
                    targets = list(w.prompt_logprob_targets[first : first + len(piece)])
                pieces.append(
                    ExtendChunk(slot, piece, start, w.keep_sample and last_piece, targets, w.verify, w.device_token)
                )
            want_lp = any(
                w.row.params.logprobs is not None and p.keep_sample for (_, w, _, _, _), p in zip(batch, pieces)
            )
            step = runner.dispatch_extend(pieces, updates=updates, logprobs=want_lp)
            parts.append(_Part(step, rows, pieces, [i for i, *_ in batch], [b[4] for b in batch]))
            pending = rest
        return self._dispatched(parts, len(work), extend=True)

    def dispatch_decode(self, rows: Sequence[SeqRow]) -> _Dispatched:
        self._note_dispatch()
        slots, updates = self._sync_rows(rows, self.runner.update_capacity(len(rows), len(rows)))
        want_lp = any(row.params.logprobs is not None for row in rows)
        step = self.runner.dispatch_decode(np.asarray(slots, np.int32), updates=updates, logprobs=want_lp)
        return self._dispatched([_Part(step, rows)], len(rows), extend=False)

    def _dispatched(self, parts: list[_Part], size: int, *, extend: bool) -> _Dispatched:
        arrays = [part.step.next_tokens for part in parts]
        d = _Dispatched(
            parts, size, extend, time.perf_counter(), self._watcher.submit(_finished_at, arrays), self._last
        )
        self._last = d.finished
        return d

    def _note_dispatch(self) -> None:
        """Count a dispatch, and whether the device had run out of queued work before it."""
        now = time.perf_counter()
        self.device.dispatches += 1
        if self._last is not None and not self._last.done():
            return  # the device has queued work: this step starts when that ends
        self.device.idle_dispatches += 1
        if self._last is not None:
            gap = max(0.0, now - self._last.result())
            self.device.idle_s += gap
            self.device.idle_gaps.append(gap)
            del self.device.idle_gaps[:-256]

    def collect(self, pending: _Dispatched) -> StepOutput:
        out = StepOutput([0] * pending.size if pending.extend else [], None)
        for part in pending.parts:
            result = part.step.result()
            if pending.extend:
                self._collect_extend(part, result, out)
            else:
                self._collect_decode(part, result, out)
        end = pending.finished.result()
        # Steps run in dispatch order: this one started at its dispatch or when the one before ended.
        start = pending.dispatched_at
        if pending.previous is not None:
            start = max(start, pending.previous.result())
        pending.previous = None  # no chain of every step ever dispatched
        out.seconds = max(0.0, end - start)
        return out

    def close(self) -> None:
        self._watcher.shutdown(wait=False)

    @staticmethod
    def _collect_decode(part: _Part, result: StepResult, out: StepOutput) -> None:
        out.tokens = tokens = result.next_tokens.tolist()
        if result.sample_logprobs is not None:
            for i, row in enumerate(part.rows):
                k = row.params.logprobs
                if k is not None:
                    out.logprobs[i] = to_token_logprob(result.sample_logprobs, i, tokens[i], k)

    @staticmethod
    def _collect_extend(part: _Part, result: StepResult, out: StepOutput) -> None:
        tokens = result.next_tokens.tolist()
        assert part.pieces is not None and part.items is not None and part.last is not None  # an extend part
        offset = 0
        for i, (row, piece, item, last) in enumerate(zip(part.rows, part.pieces, part.items, part.last)):
            p = row.params
            if last:
                out.tokens[item] = tokens[i]
                if p.logprobs is not None and piece.keep_sample and result.sample_logprobs is not None:
                    out.logprobs[item] = to_token_logprob(result.sample_logprobs, i, tokens[i], p.logprobs)
            if piece.verify:
                # (its targets asked for the per-position head; the logprob at a pick is the pick's)
                assert result.prompt_logprobs is not None and result.verify_picks is not None
                picks = result.verify_picks[offset : offset + len(piece.token_ids)].tolist()
                out.picks[item] = picks
                if p.logprobs is not None:
                    out.pick_logprobs[item] = [
                        to_token_logprob(result.prompt_logprobs, offset + j, token, p.logprobs)
                        for j, token in enumerate(picks)
                    ]
            elif piece.prompt_logprob_targets is not None and result.prompt_logprobs is not None:
                got = out.prompt_logprobs.setdefault(item, [])
                for j, target in enumerate(piece.prompt_logprob_targets):
                    if target >= 0:
                        got.append(to_token_logprob(result.prompt_logprobs, offset + j, target, p.prompt_logprobs or 0))
            offset += len(piece.token_ids)


def _finished_at(arrays: list[jax.Array]) -> float:
    """(On the watcher thread) block until the step's outputs are computed; when that was.
    A step that fails has finished too: ``collect`` raises its error, not this stamp."""
    for a in arrays:
        try:
            a.block_until_ready()
        except Exception:  # reported by the step's own result()
            pass
    return time.perf_counter()
