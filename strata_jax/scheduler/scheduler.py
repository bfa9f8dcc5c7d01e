"""``Scheduler``: request life cycle and one plan per engine step.

The engine calls, per step (docs/design.md §4):

    plan = scheduler.schedule(cache_view)          # pure decision, no side effects on the cache
    ... engine executes the plan (see ``strata_jax.scheduler.plan``) ...
    scheduler.on_prefill_dispatched(rid[, token])  # per prefill item, once it is dispatched
    scheduler.on_decode_dispatched(rid[, token])   # per decode request, once it is dispatched
    scheduler.finish(rid)                          # when the engine's stop rules say so

The engine reports a step when it is dispatched (the pipelined loop plans step N+1
before step N's tokens reach the host): the scheduler counts tokens, it does not
need their values, except to retract a decode (its prompt + outputs are prefilled
again), which the engine therefore does only with no step in flight.

A round: (1) pick the decode batch (rotating when there are more decodes than
``max_decode_batch_size``) and retract the newest decodes if even eviction
cannot make room for their next token; (2) continue chunked prefills, leaving
room in the budget for short prefills that load nothing (strata policy,
``short_prefill_tokens``), then admit those; (3) walk the queue with the delay-hit rule and form the prefill
batch with the policy's procedure; (4) order decode before prefill when bubble
filling says so.

Starvation freedom: the queue head is always tried first and nothing overtakes
a head that does not fit; a request is deferred only behind a live request that
arrived earlier (so deferral chains end), and set-aside or non-fitting requests
keep their queue position.  Short prefills overtake the queue, but together take at
most half the token budget, and the continuing chunks keep a batch slot each and the
first claim on device pages, so they always advance.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

from strata_jax.api import InvalidRequestError, OverloadedError
from strata_jax.scheduler.batch import BatchBuilder, Candidate
from strata_jax.scheduler.cache_view import CacheView, PrefixMatchLike
from strata_jax.scheduler.config import SchedulerConfig
from strata_jax.scheduler.cost_model import CostModel
from strata_jax.scheduler.errors import SchedulerStateError, UnknownRequestError
from strata_jax.scheduler.plan import PrefillItem, SchedulerStats, StepPlan
from strata_jax.scheduler.policy import FORMERS, resolve_stages
from strata_jax.scheduler.queue import RoundQueue
from strata_jax.scheduler.request import RequestStatus, ScheduledRequest

PREFETCH_PACE_SLACK = 4.0  # see Scheduler._wait_for_prefetch
PREFETCH_PACE_MIN_SHARE = 0.25  # a prefetch's own pace is trusted once this share of it landed
_S = RequestStatus


class Scheduler:
    """Continuous-batching control plane with the Strata stages (pure Python).

    Not thread-safe: call it from the engine loop only (an abort arriving from
    another thread is queued by the engine and applied between steps).
    """

    def __init__(self, config: SchedulerConfig | None = None, cost_model: CostModel | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.stages = resolve_stages(self.config)
        self.cost = cost_model or CostModel()
        self._requests: dict[str, ScheduledRequest] = {}  # live requests
        self._queue: list[str] = []  # waiting + deferred, in scheduling order
        self._aborted_in_flight: set[str] = set()
        self._arrivals = 0
        self._round = 0
        self._c = dict(
            finished=0,
            aborted=0,
            deferrals=0,
            deferred_rounds=0,
            set_asides=0,
            bundle_hits=0,
            retractions=0,
            decode_first_rounds=0,
            mixed_rounds=0,
            recomputed_prompt_tokens=0,
            load_or_recompute_recomputed=0,
            load_or_recompute_tokens=0,
            prefetch_waits=0,
            prefetch_wait_rounds=0,
            prefetch_not_waited=0,
        )
        self._prefetch_holds: set[str] = set()  # this round's requests held for their prefetch
        self._hits = {"device": 0, "host": 0, "storage": 0}
        self._decoding = 0  # requests in DECODING (kept as they change)

    # -- intake ------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int] | tuple[int, ...],
        *,
        namespace: str = "",
    ) -> ScheduledRequest:
        """Queue a request. Raises ``OverloadedError`` when ``max_waiting`` requests already wait.

        The returned record is the request's: the caller appends its output token values
        as it reads them (``ScheduledRequest.add_output``), or passes them with the
        results (``on_prefill_dispatched`` / ``on_decode_dispatched``).
        """
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt must contain at least one token")
        if request_id in self._requests or request_id in self._aborted_in_flight:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if len(self._queue) >= self.config.max_waiting:
            raise OverloadedError(
                f"server overloaded: {len(self._queue)} requests already waiting "
                f"(max_waiting={self.config.max_waiting}); retry later"
            )
        req = ScheduledRequest(request_id, tuple(prompt_token_ids), namespace, self._arrivals)
        self._arrivals += 1
        self._requests[request_id] = req
        self._queue.append(request_id)
        return req

    # -- the round ---------------------------------------------------------
    def schedule(self, cache: CacheView) -> StepPlan:
        """Decide this step's decode batch, prefill batch, loads, evictions and order."""
        self._round += 1
        cfg, ps = self.config, cache.page_size
        free = cache.free_device_tokens()
        capacity = free + cache.evictable_device_tokens()

        # 1. decode batch; retract the newest decodes if their next tokens cannot fit.
        ready = [r for r in self._requests.values() if r.status is _S.DECODING and not r.decode_inflight and not r.held]
        if (
            len(ready) > cfg.max_decode_batch_size
        ):  # take turns: the longest-waiting first (else all run, in arrival order)
            ready.sort(key=lambda r: (r.last_decode_round, r.arrival))
        decodes = ready[: cfg.max_decode_batch_size]
        # the rows' KV lengths read once (this runs per decode row per step)
        seq_lens = [r.seq_len for r in decodes]
        decode_context = sum(seq_lens)
        decode_need = sum(_decode_page(n, ps) for n in seq_lens)
        retracted: list[ScheduledRequest] = []
        while decodes and decode_need > capacity:
            victim = max(decodes, key=lambda r: r.arrival)
            decodes.remove(victim)
            decode_need -= _decode_page(victim.seq_len, ps)
            decode_context -= victim.seq_len
            self._retract(victim)
            retracted.append(victim)

        # 2. prefill batch: continuing chunks (leaving room for short prefills), the short ones, then the queue.
        # Mixed steps leave a token per decode row in the budget, so the rows fit the chunk's program.
        mix_room = len(decodes) if self.stages.mixed_steps and 0 < len(decodes) <= cfg.max_batch_tokens // 4 else 0
        batch = BatchBuilder(
            token_budget=cfg.max_batch_tokens - mix_room,
            max_size=cfg.max_prefill_batch_size,
            device_capacity=max(0, capacity - decode_need),
            page_size=ps,
            cost=self.cost,
            loading_bound_ratio=cfg.loading_bound_ratio,
            new_room=self._new_room(cache),
        )
        continuing = [
            r
            for r in self._requests.values()
            if r.status is _S.PREFILLING and r.inflight_end is None and r.remaining_prefill > 0
        ]
        skip = {r.request_id for r in retracted}  # their KV is still on the device this step
        queue = RoundQueue(
            [rid for rid in self._queue if rid not in skip], lambda rid: self._classify(rid, cache), cfg.max_lookahead
        )
        self._prefetch_holds.clear()  # filled again by this round's classifications
        shorts = self._short_candidates(queue, len(continuing), batch) if continuing and self.stages.short_first else []
        reserved = sum(c.remaining for c in shorts)
        for req in sorted(continuing, key=lambda r: r.arrival):  # first claim on slots and device pages
            batch.try_add(Candidate.continuing(req), reserve_tokens=reserved)
        for cand in shorts:
            if batch.try_add(cand) is not None:
                queue.admit(cand)
        formed = FORMERS[self.stages.balanced_batch](queue, batch)
        self._queue = [rid for rid in self._queue if rid in skip] + queue.new_order()

        # 3. bookkeeping for what was decided.
        for rid in queue.deferred:
            req = self._requests[rid]
            if rid in self._prefetch_holds:  # waiting on its own prefetch, not on another request
                self._c["prefetch_wait_rounds"] += 1
                if req.prefetch_choice is None:
                    req.prefetch_choice = "waited"
                    self._c["prefetch_waits"] += 1
                continue
            if req.status is _S.WAITING:
                req.deferrals += 1
                self._c["deferrals"] += 1
            req.status = _S.DEFERRED
            self._c["deferred_rounds"] += 1
        for rid in queue.classified - set(queue.deferred):
            if self._requests[rid].status is _S.DEFERRED:
                self._requests[rid].status = _S.WAITING  # nothing to wait for any more
        for item in batch.items:
            self._dispatch_prefill(item)
        for req in decodes:
            req.decode_inflight = True
            req.last_decode_round = self._round
        self._c["set_asides"] += len(formed.set_aside)
        self._c["bundle_hits"] += formed.bundle_hits

        # 4. bubble filling: decode first while the prefill batch's load is still in the air.
        est_load = self.cost.load_seconds(batch.load_host, batch.load_storage)
        est_prefill = self.cost.batch_extend_seconds(batch.extend_items()) if batch.items else 0.0
        est_decode = self.cost.decode_seconds(len(decodes), decode_context)
        unlanded = batch.load_host + batch.load_storage > 0 or any(
            cache.load_pending(i.request_id) for i in batch.items
        )
        decode_first = bool(
            self.stages.bubble_filling and decodes and batch.items and unlanded and est_load > est_decode
        )
        self._c["decode_first_rounds"] += decode_first
        # 5. mixed step: the decode rows as one-token rows of the extend, when the cost model says
        # one program costs less than the two (on every device so far: a decode program's fixed
        # cost, reading the weights, is saved; the rows add a token each to the chunk's matmuls).
        mixed = False
        if mix_room and batch.items and not decode_first:
            est_mixed = self.cost.batch_extend_seconds(batch.extend_items() + [(1, r.seq_len) for r in decodes])
            mixed = est_mixed <= est_prefill + est_decode
        self._c["mixed_rounds"] += mixed
        return StepPlan(
            round=self._round,
            prefill=tuple(batch.items),
            decode=tuple(decodes),
            decode_first=decode_first,
            mixed=mixed,
            evict_device_tokens=max(0, batch.need_tokens + decode_need - free),
            retract=tuple(retracted),
            deferred=tuple(queue.deferred),
            set_aside=tuple(formed.set_aside),
            est_load_s=est_load,
            est_prefill_s=est_prefill,
            est_decode_s=est_decode,
        )

    def _short_candidates(self, queue: RoundQueue, continuing: int, batch: BatchBuilder) -> list[Candidate]:
        """Queued requests that compute at most ``short_prefill_tokens`` and load nothing (their
        prefix, if any, is on the device), in queue order: the continuing chunks leave their
        tokens in the budget (at most half of it), so their first token is one short step away
        and a long prompt loses a few tokens of one chunk instead of them waiting for all of it.
        The continuing chunks keep a batch slot each and the first claim on device pages."""
        room, slots = batch.token_budget // 2, batch.max_size - len(batch.items) - continuing
        picked: list[Candidate] = []
        # the first max_prefill_batch_size candidates only (deferred requests, a landed
        # document's questions, sit at the queue's front)
        for cand in itertools.islice(queue.rest(), self.config.max_prefill_batch_size):
            if len(picked) >= slots:
                break
            if not cand.loads and cand.remaining <= min(self.config.short_prefill_tokens, room):
                picked.append(cand)
                room -= cand.remaining
        return picked

    def _new_room(self, cache: CacheView) -> int | None:
        """Requests that may start running this round: under ``max_running_requests`` and
        the cache's own limit (``CacheView.new_request_room``)."""
        cfg = self.config
        rooms = [] if cfg.max_running_requests is None else [max(0, cfg.max_running_requests - self.num_running)]
        local = cache.new_request_room(cfg.max_batch_tokens)
        if local is not None:
            rooms.append(local)
        return min(rooms) if rooms else None

    def _classify(self, rid: str, cache: CacheView) -> Candidate | None:
        """This round's candidate for a queued request, or None if the delay-hit rule defers it."""
        req = self._requests[rid]
        match = cache.match(req)
        if self.stages.delay_hit and match.transient_tokens > self.config.delay_hit_threshold:
            if any(self._blocks(owner, req) for owner in match.transient_owners):
                return None
        if self.config.wait_for_prefetch and self._wait_for_prefetch(req, match, cache):
            self._prefetch_holds.add(rid)
            return None
        cand = Candidate.from_match(req, match, cache.page_size)
        if self.stages.load_or_recompute and cand.loads and self._recompute_is_cheaper(cand):
            return cand.recomputing_cached(cache.page_size)
        return cand

    def _wait_for_prefetch(self, req: ScheduledRequest, match: PrefixMatchLike, cache: CacheView) -> bool:
        """Should ``req`` wait for its L3 prefetch in flight?  While the rest is estimated to
        land sooner than recomputing it.  The arrival estimate is the measured storage read
        rate's; once the prefetch has taken ``PREFETCH_PACE_SLACK`` times longer than that
        rate says the whole would, it is this prefetch's own pace so far when at least
        ``PREFETCH_PACE_MIN_SHARE`` of it landed, else the time it took plus the rate's
        estimate (a stalled store is not waited for forever; the slack absorbs thread
        scheduling on small reads)."""
        progress = cache.prefetch_progress(req.request_id)
        if progress is None:
            return False
        landed, total, waited_s = progress
        before = match.device_tokens + match.host_tokens  # cached ahead of what the prefetch brings
        rest = total - landed
        fetch_s = self.cost.storage_seconds(rest)
        if waited_s > PREFETCH_PACE_SLACK * self.cost.storage_seconds(total):
            # its pace so far, once a quarter landed; before, at least what it took plus the
            # estimate (the first objects land after the reads' start-up, in batches: a pace
            # from a few pages says a 2,600-token prefetch that lands in 0.3 s takes 15 s)
            trusted = landed >= PREFETCH_PACE_MIN_SHARE * total
            pace_s = rest * waited_s / landed if trusted else waited_s + fetch_s
            fetch_s = max(fetch_s, pace_s)
        if fetch_s < self.cost.extend_seconds(rest, before + landed):
            return True
        if req.prefetch_choice is None:
            req.prefetch_choice = "not_waited"
            self._c["prefetch_not_waited"] += 1
        return False

    def _recompute_is_cheaper(self, cand: Candidate) -> bool:
        """Load-or-recompute: would recomputing ``cand``'s L2/L3 part beat loading it?

        Load: bytes over the measured link (and storage) bandwidth plus a per-transfer
        overhead.  Recompute: the extend model's extra time for computing those tokens
        too, on top of the device-resident prefix, ahead of the rest of the prompt.
        """
        cost = self.cost
        load = cost.load_seconds(cand.host, cand.storage) + cost.transfer_overhead_s
        new = cand.remaining
        keep = cand.device
        recompute = cost.extend_seconds(new + cand.start - keep, keep) - cost.extend_seconds(new, cand.start)
        return load > recompute

    def _blocks(self, owner_id: Hashable, req: ScheduledRequest) -> bool:
        """Is ``owner_id`` a live, earlier request still computing the prefix ``req`` would reuse?"""
        owner = self._requests.get(owner_id) if isinstance(owner_id, str) else None  # (only request ids are)
        return (
            owner is not None
            and owner is not req
            and owner.arrival < req.arrival
            and owner.status in (_S.WAITING, _S.DEFERRED, _S.PREFILLING)
        )

    def _dispatch_prefill(self, item: PrefillItem) -> None:
        req = item.request
        if item.is_first_chunk:
            req.status = _S.PREFILLING
            req.computed = item.start
            if req.first_scheduled_round is None:
                req.first_scheduled_round = self._round
                hit = {
                    "device": item.device_hit_tokens,
                    "host": item.load_host_tokens,
                    "storage": item.load_storage_tokens,
                }
                req.cached_tokens = hit
                for tier, n in hit.items():
                    self._hits[tier] += n
                if item.recomputed_cached_tokens:
                    self._c["load_or_recompute_recomputed"] += 1
                    self._c["load_or_recompute_tokens"] += item.recomputed_cached_tokens
        req.inflight_end = item.end
        prompt_part = max(0, min(item.end, len(req.prompt_token_ids)) - item.start)
        self._c["recomputed_prompt_tokens"] += prompt_part

    def _retract(self, req: ScheduledRequest) -> None:
        if len(req.output_token_ids) != req.generated:
            raise SchedulerStateError(
                f"cannot retract {req.request_id!r}: {req.generated} tokens generated, "
                f"{len(req.output_token_ids)} known"
            )
        req.status = _S.WAITING
        self._decoding -= 1
        req.prefill_tokens = req.prompt_token_ids + tuple(req.output_token_ids)
        req.retractions += 1
        self._c["retractions"] += 1
        self._queue.insert(0, req.request_id)

    # -- results -----------------------------------------------------------
    def on_prefill_dispatched(self, request_id: str, token_id: int | None = None) -> RequestStatus:
        """The planned chunk of ``request_id`` is dispatched (its KV will be computed).

        On the last chunk a token is sampled (its value, if the caller passes it, is
        recorded) and the request becomes ``decoding``; otherwise it stays
        ``prefilling``.  Returns the new status (``aborted`` if it was aborted while in
        flight: release it now).
        """
        if request_id in self._aborted_in_flight:
            self._aborted_in_flight.discard(request_id)
            return _S.ABORTED
        req = self._live(request_id)
        if req.status is not _S.PREFILLING or req.inflight_end is None:
            raise SchedulerStateError(f"request {request_id!r} has no prefill chunk in flight")
        req.computed, req.inflight_end = req.inflight_end, None
        if req.remaining_prefill > 0:
            return req.status
        if token_id is not None:
            req.output_token_ids.append(token_id)
        req.generated += 1
        req.status = _S.DECODING
        self._decoding += 1
        return req.status

    def on_decode_dispatched(self, request_id: str, token_id: int | None = None) -> RequestStatus:
        """A decode step for ``request_id`` is dispatched (it will sample a token); the token's
        value, if passed, is recorded."""
        if request_id in self._aborted_in_flight:
            self._aborted_in_flight.discard(request_id)
            return _S.ABORTED
        req = self._live(request_id)
        if not req.decode_inflight:
            raise SchedulerStateError(f"request {request_id!r} has no decode in flight")
        req.decode_inflight = False
        req.computed += 1  # the KV of the token it decoded from
        req.generated += 1
        if token_id is not None:
            req.output_token_ids.append(token_id)
        return req.status

    def on_draft_accepted(self, request_id: str, tokens: int = 1) -> None:
        """A speculative decode (read back) kept ``tokens`` more of its proposed tokens than
        the one token it was dispatched for: their KV is computed and each was generated."""
        req = self._live(request_id)
        if req.status is not _S.DECODING or req.decode_inflight or tokens < 0:
            raise SchedulerStateError(
                f"request {request_id!r} cannot accept {tokens} drafted tokens ({req.status.value}, "
                f"decode in flight: {req.decode_inflight})"
            )
        req.computed += tokens
        req.generated += tokens

    def on_prefix_taken(self, request_id: str, tokens: int, end: int | None = None) -> None:
        """The first chunk in flight of ``request_id`` starts at ``tokens`` (at most its planned
        start): the engine could take only that much of the cached prefix (a prefetch that did
        not land, the tree held less by then, or no room to load it).  The chunk computes from
        there up to ``end`` (at most its planned end; None: the planned end).  What it did not
        take is not counted as a hit of the tier it was planned from (storage first, then host,
        then device: the order a prefix is cut)."""
        req = self._live(request_id)
        planned_end = req.inflight_end
        if req.status is not _S.PREFILLING or planned_end is None or not 0 <= tokens <= req.computed:
            raise SchedulerStateError(
                f"request {request_id!r} cannot start its chunk at {tokens} ({req.status.value}, at {req.computed})"
            )
        if end is not None and not tokens < end <= planned_end:
            raise SchedulerStateError(f"request {request_id!r}: chunk end {end} outside ({tokens}, {planned_end}]")
        lost = req.computed - tokens
        req.computed = tokens
        if end is not None:
            req.inflight_end = end
        if req.cached_tokens is not None and req.first_scheduled_round == self._round:
            for tier in ("storage", "host", "device"):  # the hits _dispatch_prefill counted this round
                cut = min(lost, req.cached_tokens.get(tier, 0))
                req.cached_tokens[tier] -= cut
                self._hits[tier] -= cut
                lost -= cut

    def hold(self, request_id: str, held: bool) -> None:
        """While held, a decoding request is not scheduled: the engine has host work to do
        on its last token before its next step (a structured output's next-token mask).
        Unknown ids (already finished or aborted) are ignored."""
        req = self._requests.get(request_id)
        if req is not None:
            req.held = held

    def finish(self, request_id: str) -> ScheduledRequest:
        """The engine's stop rules ended ``request_id``; forget it (its KV goes to the tree)."""
        req = self._live(request_id)
        if req.status is not _S.DECODING or req.decode_inflight:
            raise SchedulerStateError(f"request {request_id!r} cannot finish while {req.status.value} / in flight")
        req.status = _S.FINISHED
        self._decoding -= 1
        del self._requests[request_id]
        self._c["finished"] += 1
        return req

    def abort(self, request_id: str) -> RequestStatus | None:
        """Abort in any state; returns the state it was in, None if unknown or already done.

        A request aborted with a step in flight keeps its id taken until that step's
        result arrives (``on_*_dispatched`` then return ``ABORTED``) or is given up on
        (``forget_in_flight``); the engine releases its pages and tree nodes itself.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        previous = req.status
        if previous is _S.DECODING:
            self._decoding -= 1
        if previous.queued:
            self._queue.remove(request_id)
        if req.inflight_end is not None or req.decode_inflight:
            self._aborted_in_flight.add(request_id)
        req.status = _S.ABORTED
        self._c["aborted"] += 1
        return previous

    def forget_in_flight(self, request_id: str) -> None:
        """An aborted request's in-flight work will never be reported done (its step failed)."""
        self._aborted_in_flight.discard(request_id)

    # -- views -------------------------------------------------------------
    def get(self, request_id: str) -> ScheduledRequest | None:
        return self._requests.get(request_id)

    def _live(self, request_id: str) -> ScheduledRequest:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"no live request {request_id!r}")
        return req

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self._requests) - len(self._queue)

    @property
    def num_decoding(self) -> int:
        return self._decoding

    def has_work(self) -> bool:
        return bool(self._requests)

    def queue_order(self) -> tuple[str, ...]:
        """The waiting queue, head first (deferred requests lead)."""
        return tuple(self._queue)

    def stats(self) -> SchedulerStats:
        by = {s: 0 for s in _S}
        for r in self._requests.values():
            by[r.status] += 1
        return SchedulerStats(
            waiting=by[_S.WAITING],
            deferred=by[_S.DEFERRED],
            prefilling=by[_S.PREFILLING],
            decoding=by[_S.DECODING],
            rounds=self._round,
            submitted=self._arrivals,
            hit_tokens=dict(self._hits),
            **self._c,
        )


def _decode_page(seq_len: int, page_size: int) -> int:
    """Device tokens a decode step of a request holding ``seq_len`` tokens must allocate: a new
    page when the next KV slot starts one."""
    return page_size if (seq_len - 1) % page_size == 0 else 0
