"""L3 -> L2 prefetches: when to start one, how it stops, how what landed joins the tree (pure Python).

``Prefetcher`` is the cache controller's part for prefetches.  Contract:

* ``start(tokens, ns, match, rid)`` starts an L3 -> L2 copy of the storage hit after the
  tree's data prefix; the handle holds a lock on ``match.last_node`` and reserves its host
  pages until ``finish`` (stop policy; landed pages join the tree as host nodes) or
  ``cancel`` (everything dropped).
* The reading itself is the transfer backend's (``start_prefetch``); its reader touches
  only the backend, the host pages reserved for it and its handle.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from strata_jax.cache.allocator import PageAllocator
from strata_jax.cache.config import CacheConfig
from strata_jax.cache.handles import Completion, PrefetchHandle
from strata_jax.cache.hashing import chain_hashes
from strata_jax.cache.inflight import InFlight
from strata_jax.cache.radix_tree import HiRadixTree, PrefixMatch
from strata_jax.cache.storage_service import StorageService
from strata_jax.cache.transfer_backend import TransferBackend


class Prefetcher:
    """Starts, stops and settles prefetches; ``alloc_host(n)`` gives L2 pages (evicting) or None."""

    def __init__(
        self,
        config: CacheConfig,
        tree: HiRadixTree,
        host_alloc: PageAllocator,
        transfers: TransferBackend,
        store: StorageService,
        inflight: InFlight,
        alloc_host: Callable[[int], list[int] | None],
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._tree = tree
        self._host_alloc = host_alloc
        self._transfers = transfers
        self._store = store
        self._inflight = inflight
        self._alloc_host = alloc_host
        self._clock = clock
        self.reserved: set[int] = set()  # host pages held by prefetches not settled yet
        self.counts = {"prefetched_pages": 0, "prefetched_bytes": 0}

    def start(
        self, tokens: Sequence[int], namespace: str, match: PrefixMatch, request_id: Hashable | None = None
    ) -> PrefetchHandle | None:
        """Start fetching ``match.storage_tokens`` from L3 into L2 (asynchronous).

        ``None`` when there is no storage hit of at least ``prefetch_min_tokens`` or L2 has no
        room.  The handle holds a lock on ``match.last_node`` and the reserved host pages.
        """
        cfg = self._config
        if self._host_alloc.num_pages == 0:
            return None
        if match.storage_tokens <= 0 or match.storage_tokens < cfg.prefetch_min_tokens:
            return None
        ps = cfg.page_size
        start = (match.device_tokens + match.host_tokens) // ps
        n = match.storage_tokens // ps
        keys = list(match.storage_keys[:n])
        if len(keys) < n:
            keys = chain_hashes(self._tree.last_hash(match.last_node), tokens[start * ps : (start + n) * ps], ps)
        self._tree.lock(match.last_node)
        host_pages = self._alloc_host(n)
        if host_pages is None:
            self._tree.unlock(match.last_node)
            return None
        now = self._clock()
        nbytes = n * self._transfers.page_bytes

        def build(completion: Completion) -> PrefetchHandle:
            return PrefetchHandle(
                "prefetch",
                request_id,
                n,
                nbytes,
                now,
                completion,
                tokens=tuple(tokens[: (start + n) * ps]),
                namespace=namespace,
                start_page=start,
                keys=keys,
                host_pages=host_pages,
                anchor=match.last_node,
                deadline=now + cfg.prefetch_timeout_base_s + n * cfg.prefetch_timeout_per_page_s,
            )

        self.reserved.update(host_pages)
        handle = self._transfers.start_prefetch(self._store, n, now, build)
        self._inflight.track(handle)
        return handle

    def progress(self, request_id: Hashable) -> tuple[int, int, float] | None:
        """``request_id``'s prefetch still in flight: (tokens landed, tokens in all, seconds since issue)."""
        ps = self._config.page_size
        for h in self._inflight.prefetches_of(request_id):
            if not self._inflight.finished(h):
                landed = self._transfers.pages_landed(h)
                return landed * ps, h.num_pages * ps, self._clock() - h.issued_at
        return None

    def finish(self, handle: PrefetchHandle) -> int:
        """Apply the stop policy, put the landed pages into the tree as host nodes; returns tokens landed.

        ``best_effort`` and ``cost``: stop now and keep what landed (under ``cost`` the
        scheduler already waited as long as waiting was estimated to pay); ``wait_complete``:
        wait for every page; ``timeout``: wait until the handle's deadline (base + per-page
        budget), then stop.  Unlocks the anchor and frees unused host pages.
        """
        if handle.finished:
            return handle.landed * self._config.page_size
        return self._settle(handle, self._transfers.stop_prefetch(handle, self._config.prefetch_policy))

    def cancel(self, handle: PrefetchHandle) -> None:
        """Stop a prefetch and drop everything it fetched."""
        if handle.finished:
            return
        self._transfers.cancel_prefetch(handle)
        self._settle(handle, 0)

    def cancel_all(self, request_id: Hashable | None = None) -> None:
        """Cancel the prefetches of ``request_id`` (every one with None)."""
        handles = self._inflight.prefetches() if request_id is None else self._inflight.prefetches_of(request_id)
        for h in handles:
            self.cancel(h)

    def _settle(self, handle: PrefetchHandle, landed: int) -> int:
        # Host pages reserved by the prefetch:
        #   |<- landed: handed to the tree (or unused -> freed) ->|<- not landed: freed ->|
        ps = self._config.page_size
        if handle.missed:  # the backend lost objects since it was probed: probe afresh
            self._store.forget_probes()
        self.reserved.difference_update(handle.host_pages)
        self._transfers.release_prefetch(handle)
        to_free = list(handle.host_pages[landed:])
        if landed:
            tokens = handle.tokens[: (handle.start_page + landed) * ps]
            res = self._tree.insert(
                tokens, handle.namespace, host_pages=handle.host_pages[:landed], start_page=handle.start_page
            )
            to_free.extend(res.unused_pages)
            end = self._tree.match_prefix(tokens, handle.namespace, touch=False).last_node
            self._tree.adopt_hashes(end, handle.keys[:landed], handle.start_page)
            # Every node of the landed pages is backed by L3, the new ones and the request's own
            # transient nodes that adopted pages alike: write-through must not write them back
            # (building ~0.1 GB of payloads on the engine thread for a 3K-token prompt).
            node, start = end, len(tokens)
            while node.parent is not None and (start := start - len(node.key)) >= handle.start_page * ps:
                self._tree.set_storage_backed(node, True)
                node = node.parent
        self._host_alloc.free(to_free)
        assert handle.anchor is not None  # every prefetch locks its anchor
        self._tree.unlock(handle.anchor)
        handle.finished = True
        handle.landed = landed
        self.counts["prefetched_pages"] += landed
        self.counts["prefetched_bytes"] += landed * self._transfers.page_bytes
        if not handle.done:
            self._inflight.complete(handle)
        self._inflight.forget(handle)
        return landed * ps
