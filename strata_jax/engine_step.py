"""``EngineCore``: the engine step and the request life cycle, on any ``Executor``.

One step is five calls (DESIGN §2)::

    poll -> schedule -> issue loads -> run (extend / decode) -> postprocess

This module is pure Python (no jax): the real engine (``strata_jax.engine.Engine``,
a ``JaxExecutor``) and the simulator (``strata_jax.sim``, a ``SimExecutor``) run
exactly this code with the same ``Scheduler`` and ``CacheController``; only the
executor (step execution, time) differs.  Called from one thread only (the
engine's loop, or the simulator's driver).

What it owns: the live requests (``TrackedRequest`` by id), their page tables
(through ``RequestPages``), step counters.  The scheduler decides, the executor
computes, the controller owns pages and transfers.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from strata_jax.api import EngineUnavailableError, InvalidRequestError, OverloadedError, TokenLogprob
from strata_jax.cache.controller import CacheController
from strata_jax.cache.handles import CacheFullError, TransferHandle
from strata_jax.engine_output import append_token, finish_without_token
from strata_jax.engine_requests import RequestPages, TrackedRequest, without_cache
from strata_jax.executor import Executor, SeqWork
from strata_jax.scheduler.plan import PrefillItem, StepPlan
from strata_jax.scheduler.request import RequestStatus, ScheduledRequest
from strata_jax.scheduler.scheduler import Scheduler

log = logging.getLogger("strata_jax.engine")


class _CacheView:
    """The scheduler's read-only window on the cache (``strata_jax.scheduler.cache_view.CacheView``).

    Matches are memoized per request until the tree changes (``HiRadixTree.version``):
    the scheduler re-matches every waiting request every round, and a long prompt's
    match costs a walk over all its tokens.  Not with L3, whose hits the tree does
    not know.  After a change each request's latest match is its re-match's hint
    (``HiRadixTree.match_prefix(hint=)``: the path is re-checked node by node, not
    token by token); the engine calls ``forget`` when a request leaves.
    """

    def __init__(self, ctl: CacheController, bypasses_cache: Callable[[str], bool]):
        self.ctl = ctl
        self.page_size = ctl.page_size
        self._memo: dict[str, tuple[int, tuple[int, ...], Any]] = {}
        self._hints: dict[str, Any] = {}  # latest match per live request, whatever the version
        self._memo_version = -1
        self.bypasses_cache = bypasses_cache

    def match(self, request: ScheduledRequest):
        m = self._match(request)
        if self.bypasses_cache(request.request_id):  # prompt logprobs: nothing may come from the cache
            return without_cache(m, self.ctl.tree.root(request.namespace))
        return m

    def _match(self, request: ScheduledRequest):
        tree = self.ctl.tree
        if self.ctl.storage is not None:
            return self.ctl.match_prefix(request.prefill_tokens, request.namespace, requester=request.request_id, touch=False)
        if tree.version != self._memo_version:
            self._memo.clear()
            self._memo_version = tree.version
        seen = self._memo.get(request.request_id)
        if seen is not None and seen[1] is request.prefill_tokens:
            return seen[2]
        m = self.ctl.match_prefix(
            request.prefill_tokens, request.namespace, requester=request.request_id, touch=False,
            hint=self._hints.get(request.request_id),  # ignored by the tree unless it matched these tokens
        )  # fmt: skip
        self._hints[request.request_id] = m
        self._memo[request.request_id] = (tree.version, request.prefill_tokens, m)
        return m

    def hint(self, request_id: str) -> Any:
        """The request's latest match (a hint for the tree; None if there is none)."""
        return self._hints.get(request_id)

    def remember(self, request_id: str, match: Any) -> None:
        """A match of the request's ``prefill_tokens`` made elsewhere (admission): its next hint."""
        self._hints[request_id] = match

    def forget(self, request_id: str) -> None:
        """``request_id`` left the engine: drop its memoized match and hint."""
        self._memo.pop(request_id, None)
        self._hints.pop(request_id, None)

    def load_pending(self, request_id: str) -> bool:
        return self.ctl.load_pending(request_id)

    def free_device_tokens(self) -> int:
        return self.ctl.free_device_tokens()

    def evictable_device_tokens(self) -> int:
        return self.ctl.evictable_device_tokens()


@dataclass(frozen=True)
class PlanRecord:
    """What one step decided, as the engine executed it (for tests comparing executors)."""

    round: int
    prefill: tuple[tuple[str, int, int], ...]  # (request id, start, end)
    decode: tuple[str, ...]
    deferred: tuple[str, ...]
    set_aside: tuple[str, ...]
    decode_first: bool


