"""``FakeCache``: an in-memory ``CacheView`` for tests and quick simulations.

It remembers ready prefixes per tier and transient (not yet computed) prefixes
per owner, as whole token sequences, and answers ``match`` with page-aligned
longest common prefixes, the way the HiRadixTree would.  Capacity numbers are
plain attributes the test sets.  Pure Python; no engine needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata_jax.scheduler.batch import common_prefix_len
from strata_jax.scheduler.cache_view import StaticMatch
from strata_jax.scheduler.request import ScheduledRequest

if TYPE_CHECKING:
    from strata_jax.scheduler.plan import StepPlan
    from strata_jax.scheduler.scheduler import Scheduler

TIERS = ("device", "host", "storage")


@dataclass
class FakeCache:
    page_size: int = 1
    free_tokens: int = 1 << 30
    evictable_tokens: int = 0
    request_room: int | None = None  # new_request_room (None: no limit)
    ready: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # (ns, tokens, tier)
    transient: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # owner -> (ns, tokens)
    pending: set[str] = field(default_factory=set)
    prefetches: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # rid -> (landed, total, waited_s)
    match_calls: int = 0

    # -- CacheView ---------------------------------------------------------
    def match(self, request: ScheduledRequest) -> StaticMatch:
        self.match_calls += 1
        ns, toks = request.namespace, request.prefill_tokens
        reach = {}
        for i, tier in enumerate(TIERS):  # prefix length reachable using tiers up to this one
            reach[tier] = self._align(
                max(
                    (
                        common_prefix_len(toks, t, len(toks))
                        for n, t, tr in self.ready
                        if n == ns and TIERS.index(tr) <= i
                    ),
                    default=0,
                )
            )
        d = reach["device"]
        h = max(d, reach["host"])
        s = max(h, reach["storage"])
        owners, t_len = set(), s
        for owner, (n, t) in self.transient.items():
            if owner == request.request_id or n != ns:
                continue
            lcp = self._align(common_prefix_len(toks, t, len(toks)))
            if lcp > s:
                owners.add(owner)
                t_len = max(t_len, lcp)
        return StaticMatch(d, h - d, s - h, t_len - s, frozenset(owners))

    def load_pending(self, request_id: str) -> bool:
        return request_id in self.pending

    def prefetch_progress(self, request_id: str) -> tuple[int, int, float] | None:
        return self.prefetches.get(request_id)

    def free_device_tokens(self) -> int:
        return self.free_tokens

    def evictable_device_tokens(self) -> int:
        return self.evictable_tokens

    def new_request_room(self, step_tokens: int) -> int | None:
        return self.request_room

    # -- what the engine/tree would do -------------------------------------
    def add_ready(self, tokens: list[int] | tuple[int, ...], tier: str = "device", namespace: str = "") -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}")
        self.ready.append((namespace, tuple(tokens), tier))

    def add_transient(self, owner: str, tokens: list[int] | tuple[int, ...], namespace: str = "") -> None:
        """``owner``'s not-yet-computed prompt (in_queue / in_flight nodes)."""
        self.transient[owner] = (namespace, tuple(tokens))

    def complete(self, request: ScheduledRequest) -> None:
        """``request``'s prefill landed: its transient prefix becomes ready on the device."""
        self.transient.pop(request.request_id, None)
        self.add_ready(request.prefill_tokens, "device", request.namespace)

    def back_up(self, request: ScheduledRequest) -> None:
        """``request`` was retracted: its KV moves to the host (device copies of its prefix dropped)."""
        toks = request.prefill_tokens
        self.ready = [
            (n, t, "host" if tr == "device" and n == request.namespace and toks[: len(t)] == t else tr)
            for n, t, tr in self.ready
        ]
        self.add_ready(toks, "host", request.namespace)

    def drop(self, request_id: str) -> None:
        self.transient.pop(request_id, None)

    def _align(self, n: int) -> int:
        return (n // self.page_size) * self.page_size


def execute(
    plan: StepPlan, scheduler: Scheduler, cache: FakeCache, max_new_tokens: dict[str, int] | int = 1, token: int = 0
) -> list[str]:
    """Play the engine for one ``StepPlan`` instantly; returns the ids that finished.

    Retracted requests' KV goes to the host tier, completed prefills become
    device hits, and a request finishes once it has ``max_new_tokens`` outputs.
    """
    finished = []

    def limit(rid: str) -> int:
        return max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[rid]

    for req in plan.retract:
        cache.back_up(req)
    for item in plan.prefill:
        req = item.request
        status = scheduler.on_prefill_dispatched(req.request_id, token if item.is_last_chunk else None)
        if item.is_last_chunk and status.value == "decoding":
            cache.complete(req)
            if req.num_output_tokens >= limit(req.request_id):
                scheduler.finish(req.request_id)
                finished.append(req.request_id)
    for req in plan.decode:
        if scheduler.on_decode_dispatched(req.request_id, token).value == "decoding" and req.num_output_tokens >= limit(
            req.request_id
        ):
            scheduler.finish(req.request_id)
            finished.append(req.request_id)
    return finished
