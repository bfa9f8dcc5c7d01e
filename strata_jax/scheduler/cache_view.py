"""``CacheView``: the narrow window through which the scheduler sees the cache.

The engine implements it as an adapter over the HiRadixTree and the cache
controller; tests implement it with fakes (``strata_jax.scheduler.testing``).
The scheduler only reads through it: it never locks, inserts, evicts or loads.
Those are the engine's job, done from the returned ``StepPlan``.

Contract of ``match(request)`` (one walk of the tree for ``request.prefill_tokens``
in ``request.namespace``), fields named as in the cache's ``PrefixMatch``:

    |<- device_tokens ->|<- host_tokens ->|<- storage_tokens ->|<- transient_tokens ->|
     ready, KV in L1      ready, KV in L2    ready, KV in L3 only  in_queue/in_flight nodes
                          (not in L1)        (incl. what the        owned by *other*
                                             store reports)         requests

each count is *additional* to the ones on its left along the same path; all are
page-aligned.  ``transient_owners`` are the request ids owning the transient
nodes matched (the requesting request itself must not be listed, and its own
``in_queue`` nodes must not be counted in ``transient_tokens``).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from strata_jax.scheduler.request import ScheduledRequest


@runtime_checkable
class PrefixMatchLike(Protocol):
    """What a prefix match must expose (the cache's frozen ``PrefixMatch`` does)."""

    @property
    def device_tokens(self) -> int: ...
    @property
    def host_tokens(self) -> int: ...
    @property
    def storage_tokens(self) -> int: ...
    @property
    def transient_tokens(self) -> int: ...
    @property
    def transient_owners(self) -> Collection[Hashable]: ...  # request ids (the cache's owners are any hashable)


@dataclass(frozen=True)
class StaticMatch:
    """A plain ``PrefixMatchLike`` value (for fakes, simulators and adapters)."""

    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    transient_tokens: int = 0
    transient_owners: frozenset[str] = frozenset()

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens


class CacheView(Protocol):
    """Read-only view of the cache for one scheduling round.

    Called only inside ``Scheduler.schedule``; the answers must be consistent
    for the duration of that call (the engine does not mutate the cache while
    scheduling).
    """

    @property
    def page_size(self) -> int:
        """Tokens per KV page (device allocations are whole pages)."""
        ...

    def match(self, request: ScheduledRequest) -> PrefixMatchLike:
        """Prefix match of ``request.prefill_tokens`` in ``request.namespace`` (see module doc)."""
        ...

    def load_pending(self, request_id: str) -> bool:
        """True while a load or prefetch already issued for this request has not landed."""
        ...

    def prefetch_progress(self, request_id: str) -> tuple[int, int, float] | None:
        """The request's L3 prefetch still in flight: (tokens landed, tokens fetched in all,
        seconds since it was issued); None when there is none (asked only with
        ``SchedulerConfig.wait_for_prefetch``)."""
        ...

    def free_device_tokens(self) -> int:
        """Device (L1) tokens allocatable right now without evicting anything."""
        ...

    def new_request_room(self, step_tokens: int) -> int | None:
        """How many more requests may start running now, for device memory the token counts
        do not show (a model with sliding-window layers: the local-layer pages their windows
        pin), leaving room for a prefill step of ``step_tokens``; None: no such limit.  At
        least 1 once nothing holds that memory (requests that just finished may still hold
        it for a round), so a queue never waits forever."""
        ...

    def evictable_device_tokens(self) -> int:
        """Device tokens held by unlocked tree nodes that eviction to L2 could free.

        The engine locks the matched prefixes of the planned batch *before* it
        evicts, so eviction never takes a prefix the plan counts on; the
        scheduler accounts for those locks conservatively.
        """
        ...
