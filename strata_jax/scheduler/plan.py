"""What one ``Scheduler.schedule`` call returns.

The engine executes a ``StepPlan`` in this order (docs/design.md §4):

    1. for r in plan.retract:  back r's KV up to L2, unlock it, free its device pages
    2. lock each prefill item's matched prefix (``item.match``), then evict
       ``plan.evict_device_tokens`` cold device tokens to L2 (never locked ones)
    3. issue the loads of ``plan.loads`` (L2->L1, L3->L2->L1) for those prefixes
    4. if plan.decode_first: run decode, then wait for loads, run extend
       elif plan.mixed:      wait for loads, run extend with a token of each decode row in it
       else:                 wait for loads, run extend, then run decode
    5. report back: on_prefill_dispatched / on_decode_dispatched per request

Token ranges of a prefill item (positions in ``item.request.prefill_tokens``):

    [0, device_hit_tokens)                      already on the device: lock only
    [device_hit_tokens, start)                  load: host then storage tokens
    [start, end)                                compute now (the chunk)
    [end, len(prefill_tokens))                  later chunks
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_jax.scheduler.cache_view import PrefixMatchLike
from strata_jax.scheduler.request import ScheduledRequest


@dataclass(frozen=True)
class PrefillItem:
    """One request's part of the prefill (extend) batch."""

    request: ScheduledRequest
    start: int
    end: int
    device_hit_tokens: int = 0
    load_host_tokens: int = 0
    load_storage_tokens: int = 0
    match: PrefixMatchLike | None = None  # None for a continuing chunk (its prefix is already its own)
    recomputed_cached_tokens: int = 0  # load-or-recompute chose to recompute these cached (L2/L3) tokens
    bundled: bool = False  # pulled in as a bundle hit (shares a load already in the batch)
    set_aside: bool = False  # admitted in Algorithm 1's backfill after being set aside

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def new_tokens(self) -> int:
        return self.end - self.start

    @property
    def load_tokens(self) -> int:
        return self.load_host_tokens + self.load_storage_tokens

    @property
    def is_first_chunk(self) -> bool:
        return self.match is not None

    @property
    def is_last_chunk(self) -> bool:
        """Completing this chunk completes the prefill (the step samples a token)."""
        return self.end == len(self.request.prefill_tokens)


@dataclass(frozen=True)
class StepPlan:
    """The control-plane decision for one engine step (see module doc for its execution)."""

    round: int
    prefill: tuple[PrefillItem, ...] = ()
    decode: tuple[ScheduledRequest, ...] = ()
    decode_first: bool = False
    mixed: bool = False  # the decode rows' tokens ride in the extend's program (one step, not two)
    evict_device_tokens: int = 0
    retract: tuple[ScheduledRequest, ...] = ()
    deferred: tuple[str, ...] = ()
    set_aside: tuple[str, ...] = ()
    est_load_s: float = 0.0
    est_prefill_s: float = 0.0
    est_decode_s: float = 0.0

    @property
    def loads(self) -> tuple[PrefillItem, ...]:
        """Prefill items that need KV brought to the device before their extend."""
        return tuple(item for item in self.prefill if item.load_tokens > 0)

    @property
    def prefill_ids(self) -> tuple[str, ...]:
        return tuple(item.request_id for item in self.prefill)

    @property
    def decode_ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode and not self.retract


@dataclass(frozen=True)
class SchedulerStats:
    """Queue lengths now, and counters since start."""

    waiting: int
    deferred: int
    prefilling: int
    decoding: int
    rounds: int
    submitted: int
    finished: int
    aborted: int
    deferrals: int  # times a request went from waiting to deferred
    deferred_rounds: int  # (request, round) pairs spent deferred
    set_asides: int
    bundle_hits: int
    retractions: int
    decode_first_rounds: int
    mixed_rounds: int  # rounds whose decode rows rode in the prefill's program
    recomputed_prompt_tokens: int  # prompt tokens computed (not taken from any tier)
    load_or_recompute_recomputed: int  # first chunks that recomputed a cached prefix instead of loading it
    load_or_recompute_tokens: int  # cached (L2/L3) tokens recomputed by that choice
    prefetch_waits: int  # requests held back until their L3 prefetch landed (loading it estimated sooner)
    prefetch_wait_rounds: int  # (request, round) pairs spent so
    prefetch_not_waited: int  # requests started with a prefetch in flight (recomputing the rest estimated sooner)
    hit_tokens: dict[str, int]  # per tier, taken by first chunks
