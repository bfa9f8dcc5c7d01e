"""``EngineCacheView``: the scheduler's read-only window on the engine's cache
(the ``strata_jax.scheduler.cache_view.CacheView`` protocol)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from strata_jax.cache.controller import CacheController
from strata_jax.cache.radix_tree import PrefixMatch
from strata_jax.engine.requests import without_cache
from strata_jax.scheduler.request import ScheduledRequest


class EngineCacheView:
    """Matches are memoized per request until the tree changes (``HiRadixTree.version``):
    the scheduler re-matches every waiting request every round, and a long prompt's
    match costs a walk over all its tokens.  Not with L3, whose hits the tree does
    not know.  After a change each request's latest match is its re-match's hint
    (``HiRadixTree.match_prefix(hint=)``: the path is re-checked node by node, not
    token by token); the engine calls ``forget`` when a request leaves.
    """

    def __init__(self, ctl: CacheController[Any], bypasses_cache: Callable[[str], bool]) -> None:
        self.ctl = ctl
        self.page_size = ctl.page_size
        self._memo: dict[str, tuple[int, tuple[int, ...], PrefixMatch]] = {}
        self._hints: dict[str, PrefixMatch] = {}  # latest match per live request, whatever the version
        self._memo_version = -1
        self.bypasses_cache = bypasses_cache

    def match(self, request: ScheduledRequest) -> PrefixMatch:
        m = self._match(request)
        if self.bypasses_cache(request.request_id):  # prompt logprobs: nothing may come from the cache
            return without_cache(m, self.ctl.tree.root(request.namespace))
        return m

    def _match(self, request: ScheduledRequest) -> PrefixMatch:
        tree = self.ctl.tree
        if self.ctl.storage is not None:
            return self.ctl.match_prefix(
                request.prefill_tokens, request.namespace, requester=request.request_id, touch=False
            )
        if tree.version != self._memo_version:
            self._memo.clear()
            self._memo_version = tree.version
        seen = self._memo.get(request.request_id)
        if seen is not None and seen[1] is request.prefill_tokens:
            return seen[2]
        m = self.ctl.match_prefix(
            request.prefill_tokens,
            request.namespace,
            requester=request.request_id,
            touch=False,
            hint=self._hints.get(request.request_id),  # ignored by the tree unless it matched these tokens
        )
        self._hints[request.request_id] = m
        self._memo[request.request_id] = (tree.version, request.prefill_tokens, m)
        return m

    def hint(self, request_id: str) -> PrefixMatch | None:
        """The request's latest match (a hint for the tree; None if there is none)."""
        return self._hints.get(request_id)

    def remember(self, request_id: str, match: PrefixMatch) -> None:
        """A match of the request's ``prefill_tokens`` made elsewhere (admission): its next hint."""
        self._hints[request_id] = match

    def forget(self, request_id: str) -> None:
        """``request_id`` left the engine: drop its memoized match and hint."""
        self._memo.pop(request_id, None)
        self._hints.pop(request_id, None)

    def load_pending(self, request_id: str) -> bool:
        return self.ctl.load_pending(request_id)

    def prefetch_progress(self, request_id: str) -> tuple[int, int, float] | None:
        return self.ctl.prefetch_progress(request_id)

    def free_device_tokens(self) -> int:
        return self.ctl.free_device_tokens()

    def evictable_device_tokens(self) -> int:
        return self.ctl.evictable_device_tokens()

    def new_request_room(self, step_tokens: int) -> int | None:
        return self.ctl.new_request_room(step_tokens)