class EngineCore:
    """The step loop over a scheduler, a cache controller and an executor."""

    def __init__(
        self,
        scheduler: Scheduler,
        ctl: CacheController,
        executor: Executor,
        *,
        eos_token_ids: Collection[int],
        max_context_tokens: int,
    ) -> None:
        self.scheduler = scheduler
        self.ctl = ctl
        self.executor = executor
        self.page_size = ctl.page_size
        self.eos_token_ids = eos_token_ids
        self.max_context_tokens = max_context_tokens
        self.pages = RequestPages(ctl)
        self._view = _CacheView(ctl, lambda rid: rid in self._tracked and self._tracked[rid].bypasses_cache)
        self._tracked: dict[str, TrackedRequest] = {}
        self._parked: deque[TrackedRequest] = deque()  # waiting for a sampling-state slot
        self._logprobs: dict[str, TokenLogprob] = {}  # this step's sampled-token logprobs, by request
        self._stopping = False
        self.counters = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "finished": 0, "aborted": 0, "failed": 0}
        self.plan_log: list[PlanRecord] | None = None  # set to [] to record every step's decisions

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        span = self.executor.span
        with span("poll"):
            self._poll()
        with span("schedule"):
            plan = self.scheduler.schedule(self._view)
        with span("load_kv"):
            dropped = self._pin_and_make_room(plan)
        prefill = [item for item in plan.prefill if item.request_id not in dropped]
        decode = [req for req in plan.decode if req.request_id not in dropped]
        produced: dict[str, int] = {}
        loads: list[TransferHandle] = []
        if plan.decode_first:
            # Bubble filling: the decode is dispatched before the loads, so the link
            # transfers run while the device decodes; the loads' scatters queue behind it.
            pending = self._dispatch_decode(decode)
            with span("load_kv"):
                dropped |= self._load_prefixes(prefill, loads)
            produced.update(self._finish_decode(decode, pending))
            prefill = [item for item in prefill if item.request_id not in dropped]
            produced.update(self._run_extend(prefill, loads))
        else:
            with span("load_kv"):
                dropped |= self._load_prefixes(prefill, loads)
            prefill = [item for item in prefill if item.request_id not in dropped]
            produced.update(self._run_extend(prefill, loads))
            produced.update(self._finish_decode(decode, self._dispatch_decode(decode)))
        if self.plan_log is not None:
            self.plan_log.append(_record(plan, prefill, decode))
        with span("postprocess"):
            self._postprocess(prefill, decode, produced)
            for rid in dropped:  # their results never came: clear the scheduler's in-flight mark
                if any(item.request_id == rid for item in plan.prefill):
                    self.scheduler.on_prefill_done(rid)
                else:
                    self.scheduler.on_decode_done(rid, -1)
        self.counters["steps"] += 1
        if plan.is_empty:
            self.executor.idle()

    def _poll(self) -> None:
        for handle in self.ctl.poll():
            if handle.kind == "load" and handle.service_seconds is not None:
                self.scheduler.cost.observe_load(handle.num_pages * self.page_size, handle.service_seconds, tier="host")

    def _pin_and_make_room(self, plan: StepPlan) -> set[str]:
        """Retractions; pin each first chunk's cached prefix; evict; pages for the decodes.

        Returns the requests that could not get device pages (aborted with an error;
        the scheduler's plan should never come to this, but the engine must not die).
        """
        for req in plan.retract:
            self.pages.retract(self._tracked[req.request_id])
        for item in plan.prefill:
            if item.is_first_chunk:
                self.pages.pin_prefix(self._tracked[item.request_id], item)
        if plan.evict_device_tokens:
            self.ctl.evict_device(-(-plan.evict_device_tokens // self.page_size))
        return self._allocate([(req.request_id, self._tracked[req.request_id].computed + 1) for req in plan.decode])

    def _allocate(self, work: list[tuple[str, int]]) -> set[str]:
        dropped: set[str] = set()
        for rid, tokens in work:
            try:
                self.pages.ensure_pages(self._tracked[rid], tokens)
            except CacheFullError as exc:
                log.error("request %s: %s", rid, exc)
                self._abort(rid, OverloadedError(f"out of device KV memory: {exc}"))
                dropped.add(rid)
        return dropped

    def _load_prefixes(self, prefill: list[PrefillItem], loads: list[TransferHandle]) -> set[str]:
        """Load pinned host-only prefixes L2->L1 (one coalesced transfer each), then pages for the chunks."""
        for item in prefill:
            if item.is_first_chunk:
                handle = self.pages.take_prefix(self._tracked[item.request_id], item)
                if handle is not None:
                    loads.append(handle)
        return self._allocate([(item.request_id, item.end) for item in prefill])

    def _work(self, t: TrackedRequest, tokens: list[int], start: int, *, keep_sample: bool = True) -> SeqWork:
        targets = t.prompt_logprob_targets(start, start + len(tokens))
        return SeqWork(t.request_id, tokens, start, t.page_table, t.params, len(t.output_ids), keep_sample, targets)

    def _run_extend(self, prefill: list[PrefillItem], loads: list[TransferHandle]) -> dict[str, int]:
        if not prefill:
            return {}
        with self.executor.span("extend"):
            work = []
            for item in prefill:
                t = self._tracked[item.request_id]
                tokens = list(item.request.prefill_tokens[t.computed : item.end])
                work.append(self._work(t, tokens, t.computed, keep_sample=item.is_last_chunk))
            landed = all(self.ctl.is_ready(h) for h in loads)  # nothing to wait for: a clean compute timing
            out = self.executor.extend(work, loads)
            for item in prefill:
                t = self._tracked[item.request_id]
                t.computed = item.end
                if item.request_id in out.prompt_logprobs:
                    t.prompt_logprobs = (t.prompt_logprobs or []) + out.prompt_logprobs[item.request_id]
        self.counters["prefill_steps"] += 1
        if landed:
            # A step that waited for its loads timed the link as much as the compute: fitting
            # it would teach the extend model that compute is dear and tokens are cheap.
            self.scheduler.cost.observe_extend([(it.new_tokens, it.start) for it in prefill], out.seconds)
        self._logprobs.update(out.logprobs)
        return {it.request_id: out.tokens[it.request_id] for it in prefill if it.is_last_chunk}

    def _dispatch_decode(self, decode: list[ScheduledRequest]) -> Any:
        if not decode:
            return None
        with self.executor.span("decode"):
            seqs = []
            for req in decode:
                t = self._tracked[req.request_id]
                seqs.append(self._work(t, [t.output_ids[-1]], t.computed))
            return self.executor.dispatch_decode(seqs)

    def _finish_decode(self, decode: list[ScheduledRequest], pending: Any) -> dict[str, int]:
        if pending is None:
            return {}
        with self.executor.span("decode"):
            out = self.executor.finish_decode(pending)
            for req in decode:
                self._tracked[req.request_id].computed += 1
        self.counters["decode_steps"] += 1
        self.scheduler.cost.observe_decode(len(decode), sum(r.seq_len for r in decode), out.seconds)
        self._logprobs.update(out.logprobs)
        return {req.request_id: out.tokens[req.request_id] for req in decode}

    def _postprocess(self, prefill: list[PrefillItem], decode: list[ScheduledRequest], produced: dict[str, int]) -> None:
        try:
            self._postprocess_tokens(prefill, decode, produced)
        finally:
            self._logprobs.clear()

    def _postprocess_tokens(self, prefill: list[PrefillItem], decode: list[ScheduledRequest], produced: dict[str, int]) -> None:
        for item in prefill:
            t = self._tracked[item.request_id]
            token = produced.get(item.request_id)
            status = self.scheduler.on_prefill_done(item.request_id, token)
            if status is RequestStatus.DECODING:
                with self.executor.span("backup"):
                    self.pages.publish_prefix(t, item.request.prefill_tokens, self._view.hint(item.request_id))
                self._admit_followers(t)
                self._accept_token(t, token)
        for req in decode:
            t = self._tracked[req.request_id]
            token = produced[req.request_id]
            self.scheduler.on_decode_done(req.request_id, token)
            self._accept_token(t, token)

    # ------------------------------------------------------------------ tokens out
    def _accept_token(self, t: TrackedRequest, token: int) -> None:
        now = self.executor.now()
        prompt_lps = t.prompt_logprobs
        if prompt_lps is not None and not t.output_ids:
            t.prompt_logprobs = None  # delivered once, with the first chunk
        if t.params.max_tokens == 0:  # scoring only: the prefill ran, nothing is generated
            chunk = finish_without_token(t, now=now)
        else:
            chunk = append_token(t, token, eos_token_ids=self.eos_token_ids, max_context_tokens=self.max_context_tokens, now=now)
            if t.params.logprobs is not None and t.request_id in self._logprobs:
                chunk.logprobs = [self._logprobs[t.request_id]]
        if prompt_lps is not None:
            chunk.prompt_logprobs = [None, *prompt_lps]
        if chunk.finished:
            self.scheduler.finish(t.request_id)
            self.pages.release(t, keep=True)
            self._close_state(t)
            del self._tracked[t.request_id]
            self._view.forget(t.request_id)
            self._admit_followers(t)
            self.counters["finished"] += 1
            chunk.ttft_s = t.first_token_at - t.submitted_at  # type: ignore[attr-defined,operator]
            chunk.latency_s = now - t.submitted_at  # type: ignore[attr-defined]
        t.sink.push(chunk)

    # ------------------------------------------------------------------ request life cycle
    def _admit(self, t: TrackedRequest) -> None:
        if self._stopping:
            t.sink.fail(EngineUnavailableError("the engine is shutting down"))
            return
        if t.follows is not None:
            leader = self._tracked.get(t.follows)
            if leader is not None and not leader.prefix_published:
                leader.followers.append(t)  # admitted when the leader's prompt pages are in the tree
                return
        if t.params.needs_sampling_state and not t.has_sampling_state:
            if self._parked or not self.executor.open_sampling_state(t.request_id, t.prompt_ids, t.output_ids, t.params):
                self._parked.append(t)  # admitted when a slot frees (FIFO)
                return
            t.has_sampling_state = True
        try:
            req = self.scheduler.submit(t.request_id, t.prompt_ids, namespace=t.namespace)
        except (OverloadedError, InvalidRequestError) as exc:
            self._close_state(t)
            t.sink.fail(exc)
            return
        self._tracked[t.request_id] = t
        match = self.pages.admit(t, req.prefill_tokens)
        if match is not None:
            self._view.remember(t.request_id, match)  # the scheduler's first match walks from it

    def _admit_followers(self, t: TrackedRequest) -> None:
        """The leader's prompt is in the tree (or the leader is gone): admit its followers."""
        t.prefix_published = True
        followers, t.followers = t.followers, []
        for f in followers:
            self._admit(f)

    def _close_state(self, t: TrackedRequest) -> None:
        """Give back a request's sampling-state slot and admit parked requests it makes room for."""
        if not t.has_sampling_state:
            return
        self.executor.close_sampling_state(t.request_id)
        t.has_sampling_state = False
        while self._parked and not self._stopping:
            head = self._parked[0]
            if not self.executor.open_sampling_state(head.request_id, head.prompt_ids, head.output_ids, head.params):
                return
            self._parked.popleft()
            head.has_sampling_state = True
            self._admit(head)

    def _abort(self, request_id: str, exc: BaseException) -> bool:
        t = self._tracked.pop(request_id, None)
        if t is None:
            parked = next((p for p in self._parked if p.request_id == request_id), None)
            if parked is None:
                return False
            self._parked.remove(parked)
            self.counters["aborted"] += 1
            parked.sink.fail(exc)
            return True
        self.scheduler.abort(request_id)
        self._view.forget(request_id)
        self.pages.release(t, keep=False)
        self._close_state(t)
        if not self._stopping:
            self._admit_followers(t)  # they compute the prompt themselves
        else:
            for f in t.followers:
                f.sink.fail(exc)
        self.counters["aborted"] += 1
        t.sink.fail(exc)
        return True

    def _abort_all(self) -> None:
        for rid in [p.request_id for p in self._parked] + list(self._tracked):
            self._abort(rid, EngineUnavailableError("the engine shut down before the request finished"))

    def _fail_all(self, exc: Exception) -> None:
        for rid in [p.request_id for p in self._parked] + list(self._tracked):
            self._abort(rid, exc)
            self.counters["failed"] += 1

    # ------------------------------------------------------------------ maintenance
    def _flush(self, tier: str) -> None:
        self.ctl.drain()
        if tier in ("device", "all"):
            self.ctl.evict_device(1 << 40)
        if tier in ("host", "all"):
            self.ctl.evict_host(1 << 40)
        if tier in ("storage", "all"):
            self.ctl.clear_storage()

    def _locked_nodes(self) -> int:
        return sum(1 for n in self.ctl.tree.iter_nodes() if n.lock_ref > 0)


def _record(plan: StepPlan, prefill: list[PrefillItem], decode: list[ScheduledRequest]) -> PlanRecord:
    return PlanRecord(
        round=plan.round,
        prefill=tuple((it.request_id, it.start, it.end) for it in prefill),
        decode=tuple(r.request_id for r in decode),
        deferred=tuple(plan.deferred),
        set_aside=tuple(plan.set_aside),
        decode_first=plan.decode_first,
    )
