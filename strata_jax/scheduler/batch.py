"""``BatchBuilder``: the room, device-memory and load accounting of one prefill batch.

Policies decide *which* requests to try, in what order; the builder decides
whether one fits (token budget, batch size, device capacity) and what it costs
to load.  Loads are accounted over the union of the batch's cached prefixes:
two requests on the same document load it once (the second is a bundle hit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata_jax.scheduler.cache_view import PrefixMatchLike
from strata_jax.scheduler.cost_model import CostModel, ExtendItem
from strata_jax.scheduler.plan import PrefillItem
from strata_jax.scheduler.request import ScheduledRequest


@dataclass(frozen=True)
class Candidate:
    """A request this round could admit, with the part of its match it would use.

    ``start`` is where computing begins: the cached prefix taken (page-aligned,
    and short of the whole sequence so the step has a token to sample from) or,
    for a continuing chunked prefill, the tokens already computed.
    ``device``/``host``/``storage`` split ``[0, start)`` by tier.
    """

    request: ScheduledRequest
    start: int
    device: int = 0
    host: int = 0
    storage: int = 0
    match: PrefixMatchLike | None = None
    recomputed_cached: int = 0  # cached tokens (L2/L3) this candidate recomputes instead of loading

    @property
    def loads(self) -> bool:
        return self.host + self.storage > 0

    @property
    def remaining(self) -> int:
        """Tokens still to compute from ``start`` to the end of the prompt."""
        return len(self.request.prefill_tokens) - self.start

    @classmethod
    def from_match(cls, request: ScheduledRequest, match: PrefixMatchLike, page_size: int) -> Candidate:
        n = len(request.prefill_tokens)
        cached = match.device_tokens + match.host_tokens + match.storage_tokens
        # Keep at least one token to compute; stay on a page boundary.
        start = min(cached, ((n - 1) // page_size) * page_size)
        start = max(0, start)
        device = min(match.device_tokens, start)
        host = min(match.host_tokens, start - device)
        storage = start - device - host
        return cls(request, start, device, host, storage, match)

    def recomputing_cached(self, page_size: int) -> Candidate:
        """The same request recomputing its L2/L3 part instead of loading it (device part kept)."""
        start = (self.device // page_size) * page_size
        return Candidate(self.request, start, start, 0, 0, self.match, recomputed_cached=self.host + self.storage)

    @classmethod
    def continuing(cls, request: ScheduledRequest) -> Candidate:
        return cls(request, request.computed)


def shared_pages(a: list[int], b: list[int], limit: int) -> int:
    """Number of leading equal page keys of ``a`` and ``b``, at most ``limit`` (binary search)."""
    hi = min(limit, len(a), len(b))
    if hi == 0 or a[hi - 1] == b[hi - 1]:
        return hi
    lo = 0  # invariant: first lo keys equal, key hi-1 differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """Length of the common prefix of ``a[:limit]`` and ``b[:limit]`` (C-speed slice compares)."""
    hi = min(limit, len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Cost:
    """What admitting a candidate adds to the batch."""

    end: int
    load_host: int
    load_storage: int
    lock_tokens: int  # device tokens of its prefix newly pinned (no longer evictable)
    need_tokens: int  # device tokens to allocate (loaded pages + computed pages)


@dataclass
class BatchBuilder:
    """Accumulates one prefill batch under its limits.

    ``device_capacity``: device tokens this batch may take (free + evictable,
    minus what the decode batch needs).  Every device need is counted in whole
    pages.  Locking a device-resident prefix counts against capacity too
    (conservatively: it may already be locked by a running request).
    """

    token_budget: int
    max_size: int
    device_capacity: int
    page_size: int
    cost: CostModel
    loading_bound_ratio: float | None = None
    new_room: int | None = None  # requests that may start running (None: no cap)
    items: list[PrefillItem] = field(default_factory=list)
    load_host: int = 0
    load_storage: int = 0
    used_tokens: int = 0  # device capacity used (need + locks)
    need_tokens: int = 0  # device tokens to allocate
    _prefixes: list[tuple[ScheduledRequest, int]] = field(default_factory=list)
    _computed: int = 0
    _started: int = 0
    # (a, b, limit) -> shared tokens: one round asks the same pairs again and again
    # (every candidate's cost against every member); prompts do not change within it.
    _shared_memo: dict[tuple[str, str, int], int] = field(default_factory=dict)

    # -- queries -----------------------------------------------------------
    @property
    def budget_left(self) -> int:
        return self.token_budget - self._computed

    def has_room(self) -> bool:
        """Room for one more request from the queue (a request that starts running)."""
        return (
            len(self.items) < self.max_size
            and self.budget_left > 0
            and self.device_capacity - self.used_tokens > 0
            and (self.new_room is None or self._started < self.new_room)
        )

    def extend_items(self) -> list[ExtendItem]:
        return [(item.new_tokens, item.start) for item in self.items]

    def would_be_loading_bound(self, cand: Candidate) -> bool:
        """Would the batch with ``cand`` added (its chunk as it would be cut now) be loading-bound?"""
        c = self._cost(cand, min(cand.remaining, self.budget_left))
        items = self.extend_items() + [(c.end - cand.start, cand.start)]
        return self.cost.would_be_loading_bound(
            self.load_host + c.load_host, self.load_storage + c.load_storage, items, self.loading_bound_ratio
        )

    def is_bundle_hit(self, cand: Candidate, by: PrefillItem | None = None) -> bool:
        """``cand`` loads something, and all of it is already being loaded for the batch.

        With ``by``, only that member's prefix is compared (a prefix is covered by
        the union of the members' prefixes iff one member's prefix covers it).
        """
        if not cand.loads or not self.items:
            return False
        if by is None:
            return self._shared_prefix(cand) >= cand.start
        if by.load_tokens == 0 or by.start < cand.start:
            return False
        return self._shared(cand.request, by.request, cand.start) >= cand.start

    # -- admission ---------------------------------------------------------
    def try_add(
        self, cand: Candidate, *, bundled: bool = False, set_aside: bool = False, reserve_tokens: int = 0
    ) -> PrefillItem | None:
        """Admit ``cand`` (chunked to the budget, less ``reserve_tokens`` kept for later
        members, and to the device capacity) or return None if it cannot fit."""
        budget = self.budget_left - reserve_tokens
        if len(self.items) >= self.max_size or budget <= 0:
            return None
        starts = cand.match is not None  # a queued request's first chunk: it starts running
        if starts and self.new_room is not None and self._started >= self.new_room:
            return None
        remaining = cand.remaining
        c = self._cost(cand, min(remaining, budget))
        spare = self.device_capacity - self.used_tokens
        if c.need_tokens + c.lock_tokens > spare:
            # Shrink the chunk to the pages left after the load and the locks.
            fixed = self._cost(cand, 0)
            pages_left = (spare - fixed.need_tokens - fixed.lock_tokens) // self.page_size
            slack = -cand.start % self.page_size  # room left in a partly filled last page
            n = min(remaining, budget, pages_left * self.page_size + slack) if pages_left >= 0 else 0
            if n <= 0:
                return None
            c = self._cost(cand, n)
        item = PrefillItem(
            request=cand.request,
            start=cand.start,
            end=c.end,
            device_hit_tokens=cand.device if cand.match is not None else 0,
            load_host_tokens=cand.host,
            load_storage_tokens=cand.storage,
            match=cand.match,
            recomputed_cached_tokens=cand.recomputed_cached,
            bundled=bundled,
            set_aside=set_aside,
        )
        self.items.append(item)
        self.load_host += c.load_host
        self.load_storage += c.load_storage
        self.used_tokens += c.need_tokens + c.lock_tokens
        self.need_tokens += c.need_tokens
        if cand.match is not None and cand.start > 0:
            self._prefixes.append((cand.request, cand.start))
        self._computed += item.new_tokens
        self._started += starts
        return item

    # -- internals ---------------------------------------------------------
    def _shared_prefix(self, cand: Candidate) -> int:
        """Longest prefix of ``cand``'s cached part that another batch member already covers (page-aligned)."""
        if cand.match is None or cand.start == 0:
            return 0
        best = 0
        for other, other_start in self._prefixes:
            best = max(best, self._shared(cand.request, other, min(cand.start, other_start)))
        return best

    def _shared(self, a: ScheduledRequest, b: ScheduledRequest, limit: int) -> int:
        """Tokens (whole pages) of common prefix of ``a`` and ``b`` in one namespace, at most ``limit``."""
        if a.namespace != b.namespace:
            return 0
        memo_key = (a.request_id, b.request_id, limit)
        hit = self._shared_memo.get(memo_key)
        if hit is None:
            ps = self.page_size
            hit = self._shared_memo[memo_key] = shared_pages(a.page_keys(ps), b.page_keys(ps), limit // ps) * ps
        return hit

    def _pages(self, lo: int, hi: int) -> int:
        """Device tokens (whole pages) to hold positions [lo, hi) when [0, lo) is already held."""
        ps = self.page_size
        return max(0, (-(-hi // ps) - -(-lo // ps)) * ps)

    def _cost(self, cand: Candidate, new_tokens: int) -> _Cost:
        end = cand.start + new_tokens
        compute = self._pages(cand.start, end)
        if cand.match is None:  # continuing chunk: prefix already held by the request
            return _Cost(end, 0, 0, 0, compute)
        shared = self._shared_prefix(cand)
        lo = max(shared, cand.device)  # [lo, start) is this candidate's own load
        host_end = cand.device + cand.host
        load_host = max(0, min(cand.start, host_end) - lo)
        load_storage = max(0, cand.start - max(lo, host_end))
        lock = max(0, cand.device - shared)
        return _Cost(end, load_host, load_storage, lock, load_host + load_storage + compute)
