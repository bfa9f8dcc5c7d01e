"""Allocation and eviction of L1/L2 pages (pure Python).

``Eviction`` is the cache controller's part for pages: ``alloc_device(n)`` returns ``n``
free L1 pages, evicting unlocked LRU leaves first (backing them up to L2 under
``write_back``) and raising ``CacheFullError`` when locked data leaves too little room;
``alloc_host(n)`` does the same for L2 (writing back to L3 where due) and returns None
instead of raising.  Locked nodes are never evicted, so each tier always holds a prefix
of each history (the tree enforces it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from strata_jax.cache.allocator import PageAllocator
from strata_jax.cache.handles import CacheFullError
from strata_jax.cache.inflight import InFlight
from strata_jax.cache.radix_tree import HiRadixTree, TreeNode

if TYPE_CHECKING:
    from strata_jax.cache.write_policy import Writes

WriteBack = Callable[[TreeNode], "list[int] | None"]
StorageWriteBack = Callable[[TreeNode], None]


class Eviction:
    """Page allocation over the tree's LRU eviction (``flush``: dispatch queued backup gathers)."""

    def __init__(
        self,
        tree: HiRadixTree,
        device_alloc: PageAllocator,
        host_alloc: PageAllocator,
        inflight: InFlight,
        flush: Callable[[], None],
    ) -> None:
        self._tree = tree
        self._device = device_alloc
        self._host = host_alloc
        self._inflight = inflight
        self._flush = flush
        self._write_back: WriteBack | None = None
        self._storage_write_back: StorageWriteBack | None = None
        self.counts = {"evicted_device_pages": 0, "evicted_host_pages": 0}

    def hook_writes(self, write_back: WriteBack | None, writes: Writes) -> None:
        """Wire the write policy in (it allocates L2 pages through this object, so it is built
        after it): ``write_back`` backs up what L1 eviction drops (None: dropped); L2 eviction
        writes to L3 first what L3 lacks when ``writes`` has a store.  Bound methods, not
        closures, so that a deep copy of the controller evicts on its own copy."""
        self._write_back = write_back
        self._storage_write_back = writes.storage_write_back if writes.has_store else None

    def alloc_device(self, n: int) -> list[int]:
        """``n`` L1 pages, evicting unlocked LRU leaves as needed; ``CacheFullError`` when locked
        data leaves too little room."""
        pages = self._device.alloc(n)
        if pages is None:
            self.evict_device(n - self._device.num_free)
            pages = self._device.alloc(n)
        self._flush()  # a page handed out here may be one a queued backup reads: gather it first
        if pages is None and len(self._inflight):
            self._inflight.drain()  # in-flight backups pin their nodes; let them land, then retry
            self.evict_device(n - self._device.num_free)
            pages = self._device.alloc(n)
        if pages is None:
            raise CacheFullError(
                f"need {n} device pages, only {self._device.num_free} free after evicting all unlocked pages"
            )
        return pages

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed."""
        freed = self._tree.evict_device(num_pages, self._write_back, self._drop_host_pages)
        self._flush()  # write-backs of the freed pages: gather them while their local pages are theirs
        # Freed device pages may still be read by a just-dispatched gather (a write-back); the
        # next writer of the donated pool is ordered after it.
        self._device.free(freed)
        self.counts["evicted_device_pages"] += len(freed)
        return len(freed)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible (L3 write-back first where due); returns pages freed."""
        freed = self._tree.evict_host(num_pages, self._storage_write_back)
        self._host.free(freed)
        self.counts["evicted_host_pages"] += len(freed)
        return len(freed)

    def _drop_host_pages(self, pages: list[int]) -> None:
        """Host pages of nodes L1 eviction removed (they hung below a prefix leaving every tier)."""
        self._host.free(pages)
        self.counts["evicted_host_pages"] += len(pages)

    def alloc_host(self, n: int) -> list[int] | None:
        """``n`` L2 pages, evicting unlocked LRU leaves as needed; None if they cannot be had."""
        pages = self._host.alloc(n)
        if pages is None and self._host.num_pages >= n:
            self.evict_host(n - self._host.num_free)
            pages = self._host.alloc(n)
            if pages is None and self._inflight.has_unlanded("backup"):
                self._inflight.drain()  # backups in flight pin their nodes
                self.evict_host(n - self._host.num_free)
                pages = self._host.alloc(n)
        return pages

    def drop_unlocked(self, scope: Callable[[str], bool] | None = None) -> None:
        """Drop every unlocked cached page from L1 and L2 (storage is left alone); ``scope``:
        only those of the namespaces it accepts."""
        self._inflight.drain()
        self._device.free(self._tree.evict_device(1 << 62, drop_host=self._host.free, scope=scope))
        self._host.free(self._tree.evict_host(1 << 62, scope=scope))

    def free_device(self, pages: Sequence[int]) -> None:
        """Return caller-owned L1 pages (e.g. an aborted request's new pages)."""
        self._device.free(pages)
