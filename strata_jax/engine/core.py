"""``EngineCore``: the engine step and the request life cycle, on any ``Executor``.

One step is five calls (docs/design.md §2)::

    poll -> schedule -> load -> run (dispatch extend / decode) -> postprocess

and the loop is a pipeline: ``run`` dispatches step N+1 and returns at once, and
``postprocess`` then reads step N's tokens, which the device computed while the host
scheduled N+1.  A decode's input is its row's last sample, read on the device, so
N+1 needs nothing of N on the host.  What that asks of the bookkeeping:

* the scheduler is told a chunk or a decode is done when it is *dispatched* (the token
  will exist; its value is the engine's business), so it can plan N+1 at once;
* stop rules that need the token's value (EOS, stop ids, stop strings) apply one step
  late: a request that stopped at N may have a token computed at N+1, which is
  discarded, never shown; a length stop is known at dispatch, so it costs nothing;
* a round that may retract a decode (device memory short) first reads the step in
  flight: retraction writes the request's tokens into the tree.

``pipeline=False`` reads each step's tokens right after dispatching it (the serial
loop, kept to compare against).  This module is pure Python (no jax): the real engine
(``strata_jax.engine.Engine``, a ``JaxExecutor``) and the simulator (``strata_jax.sim``,
a ``SimExecutor``) run exactly this code with the same ``Scheduler`` and
``CacheController``.  Called from one thread only (the engine's loop, or the
simulator's driver).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from strata_jax.api import EngineUnavailableError, InvalidRequestError, OverloadedError, StepFailedError, TokenLogprob
from strata_jax.cache.controller import CacheController
from strata_jax.cache.handles import CacheFullError, TransferHandle
from strata_jax.engine.cache_view import EngineCacheView
from strata_jax.engine.executor import Executor, ExtendChunk, SeqRow
from strata_jax.engine.output import Event, FailEvent, InlineOutput, StopRules, TokenEvent
from strata_jax.engine.requests import RequestPages, TrackedRequest
from strata_jax.engine.speculation import Speculator
from strata_jax.kv_events.recorder import KVEventRecorder
from strata_jax.scheduler.plan import PrefillItem, StepPlan
from strata_jax.scheduler.request import RequestStatus
from strata_jax.scheduler.scheduler import Scheduler

log = logging.getLogger("strata_jax.engine")


@dataclass(frozen=True)
class PlanRecord:
    """What one step decided, as the engine executed it (for tests comparing executors)."""

    round: int
    prefill: tuple[tuple[str, int, int], ...]  # (request id, start, end)
    decode: tuple[str, ...]
    deferred: tuple[str, ...]
    set_aside: tuple[str, ...]
    decode_first: bool
    mixed: bool = False  # the decode rows rode in the extend's program


@dataclass
class InflightStep:
    """A dispatched step whose tokens the host has not read yet."""

    extend: Any = None
    extend_items: list[tuple[PrefillItem, TrackedRequest]] = field(default_factory=list)
    extend_landed: bool = True  # its loads had landed at dispatch: its time is compute alone
    decode: Any = None
    decode_rows: list[TrackedRequest] = field(default_factory=list)
    decode_context: int = 0
    # a mixed step: the decode rows ride in ``extend`` (after its prompt chunks; ``decode`` is None)
    decode_in_extend: bool = False
    decode_lengths: list[int] = field(default_factory=list)  # (mixed) each row's KV length at dispatch
    verify: Any = None  # speculating rows' verification (an extend of their last token + proposals)
    verify_rows: list[tuple[TrackedRequest, list[int]]] = field(default_factory=list)  # (row, its proposal)
    holds_rows: bool = False  # a row waits for its token here before its next step (a grammar's mask, a proposal)


class EngineCore:
    """The step loop over a scheduler, a cache controller and an executor."""

    def __init__(
        self,
        scheduler: Scheduler,
        ctl: CacheController[Any],
        executor: Executor,
        *,
        eos_token_ids: Collection[int],
        max_context_tokens: int,
        outputs: Any = None,
        pipeline: bool = True,
        speculator: Speculator | None = None,
        publish_chunks: bool = False,
    ) -> None:
        """``outputs``: where each step's token events go (``emit(events)``); default: an
        ``InlineOutput`` delivering them in this thread.  ``pipeline``: dispatch step N+1
        before reading step N's tokens (False: the serial loop).  ``speculator``: greedy
        rows propose tokens and verify them in one step (``engine.speculation``).
        ``publish_chunks``: every prefill chunk's full pages go to the tree as the chunk is
        dispatched (``EngineConfig.publish_prefill_chunks``), not only the last chunk's."""
        self.scheduler = scheduler
        self.ctl = ctl
        self.executor = executor
        self.page_size = ctl.page_size
        self.eos_token_ids = eos_token_ids
        self.max_context_tokens = max_context_tokens
        self.rules = StopRules(eos_token_ids, max_context_tokens)
        self.pipeline = pipeline
        self.speculator = speculator
        self.publish_chunks = publish_chunks
        self._stops: list[str] = []  # stop strings matched by an inline output side, applied at the next step
        self.outputs = outputs if outputs is not None else InlineOutput(self._stops.append)
        self.pages = RequestPages(ctl)
        self._view = EngineCacheView(ctl, lambda rid: rid in self._tracked and self._tracked[rid].bypasses_cache)
        self._tracked: dict[str, TrackedRequest] = {}
        self._parked: deque[TrackedRequest] = deque()  # waiting for a sampling-state slot
        self._inflight: InflightStep | None = None
        self._touched: set[str] | None = set()  # requests the step under way has touched (None: all)
        self._unsent: list[Event] = []  # a step's token events, sent when the loop next waits for the device
        self._stopping = False
        self.counters = {
            "steps": 0,
            "prefill_steps": 0,
            "decode_steps": 0,
            "finished": 0,
            "aborted": 0,
            "failed": 0,
            "pipeline_drains": 0,
            "held_row_drains": 0,
            "overlapped_steps": 0,
            "mixed_steps": 0,  # prefill steps that carried the decode rows' tokens too
        }
        self.plan_log: list[PlanRecord] | None = None  # set to [] to record every step's decisions
        self.kv_event_recorder: KVEventRecorder | None = None  # set by the engine when KV events are published

    # ------------------------------------------------------------------ public
    def admit(self, t: TrackedRequest) -> None:
        """Take a new request (validated by the caller); its output goes to ``t.sink``."""
        if self._stopping:
            self._fail([FailEvent(t.stream, EngineUnavailableError("the engine is shutting down"))])
            return
        if t.follows is not None:
            leader = self._tracked.get(t.follows)
            if leader is not None and not leader.prefix_published:
                leader.followers.append(t)  # admitted when the leader's prompt pages are in the tree
                return
        if t.params.needs_sampling_state and (
            self._parked or not self.executor.open_sampling_state(t.request_id, t.prompt_ids, t.output_ids, t.params)
        ):
            self._parked.append(t)  # admitted when a slot frees (FIFO)
            return
        self._enter(t)

    def _enter(self, t: TrackedRequest) -> None:
        """Queue an admitted request (holding its sampling-state slot if it needs one)."""
        try:
            req = self.scheduler.submit(t.request_id, t.prompt_ids, namespace=t.namespace)
        except (OverloadedError, InvalidRequestError) as exc:
            self._close_state(t)
            self._fail([FailEvent(t.stream, exc)])
            return
        t.req = req
        self._tracked[t.request_id] = t
        match = self.pages.admit(t, req.prefill_tokens)
        if match is not None:
            self._view.remember(t.request_id, match)  # the scheduler's first match walks from it

    def abort(self, request_id: str, exc: BaseException) -> bool:
        """End a request now with ``exc``; False if it is not live."""
        t = self._tracked.pop(request_id, None)
        if t is None:
            parked = next((p for p in self._parked if p.request_id == request_id), None)
            if parked is None:
                return False
            self._parked.remove(parked)
            self.counters["aborted"] += 1
            self._fail([FailEvent(parked.stream, exc)])
            return True
        if not t.finishing:
            self.scheduler.abort(request_id)
        self._view.forget(request_id)
        self.pages.release(t, keep=False)
        self._leave(t)
        if not self._stopping:
            self._admit_followers(t)  # they compute the prompt themselves
        else:
            self._fail([FailEvent(f.stream, exc) for f in t.followers])
        self.counters["aborted"] += 1
        self._fail([FailEvent(t.stream, exc)])
        return True

    def stop_request(self, request_id: str) -> None:
        """The output side ended the request (a stop string): stop computing it, keep its KV."""
        t = self._tracked.get(request_id)
        if t is None:
            return
        req = self.scheduler.get(request_id)
        if t.finishing or (req is not None and req.status is RequestStatus.DECODING and not req.decode_inflight):
            self._finish(t)
        else:  # re-queued by a retraction: nothing of it runs
            self.scheduler.abort(request_id)
            del self._tracked[request_id]
            self._view.forget(request_id)
            self.pages.release(t, keep=False)
            self._leave(t)
            self._admit_followers(t)
            self.counters["finished"] += 1

    def _live_ids(self) -> set[str]:
        return set(self._tracked) | {p.request_id for p in self._parked}

    def reject(self, t: TrackedRequest, exc: BaseException) -> None:
        """Fail a request that was never admitted (its adapter went away while it was queued)."""
        self._fail([FailEvent(t.stream, exc)])

    def every_request(self) -> list[TrackedRequest]:
        """Every live request: running or queued, parked for a sampling slot, or following a leader."""
        everyone = list(self._tracked.values()) + list(self._parked)
        return everyone + [f for t in everyone for f in t.followers]

    def has_live_requests(self) -> bool:
        return bool(self._tracked)

    def has_pending_step(self) -> bool:
        return self._inflight is not None

    @property
    def live_requests(self) -> dict[str, TrackedRequest]:
        return self._tracked

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        span = self.executor.span
        self._touched = None  # until the plan exists, a failure concerns every live request
        while self._stops:
            self.stop_request(self._stops.pop(0))
        with span("poll"):
            self._poll()
        if self._inflight is not None and self._inflight.holds_rows:
            # A held row (a grammar's) could join only the step after next: its batch would
            # split in two halves decoding in turn, each paying a full step.  Read it first.
            with span("postprocess"):
                self.counters["held_row_drains"] += 1
                self._complete(self._take_inflight())
        if self._inflight is not None and self._may_retract():
            with span("postprocess"):  # retraction writes a request's tokens into the tree: read them first
                self.counters["pipeline_drains"] += 1
                self._complete(self._take_inflight())
        with span("schedule"):
            plan = self.scheduler.schedule(self._view)
        self._touched = _plan_requests(plan) | _step_requests(self._inflight)
        with span("load_kv"):
            dropped = self._pin_and_make_room(plan)
        launched = self._run(plan, dropped)
        with span("postprocess"):
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self.counters["overlapped_steps"] += launched is not None  # dispatched before the last one was read
                self._complete(previous)
            if not self.pipeline and self._inflight is not None:
                self._complete(self._take_inflight())
        self.counters["steps"] += 1
        self._touched = set()  # the step is over: a failure from here on is the next step's
        if self.kv_event_recorder is not None:
            self.kv_event_recorder.end_step()
        if launched is None and previous is None:
            self.executor.idle()

    def finish_pending(self) -> None:
        """Read the step in flight, if any (the pipeline drains), and send every event."""
        if self._inflight is not None:
            self._complete(self._take_inflight())
        self._send()

    def _take_inflight(self) -> InflightStep:
        step, self._inflight = self._inflight, None
        assert step is not None
        return step

    def _poll(self) -> None:
        for handle in self.ctl.poll():
            if handle.kind == "load" and handle.service_seconds is not None:
                self.scheduler.cost.observe_load(handle.num_pages * self.page_size, handle.service_seconds, tier="host")
        measured = self.ctl.storage_read_bandwidth if self.ctl.storage is not None else None
        if measured is not None:
            self.scheduler.cost.set_storage_rate(measured)  # (an average over recent prefetch reads)

    def _may_retract(self) -> bool:
        """Could this round retract a decode?  Only if the decodes' next pages may not fit."""
        sched = self.scheduler
        decodes = min(sched.num_decoding, sched.config.max_decode_batch_size)
        return self.ctl.free_device_tokens() + self.ctl.evictable_device_tokens() < decodes * self.page_size

    # ------------------------------------------------------------------ load
    def _pin_and_make_room(self, plan: StepPlan) -> set[str]:
        """Retractions; pin each first chunk's cached prefix; evict; pages for the decodes.

        Returns the requests that could not get device pages (aborted with an error;
        the scheduler's plan should never come to this, but the engine must not die).
        """
        for req in plan.retract:
            t = self._tracked[req.request_id]
            self.pages.retract(t)
            self._close_sequence(t)
        for item in plan.prefill:
            if item.is_first_chunk:
                self.pages.pin_prefix(self._tracked[item.request_id], item)
        if plan.evict_device_tokens:
            self.ctl.evict_device(-(-plan.evict_device_tokens // self.page_size))
        return self._allocate([(req.request_id, req.computed, req.computed + 1) for req in plan.decode])

    def _allocate(self, work: list[tuple[str, int, int]]) -> set[str]:
        """Device pages for each ``(request id, tokens computed, tokens to hold)``."""
        dropped: set[str] = set()
        for rid, computed, tokens in work:
            try:
                self.pages.ensure_pages(self._tracked[rid], tokens, computed)
            except CacheFullError as exc:
                log.error("request %s: %s", rid, exc)
                self.abort(rid, OverloadedError(f"out of device KV memory: {exc}"))
                dropped.add(rid)
        return dropped

    def _load_prefixes(
        self, prefill: list[PrefillItem], loads: list[TransferHandle]
    ) -> tuple[list[PrefillItem], set[str]]:
        """Load pinned host-only prefixes L2->L1 (one coalesced transfer each), then pages for
        the chunks.  Returns the chunks as they will run and the requests that got no pages.

        A first chunk that takes less of its cached prefix than planned (its L3 prefetch did
        not land, or there was no room to load) computes from there as many tokens as planned,
        not the whole gap: the plan budgeted device pages for that many (the rest of the
        prompt comes in later chunks)."""
        items: list[PrefillItem] = []
        for item in prefill:
            if item.is_first_chunk:
                handle, taken = self.pages.take_prefix(self._tracked[item.request_id], item)
                if taken != item.start:
                    end = min(item.end, taken + item.new_tokens)
                    self.scheduler.on_prefix_taken(item.request_id, taken, end)
                    item = dataclasses.replace(item, start=taken, end=end)
                if handle is not None:
                    loads.append(handle)
            items.append(item)
        return items, self._allocate([(item.request_id, item.start, item.end) for item in items])

    # ------------------------------------------------------------------ run
    def _run(self, plan: StepPlan, dropped: set[str]) -> InflightStep | None:
        """Dispatch the plan's extend and decode (in its order, loads between) without waiting."""
        span = self.executor.span
        prefill = [item for item in plan.prefill if item.request_id not in dropped]
        decode = [self._tracked[req.request_id] for req in plan.decode if req.request_id not in dropped]
        decode, verify = self._split_speculating(decode)
        if prefill or decode or verify:
            self.executor.begin_step(len(decode) + len(verify), len(prefill), sum(item.new_tokens for item in prefill))
        step = InflightStep()
        loads: list[TransferHandle] = []
        if plan.decode_first:
            # Bubble filling: the decode is dispatched before the loads, so the link
            # transfers run while the device decodes; the loads' scatters queue behind it.
            self._dispatch_decode(decode, step)
            with span("load_kv"):
                prefill, no_pages = self._load_prefixes(prefill, loads)
            dropped |= no_pages
            prefill = [item for item in prefill if item.request_id not in dropped]
            self._dispatch_extend(prefill, loads, step)
        else:
            with span("load_kv"):
                prefill, no_pages = self._load_prefixes(prefill, loads)
            dropped |= no_pages
            prefill = [item for item in prefill if item.request_id not in dropped]
            if plan.mixed and prefill and decode:  # one program: the chunks and a token per decode row
                self._dispatch_extend(prefill, loads, step, decode)
            else:
                self._dispatch_extend(prefill, loads, step)
                self._dispatch_decode(decode, step)
        # Last, so the extra pages its proposals need come after every page the plan budgeted.
        self._dispatch_verify(verify, step)
        if self.plan_log is not None:
            decoded = [t.request_id for t in step.decode_rows] + [t.request_id for t, _ in step.verify_rows]
            self.plan_log.append(_record(plan, prefill, decoded, step.decode_in_extend))
        for rid in dropped:  # aborted before dispatch: clear the scheduler's in-flight mark
            if any(item.request_id == rid for item in plan.prefill):
                self.scheduler.on_prefill_dispatched(rid)
            else:
                self.scheduler.on_decode_dispatched(rid)
        return step if step.extend is not None or step.decode is not None or step.verify is not None else None

    def _dispatch_extend(
        self,
        prefill: list[PrefillItem],
        loads: list[TransferHandle],
        step: InflightStep,
        decode: list[TrackedRequest] | None = None,
    ) -> None:
        """The plan's prompt chunks as one extend; with ``decode`` (a mixed step), those rows'
        next tokens in the same program, after the chunks (one token each, read on the device)."""
        if not prefill:
            return
        with self.executor.span("extend"):
            work: list[ExtendChunk[SeqRow]] = []
            for item in prefill:
                t = self._tracked[item.request_id]
                if item.is_first_chunk:  # (also the first after a retraction)
                    self.executor.open_sequence(t.request_id)
                tokens = item.request.prefill_tokens[t.computed : item.end]
                targets = t.prompt_logprob_targets(t.computed, item.end)
                work.append(ExtendChunk(t, tokens, t.computed, item.is_last_chunk, targets))
                step.extend_items.append((item, t))
            if decode:
                step.decode_lengths = [t.computed for t in decode]
                work.extend(ExtendChunk(t, (0,), n, device_token=True) for t, n in zip(decode, step.decode_lengths))
            step.extend_landed = all(self.ctl.is_ready(h) for h in loads)  # else its time includes the link's
            step.extend = self.executor.dispatch_extend(work, loads)
            for item, t in step.extend_items:
                status = self.scheduler.on_prefill_dispatched(item.request_id)
                if status is not RequestStatus.DECODING:
                    if self.publish_chunks and status is RequestStatus.PREFILLING:  # not the last chunk: pages now
                        with self.executor.span("backup"):
                            replaced = self.pages.publish_prefix(t, item.request.prefill_tokens, last=False)
                        if replaced is not None:
                            self.executor.page_table_changed(t.request_id, replaced)
                    continue  # nothing sampled
                with self.executor.span("backup"):
                    replaced = self.pages.publish_prefix(
                        t, item.request.prefill_tokens, self._view.hint(item.request_id)
                    )
                if replaced is not None:
                    self.executor.page_table_changed(t.request_id, replaced)
                self._admit_followers(t)
                if self._needs_token_on_host(t):  # its next mask / proposal needs this token
                    self.scheduler.hold(t.request_id, True)
                    step.holds_rows = True
                if t.params.max_tokens == 0 or self.rules.by_length(t.params, len(t.prompt_ids), t.generated):
                    self._last_token_dispatched(t)
            if decode:
                step.decode_in_extend = True
                self._decode_dispatched(decode, step)
                self.counters["mixed_steps"] += 1
        self.counters["prefill_steps"] += 1

    def _dispatch_decode(self, rows: list[TrackedRequest], step: InflightStep) -> None:
        if not rows:
            return
        with self.executor.span("decode"):
            step.decode = self.executor.dispatch_decode(rows)
            self._decode_dispatched(rows, step)
        self.counters["decode_steps"] += 1

    def _decode_dispatched(self, rows: list[TrackedRequest], step: InflightStep) -> None:
        """The scheduler's and the stop rules' side of dispatching a token for each row."""
        step.decode_rows = rows
        by_length = self.rules.by_length
        on_done = self.scheduler.on_decode_dispatched
        context = 0
        for t in rows:
            on_done(t.request_id)
            req = t.req  # read directly: this loop runs once per row per step
            assert req is not None  # (admitted)
            context += req.computed
            if self._needs_token_on_host(t):
                self.scheduler.hold(t.request_id, True)
                step.holds_rows = True
            if by_length(t.params, len(t.prompt_ids), req.generated):
                self._last_token_dispatched(t)
        step.decode_context = context

    # ------------------------------------------------------------------ speculation
    def _needs_token_on_host(self, t: TrackedRequest) -> bool:
        """Its next step needs its last token read first (a grammar's mask, a proposal): held
        from each dispatch until that token is read."""
        return t.grammar is not None or (self.speculator is not None and self.speculator.wants_token(t))

    def _split_speculating(
        self, rows: list[TrackedRequest]
    ) -> tuple[list[TrackedRequest], list[tuple[TrackedRequest, list[int]]]]:
        """The rows that decode as usual, and those that verify a proposal (with it).

        Only a row whose tokens are all read proposes (a speculating row is held after
        each step; one coming back from resting may still have a token in flight).  Its
        proposal is capped so that every token the step may emit is within ``max_tokens``
        and the context; a row with no room or no proposal decodes as usual, and of those
        with one, ``Speculator.choose`` picks which verify (the rest step aside)."""
        spec = self.speculator
        if spec is None:
            return rows, []
        plain: list[TrackedRequest] = []
        candidates: list[tuple[TrackedRequest, list[int]]] = []
        for t in rows:
            proposal: list[int] = []
            if spec.wants_token(t) and len(t.output_ids) == t.generated:
                # the step emits up to len(proposal) + 1 tokens: the last one may be the request's last
                room = self.rules.most_tokens(t.params, len(t.prompt_ids)) - t.generated - 1
                with self.executor.span("propose"):
                    proposal = spec.propose(t.prompt_ids, t.output_ids, room, t.request_id)
            if proposal:
                candidates.append((t, proposal))
            else:
                plain.append(t)
        if not candidates:
            return plain, []
        chosen = spec.choose(len(plain), [(t.request_id, len(p)) for t, p in candidates])
        verify: list[tuple[TrackedRequest, list[int]]] = []
        for (t, proposal), yes in zip(candidates, chosen):
            if yes:
                verify.append((t, proposal))
            else:
                spec.step_aside(t.request_id, proposal)
                plain.append(t)
        return plain, verify

    def _dispatch_verify(self, rows: list[tuple[TrackedRequest, list[int]]], step: InflightStep) -> None:
        """Each row's last token and proposal as one extend chunk at its length.

        The plan gave each row a slot for one token; the proposal's positions get pages
        only from free ones (speculation never evicts cached prefixes nor takes what the
        plan budgeted for others): a proposal that does not fit is cut to what does."""
        if not rows:
            return
        ps = self.page_size
        work: list[ExtendChunk[SeqRow]] = []
        with self.executor.span("verify"):
            for i, (t, proposal) in enumerate(rows):
                computed = t.computed
                room = len(t.page_table) * ps - computed - 1
                short = len(proposal) - room
                if short > 0:
                    extra = -(-short // ps) * ps
                    if self.ctl.free_device_tokens() >= extra:
                        try:
                            self.pages.ensure_pages(t, computed + len(proposal) + 1, computed)
                        except CacheFullError:
                            pass
                    room = len(t.page_table) * ps - computed - 1
                    proposal = proposal[: max(0, room)]
                    rows[i] = (t, proposal)
                work.append(ExtendChunk(t, [t.output_ids[-1], *proposal], computed, False, None, verify=True))
            step.verify = self.executor.dispatch_extend(work, ())
            step.verify_rows = rows
            step.holds_rows = True
            for t, _ in rows:
                self.scheduler.on_decode_dispatched(t.request_id)  # (the first token; the rest when read)
                self.scheduler.hold(t.request_id, True)
        self.counters["decode_steps"] += 1

    def _accept_verified(
        self,
        t: TrackedRequest,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        now: float,
        events: list[Event],
    ) -> None:
        """Emit a verification's tokens in order, each through the stop rules (with its
        logprob when the row asked); the first was counted at dispatch, each further one is
        counted as it is accepted."""
        rid = t.request_id
        req = t.req
        assert req is not None  # (admitted)
        for j, token in enumerate(tokens):
            if j:
                self.scheduler.on_draft_accepted(rid)
            if self.rules.by_length(t.params, len(t.prompt_ids), req.generated):
                self._last_token_dispatched(t)  # (so _accept ends it by length)
            self._accept(t, token, logprobs[j] if logprobs is not None else None, now, events)
            if self._tracked.get(rid) is not t:
                return  # ended (a stop id, EOS, the length): the rest is never shown nor counted
        self.executor.rewind_row(rid, tokens[-1])  # its length and input token on the device (_accept unheld it)

    def _last_token_dispatched(self, t: TrackedRequest) -> None:
        """The token being computed is the request's last (length): the scheduler is done with it."""
        t.finishing = True
        self.scheduler.finish(t.request_id)
        self._close_sequence(t)  # its row is read by the step in flight; a new owner's writes queue behind it

    # ------------------------------------------------------------------ postprocess
    def _send(self) -> None:
        """Hand the buffered token events to the output side (one message)."""
        if self._unsent:
            events, self._unsent = self._unsent, []
            self.outputs.emit(events)

    def _fail(self, events: list[Event]) -> None:
        """Failures go out at once, behind the tokens of the same requests already read."""
        self._unsent.extend(events)
        self._send()

    def _complete(self, step: InflightStep) -> None:
        """Read a dispatched step's tokens and apply the stop rules.

        Its events go to the output side when the loop next waits for the device (the
        start of the next ``_complete``), so the output thread works while this thread
        sleeps instead of beside it; at once when no step is in flight.
        """
        self._send()
        events: list[Event] = []  # its own list: a failure sent meanwhile must not take these along half-built
        if step.extend is not None:
            out = self.executor.collect(step.extend)
            if step.extend_landed and out.seconds is not None:
                # A step that waited for its loads timed the link as much as the compute: fitting
                # it would teach the extend model that compute is dear and tokens are cheap.
                # (A mixed step's decode rows are what they cost there: a token on their context.)
                self.scheduler.cost.observe_extend(
                    [(it.new_tokens, it.start) for it, _ in step.extend_items] + [(1, n) for n in step.decode_lengths],
                    out.seconds,
                )
            now = self.executor.now()
            for i, (item, t) in enumerate(step.extend_items):
                if self._tracked.get(t.request_id) is not t:
                    continue  # aborted or stopped since
                lps = out.prompt_logprobs.get(i)
                if lps is not None:
                    t.prompt_logprobs = (t.prompt_logprobs or []) + lps
                if item.is_last_chunk:
                    self._accept(t, out.tokens[i], out.logprobs.get(i), now, events)
            if step.decode_in_extend:  # the decode rows' tokens follow the chunks'
                first = len(step.extend_items)
                for i, t in enumerate(step.decode_rows, first):
                    if self._tracked.get(t.request_id) is t:
                        self._accept(t, out.tokens[i], out.logprobs.get(i), now, events)
        if step.decode is not None:
            out = self.executor.collect(step.decode)
            if out.seconds is not None:
                self.scheduler.cost.observe_decode(len(step.decode_rows), step.decode_context, out.seconds)
                if self.speculator is not None:
                    self.speculator.observe_decode(len(step.decode_rows), out.seconds)
            now = self.executor.now()
            tracked = self._tracked
            logprobs = out.logprobs
            for i, (t, token) in enumerate(zip(step.decode_rows, out.tokens)):
                if tracked.get(t.request_id) is t:
                    self._accept(t, token, logprobs.get(i) if logprobs else None, now, events)
        if step.verify is not None:
            assert self.speculator is not None  # (only it dispatches verifications)
            out = self.executor.collect(step.verify)
            if out.seconds is not None:
                self.speculator.observe_verify(len(step.verify_rows), out.seconds)
            now = self.executor.now()
            for i, (t, proposal) in enumerate(step.verify_rows):
                if self._tracked.get(t.request_id) is not t:
                    continue  # aborted or stopped since
                picks = out.picks[i]
                kept = self.speculator.accepted(proposal, picks, t.request_id)
                self._accept_verified(t, picks[: kept + 1], out.pick_logprobs.get(i), now, events)
        self._unsent.extend(events)
        if self._inflight is None:
            self._send()

    def _accept(
        self, t: TrackedRequest, token: int, logprob: TokenLogprob | None, now: float, events: list[Event]
    ) -> None:
        p = t.params
        req = t.req  # read directly: this runs once per row per step
        assert req is not None  # (admitted)
        outputs = req.output_token_ids
        if not outputs:
            t.stream.cached = dict(t.cached)
            t.stream.prompt_logprobs, t.prompt_logprobs = t.prompt_logprobs, None
            if p.max_tokens == 0:  # scoring only: the prefill ran, nothing is generated
                events.append(TokenEvent(t.stream, None, None, "length", now))
                self._finish(t)
                return
        outputs.append(token)  # the scheduler's record holds the values (ScheduledRequest.add_output)
        n = len(outputs)
        if self.rules.by_token(p, token, n):
            finish = "stop"
        elif t.grammar is not None and t.grammar.advance(token):
            finish = "stop"  # the grammar is complete: nothing else may follow
        elif t.finishing and n == req.generated:
            finish = "length"
        else:
            finish = None
            spec = self.speculator
            if spec is not None and spec.may_speculate(t):  # (only rows that may speculate are scored)
                spec.observe_token(t.request_id, token, t.prompt_ids, outputs)
            if req.held:  # (whatever decides holding now: a speculator's choice may have changed since)
                self.scheduler.hold(t.request_id, False)  # its mask / proposal for the next step can be made
        events.append(TokenEvent(t.stream, token, logprob, finish, now))
        if finish is not None:
            self._finish(t)

    def _finish(self, t: TrackedRequest) -> None:
        """A stop rule ended the request: its KV goes to the tree, its resources back."""
        if not t.finishing:
            self.scheduler.finish(t.request_id)
        del self._tracked[t.request_id]
        self.pages.release(t, keep=True)
        self._leave(t)
        self._view.forget(t.request_id)
        self._admit_followers(t)
        self.counters["finished"] += 1

    # ------------------------------------------------------------------ request life cycle
    def _admit_followers(self, t: TrackedRequest) -> None:
        """The leader's prompt is in the tree (or the leader is gone): admit its followers."""
        t.prefix_published = True
        followers, t.followers = t.followers, []
        for f in followers:
            self.admit(f)

    def _leave(self, t: TrackedRequest) -> None:
        """Give back the request's device state (row, sampling slot)."""
        if self.speculator is not None:
            self.speculator.forget(t.request_id)
        self._close_sequence(t)
        self._close_state(t)

    def _close_sequence(self, t: TrackedRequest) -> None:
        self.executor.close_sequence(t.request_id)

    def _close_state(self, t: TrackedRequest) -> None:
        """Give back a request's sampling-state slot and admit parked requests it makes room for."""
        if not t.params.needs_sampling_state:
            return  # it holds none
        self.executor.close_sampling_state(t.request_id)
        while self._parked and not self._stopping:
            head = self._parked[0]
            if not self.executor.open_sampling_state(head.request_id, head.prompt_ids, head.output_ids, head.params):
                return
            self._parked.popleft()
            self._enter(head)

    def abort_all(self, exc: BaseException) -> None:
        for rid in [p.request_id for p in self._parked] + list(self._tracked):
            self.abort(rid, exc)

    def close(self, exc: BaseException) -> None:
        """Shutting down: read the step in flight, admit nothing more, end every live request with ``exc``."""
        self.finish_pending()
        self._stopping = True
        self.abort_all(exc)

    def abandon(self, exc: BaseException) -> None:
        """Stopping for good after an unrecoverable error: drop the step in flight unread,
        admit nothing more, end every live request with ``exc``."""
        self._inflight = None
        self._stopping = True
        for rid in [p.request_id for p in self._parked] + list(self._tracked):
            try:
                self.abort(rid, exc)
            except Exception:  # the state is broken anyway; every request must still hear of it
                log.exception("aborting %s while stopping", rid)
                t = self._tracked.pop(rid, None)
                if t is not None:
                    self._fail([FailEvent(t.stream, exc)])

    def fail_step(self, cause: Exception) -> list[str]:
        """The step under way raised ``cause``: fail the requests it touched; returns their ids.

        Touched: before the plan existed (poll, schedule), every live request (the
        scheduler examines them all); after it, the plan's requests and those of the
        step in flight, whose tokens are no longer read (it is dropped).  The others
        stay queued or decoding and go on.

        Prefixes are published to the tree when their step is dispatched, so the tree may
        point at KV the failed step never wrote: the unlocked device and host tiers are
        emptied too (L3 holds only copies of host pages that landed from completed gathers).
        The caller then checks the engine's state (``stats.accounting``).
        """
        touched = self._touched if self._touched is not None else self._live_ids()
        touched |= _step_requests(self._inflight)
        self._inflight = None
        error = StepFailedError(cause)
        failed = []
        for rid in sorted(touched):
            if self.abort(rid, error):
                self.scheduler.forget_in_flight(rid)  # its dropped step will never report it done
                failed.append(rid)
                self.counters["failed"] += 1
        self._touched = set()
        try:
            self.ctl.flush()  # dropped, not written back: a page the step never computed must not reach L2/L3
        except Exception:  # transfers of the failed step may fail too; the tiers are dropped regardless
            log.exception("dropping the device and host tiers after a failed step")
        if self.kv_event_recorder is not None:
            self.kv_event_recorder.end_step()  # the removals are published like any flush's
        return failed

    # ------------------------------------------------------------------ maintenance
    def flush(self, tier: str, scope: Callable[[str], bool] | None = None) -> None:
        """Drop cached KV of ``tier``; ``scope`` (tier "all" only): just the L1 and L2 pages of
        the namespaces it accepts (one LoRA adapter's), L3 left alone."""
        events = self.kv_event_recorder
        mark = events.mark() if events is not None else 0
        self.ctl.drain()
        if scope is not None:
            self.ctl.flush(scope)
            if events is not None:
                events.end_step()
            return
        if tier == "all":
            self.ctl.flush()  # L1 and L2 dropped together: no write-back from one into the other
        if tier == "device":
            self.ctl.evict_device(1 << 40)
        if tier == "host":
            self.ctl.evict_host(1 << 40)
            self.ctl.drain()  # the L3 write-backs it issued land before the next request probes L3
        if tier in ("storage", "all"):
            self.ctl.clear_storage()
        if events is not None:
            tree = self.ctl.tree
            if (
                tier == "all"
                and tree.device_pages == 0
                and tree.host_pages == 0
                and not any(n.storage_backed for n in tree.iter_nodes())
            ):
                events.cleared_since(mark)
            events.end_step()

    def locked_nodes(self) -> int:
        return sum(1 for n in self.ctl.tree.iter_nodes() if n.lock_ref > 0)


def _plan_requests(plan: StepPlan) -> set[str]:
    """Every request a plan computes, decodes or retracts."""
    return (
        {it.request_id for it in plan.prefill}
        | {r.request_id for r in plan.decode}
        | {r.request_id for r in plan.retract}
    )


def _step_requests(step: InflightStep | None) -> set[str]:
    if step is None:
        return set()
    return (
        {it.request_id for it, _ in step.extend_items}
        | {t.request_id for t in step.decode_rows}
        | {t.request_id for t, _ in step.verify_rows}
    )


def _record(plan: StepPlan, prefill: list[PrefillItem], decode: list[str], mixed: bool) -> PlanRecord:
    return PlanRecord(
        round=plan.round,
        prefill=tuple((it.request_id, it.start, it.end) for it in prefill),
        decode=tuple(decode),
        deferred=tuple(plan.deferred),
        set_aside=tuple(plan.set_aside),
        decode_first=plan.decode_first,
        mixed=mixed,
    )
