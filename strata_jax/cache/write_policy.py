"""When L1 pages are copied to L2 and L2 pages to L3: the write policies (pure Python).

``Writes`` is the cache controller's part for backups.  Contract:

* ``write_through`` backs up every new device-only node of an insert (then L3);
  ``write_through_selective`` backs up a node once its hits reach the threshold
  (``back_up_hot``, on a match); ``write_back`` backs up what L1 eviction drops
  (``write_back``, the tree's eviction hook).  L2 eviction writes to L3 first what L3
  lacks (``storage_write_back``).
* A backup's node stays locked and its host pages are not read until the copy lands
  (``InFlight.wait_host``), so no reader sees a half-written page; then L3 is written
  when there is a store.
"""

from __future__ import annotations

from collections.abc import Callable

from strata_jax.cache.config import CacheConfig
from strata_jax.cache.handles import TransferHandle
from strata_jax.cache.inflight import InFlight
from strata_jax.cache.radix_tree import HiRadixTree, TreeNode
from strata_jax.cache.storage_service import StorageService
from strata_jax.cache.transfer_backend import TransferBackend


class Writes:
    """Backups L1 -> L2 and writes L2 -> L3 under the configured write policy.
    ``alloc_host(n)`` gives L2 pages (evicting) or None."""

    def __init__(
        self,
        config: CacheConfig,
        tree: HiRadixTree,
        transfers: TransferBackend,
        inflight: InFlight,
        store: StorageService | None,
        alloc_host: Callable[[int], list[int] | None],
    ) -> None:
        self._config = config
        self._tree = tree
        self._transfers = transfers
        self._inflight = inflight
        self._store = store
        self._alloc_host = alloc_host
        self.counts = {
            "backed_up_pages": 0,
            "backed_up_bytes": 0,
            "storage_written_pages": 0,
            "storage_written_bytes": 0,
        }

    @property
    def has_store(self) -> bool:
        return self._store is not None

    def back_up_hot(self, node: TreeNode) -> None:
        """``write_through_selective``: back up the nodes on the path to ``node`` whose hits
        reached the threshold (a no-op under the other write policies)."""
        cfg = self._config
        if cfg.write_policy != "write_through_selective" or not cfg.has_host:
            return
        path = []
        while node.parent is not None:
            if node.device is not None and node.host is None and node.hit_count >= cfg.write_through_threshold:
                path.append(node)
            node = node.parent
        for hot in reversed(path):
            if not self.back_up(hot):
                break

    def write_through(self, last: TreeNode) -> None:
        """``write_through``: back up the device-only nodes of the path to ``last`` (just
        inserted), and write to L3 what is in L2 but not in L3."""
        cfg = self._config
        if cfg.write_policy != "write_through" or not cfg.has_host:
            return
        path = []
        while last.parent is not None:
            path.append(last)
            last = last.parent
        for node in reversed(path):
            if node.device is not None and node.host is None:
                if not self.back_up(node):
                    break
            elif node.host is not None and self._store is not None and not node.storage_backed:
                self.write_storage(node)

    def back_up(self, node: TreeNode) -> bool:
        """Give a device-only node a host copy (asynchronous); False if L2 has no room."""
        assert node.device is not None  # only device nodes are backed up
        pages = self._alloc_host(len(node.device))
        if pages is None:
            return False
        self._tree.set_host(node, pages)
        self._issue_backup(node, pages)
        return True

    def write_back(self, node: TreeNode) -> list[int] | None:
        """The tree's L1 eviction hook: copy ``node`` to fresh L2 pages, which the tree then
        attaches to it; None if L2 has no room."""
        assert node.device is not None  # eviction writes back device nodes
        pages = self._alloc_host(len(node.device))
        if pages is None:
            return None
        self._issue_backup(node, pages)
        return pages

    def _issue_backup(self, node: TreeNode, host_pages: list[int]) -> TransferHandle:
        assert node.device is not None  # only device nodes are backed up
        keys = self._tree.page_hashes(node) if self._store is not None else None
        self._tree.lock(node)  # host pages are being written: no eviction until done

        def landed() -> None:
            self._inflight.host_written(host_pages)
            self._tree.unlock(node)
            if keys is not None:
                self.write_storage_pages(keys, host_pages)
                self._tree.set_storage_backed(node, True)

        handle = self._transfers.backup(list(node.device), host_pages, landed)
        self.counts["backed_up_pages"] += handle.num_pages
        self.counts["backed_up_bytes"] += handle.nbytes
        self._inflight.track(handle, writes_host_pages=host_pages)
        return handle

    def storage_write_back(self, node: TreeNode) -> None:
        """L2 eviction is about to drop ``node``: write it to L3 first unless L3 has it."""
        if not node.storage_backed:
            self.write_storage(node)

    def write_storage(self, node: TreeNode) -> None:
        assert node.host is not None  # L3 is written from L2
        self.write_storage_pages(self._tree.page_hashes(node), list(node.host))
        self._tree.set_storage_backed(node, True)

    def write_storage_pages(self, keys: list[bytes], host_pages: list[int]) -> None:
        """Asynchronous L2 -> L3 write of a snapshot of ``host_pages`` under ``keys``."""
        assert self._store is not None  # only called with L3
        self.counts["storage_written_pages"] += len(keys)
        self._store.note_writes(keys)
        self._inflight.wait_host(host_pages)
        handle = self._transfers.write_storage(self._store, keys, host_pages)
        self.counts["storage_written_bytes"] += handle.nbytes
        self._inflight.track(handle)
