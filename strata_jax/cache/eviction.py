"""Allocation and eviction of L1/L2 pages for the cache controller.

``Eviction`` is a mixin of ``CacheController``.  Contract: ``alloc_device(n)``
returns ``n`` free L1 pages, evicting unlocked LRU leaves first (backing them up
to L2 under ``write_back``) and raising ``CacheFullError`` when locked data leaves
too little room; ``_alloc_host(n)`` does the same for L2 (writing back to L3 where
due) and returns None instead of raising.  Locked nodes are never evicted, so each
tier always holds a prefix of each history (the tree enforces it).
"""

from __future__ import annotations

from collections.abc import Sequence

from strata_jax.cache.handles import CacheFullError
from strata_jax.cache.radix_tree import TreeNode


class Eviction:
    """Mixin: page allocation and per-tier eviction."""

    def alloc_device(self, n: int) -> list[int]:
        """``n`` L1 pages, evicting unlocked LRU leaves (to L2 under ``write_back``) as needed.

        Raises ``CacheFullError`` when locked data leaves too little room.
        """
        pages = self.device_alloc.alloc(n)
        if pages is None:
            self.evict_device(n - self.device_alloc.num_free)
            pages = self.device_alloc.alloc(n)
        if self._backup_queue:  # a page handed out here may be one a queued backup reads: gather it first
            self.flush_backups()
        if pages is None and self._pending:
            self.drain()  # in-flight backups pin their nodes; let them land, then retry
            self.evict_device(n - self.device_alloc.num_free)
            pages = self.device_alloc.alloc(n)
        if pages is None:
            raise CacheFullError(
                f"need {n} device pages, only {self.device_alloc.num_free} free after evicting all unlocked pages"
            )
        return pages

    def free_device(self, pages: Sequence[int]) -> None:
        """Return caller-owned L1 pages (e.g. an aborted request's new pages)."""
        self.device_alloc.free(pages)

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed."""
        backup = self._write_back_hook if (self.config.write_policy == "write_back" and self.config.has_host) else None
        freed = self.tree.evict_device(num_pages, backup, self._drop_host_pages)
        if self._backup_queue:  # write-backs of the freed pages: gather them while their local pages are theirs
            self.flush_backups()
        # Freed device pages may still be read by a just-dispatched gather (a
        # write-back); the next writer of the donated pool is ordered after it.
        self.device_alloc.free(freed)
        self.counters["evicted_device_pages"] += len(freed)
        return len(freed)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible (L3 write-back first where due); returns pages freed."""
        hook = self._storage_write_back_hook if self.storage is not None else None
        freed = self.tree.evict_host(num_pages, hook)
        self.host_alloc.free(freed)
        self.counters["evicted_host_pages"] += len(freed)
        return len(freed)

    def _drop_host_pages(self, pages: list[int]) -> None:
        """Host pages of nodes L1 eviction removed (they hung below a prefix leaving every tier)."""
        self.host_alloc.free(pages)
        self.counters["evicted_host_pages"] += len(pages)

    def _write_back_hook(self, node: TreeNode) -> list[int] | None:
        pages = self._alloc_host(len(node.device))  # type: ignore[arg-type]
        if pages is None:
            return None
        self._issue_backup(node, pages)
        return pages

    def _alloc_host(self, n: int) -> list[int] | None:
        pages = self.host_alloc.alloc(n)
        if pages is None and self.host_alloc.num_pages >= n:
            hook = self._storage_write_back_hook if self.storage is not None else None
            freed = self.tree.evict_host(n - self.host_alloc.num_free, hook)
            self.host_alloc.free(freed)
            self.counters["evicted_host_pages"] += len(freed)
            pages = self.host_alloc.alloc(n)
            if pages is None and any(not h.done and h.kind == "backup" for h in self._pending):
                self.drain()  # backups in flight pin their nodes
                freed = self.tree.evict_host(n - self.host_alloc.num_free, hook)
                self.host_alloc.free(freed)
                self.counters["evicted_host_pages"] += len(freed)
                pages = self.host_alloc.alloc(n)
        return pages

    def _storage_write_back_hook(self, node: TreeNode) -> None:
        if not node.storage_backed:
            self._write_storage(node)

    def flush(self) -> None:
        """Drop every unlocked cached page from L1 and L2 (storage is left alone)."""
        self.drain()
        self.device_alloc.free(self.tree.evict_device(1 << 62, drop_host=self.host_alloc.free))
        self.host_alloc.free(self.tree.evict_host(1 << 62))
