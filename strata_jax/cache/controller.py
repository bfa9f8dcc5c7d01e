"""CacheController: owns the pools, the allocators, the tree and every transfer between tiers.

One object per engine; called from the engine thread only (storage I/O runs in
its worker threads, which touch nothing but the storage backend, the host pool
pages reserved for them and their handle).

Engine protocol (one request)::

    m = ctl.match_prefix(prompt, ns, requester=rid)   # device/host/storage/transient tokens
    ctl.lock(m.last_node)                              # before anything that may evict
    pf = ctl.prefetch(prompt, ns, m, rid)              # L3 -> L2, asynchronous (or None)
    ...                                                # scheduler waits on ctl.is_ready(pf) / load_pending(rid)
    ctl.finish_prefetch(pf)                            # stop policy; landed pages join the tree
    m = ctl.match_prefix(prompt, ns, requester=rid); ctl.lock(m.last_node); ctl.unlock(old)
    h = ctl.load(m, rid)                               # L2 -> L1: one device_put + scatter
    page_table = ctl.tree.device_pages_of(m.last_node) + ctl.alloc_device(n_new_pages)
    ctl.insert_transient(prompt, ns, rid); ctl.mark_in_flight(rid); ...run...
    ctl.insert(prompt_and_output, ns, page_table)      # adopts pages, frees duplicates, backs up
    ctl.unlock(m.last_node)

Completion is poll-based: ``poll()`` completes finished transfers and returns
them; ``is_ready(handle)`` asks about one; ``load_pending(rid)`` about a request.

Slot safety ("no page slot reused while a transfer into or out of it is in
flight"):

* device pages: a gather out of them is dispatched before any later writer of
  the donated pool, so JAX's data flow orders it; they may be freed right away;
* host pages being *written* by a backup are attached to a node that stays
  locked until the copy completes, and any reader first waits for that copy
  (``_host_pending``); host pages being written by a prefetch belong to the
  prefetch handle until ``finish_prefetch``/``cancel_prefetch`` has stopped the
  worker; reads for loads and storage writes copy into fresh buffers.

Files (one job each): this module (queries, locks, inserts, accounting),
``transfers.py`` (L1<->L2 copies, handle completion), ``storage_io.py`` (L3
probes, writes, prefetch), ``eviction.py`` (allocation, per-tier eviction),
``handles.py`` (transfer handles, errors).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from strata_jax.cache.allocator import PageAllocator
from strata_jax.cache.config import CacheConfig
from strata_jax.cache.eviction import Eviction
from strata_jax.cache.handles import CacheError, CacheFullError, PrefetchHandle, TransferHandle, TransferTimer
from strata_jax.cache.host_grouped import GroupedHostPool, grouped_host_page_bytes
from strata_jax.cache.local_pages import DeviceLocalPages, LocalPagesFull, TreeLocalPages, first_needed_page
from strata_jax.cache.radix_tree import HiRadixTree, InsertResult, PrefixMatch, TreeNode
from strata_jax.cache.storage import StorageBackend, make_storage
from strata_jax.cache.storage_io import StorageIO
from strata_jax.cache.tier_format import TierFormat
from strata_jax.cache.transfers import Transfers

if TYPE_CHECKING:
    from pallas_kernels.layout import GroupedPoolLayout, KVLayout

__all__ = ["CacheController", "CacheError", "CacheFullError", "PrefetchHandle", "TransferHandle"]


class CacheController(Transfers, StorageIO, Eviction):
    """Tree + L1/L2 pools + L3 backend + transfers between them.

    ``layout=None`` (or ``move_data=False``) gives a bookkeeping-only controller
    (no arrays; transfers complete at once; storage objects have empty payloads):
    the no-model benchmarks and the simulator use it with the same policies.
    With a ``timer`` (``TransferTimer``) its transfers land in virtual time instead
    of at once (loads, backups and prefetches; the simulator), and ``page_bytes``
    gives the size of a page it has no layout for (in L2 and on the link: the tier
    format's).

    ``config.kv_tier_format`` (``full``, ``fp8``, ``int8``) is the format of L2 and L3
    (``tier_format.py``): ``page_bytes`` is one page in that format (values and
    scales), which is what a load or backup moves, what L2 holds and what the
    bandwidth estimate is measured in; ``device_page_bytes`` is one L1 page.
    ``grouped``: the L1 pool has layer groups (``DevicePool``); ``local_window``: the
    sliding window of its local layers.  Their KV is then trimmed lazily
    (``local_pages.DeviceLocalPages``: requests ``attach_local`` the pages they write and
    ``pin_local`` their windows), L2 is a ``GroupedHostPool`` whose local-layer pages are
    ``host_local_ratio`` of its pages (so it holds more pages for the same bytes), loads
    move only the window a match end needs, and matches end where a window is complete
    (``tree_window``).
    """

    def __init__(
        self,
        config: CacheConfig,
        layout: KVLayout | None = None,
        *,
        storage: StorageBackend | None = None,
        move_data: bool | None = None,
        device: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        timer: TransferTimer | None = None,
        page_bytes: int | None = None,
        grouped: GroupedPoolLayout | None = None,
        local_window: int = 0,
        host_local_ratio: float = 1.0,
    ) -> None:
        self.config = config
        self.layout = layout
        self.move_data = layout is not None if move_data is None else move_data
        if self.move_data and layout is None:
            raise CacheError("move_data=True needs a KVLayout")
        if layout is not None and layout.page_size != config.page_size:
            raise CacheError(f"layout page_size {layout.page_size} != config page_size {config.page_size}")
        self.page_size = config.page_size
        # L2/L3 format (None without a layout: a bookkeeping controller moves no bytes, page_bytes says how many)
        self.tier_format = TierFormat.resolve(config.kv_tier_format, layout.dtype) if layout is not None else None
        self.device_page_bytes = layout.page_bytes if layout is not None else (page_bytes or 0)
        self.page_bytes = self.tier_format.page_bytes(layout) if layout is not None else (page_bytes or 0)
        self._clock = clock
        if timer is not None and self.move_data:
            raise CacheError("a TransferTimer is for bookkeeping-only controllers (move_data=False)")
        self._timer = timer
        self.tree = HiRadixTree(config.page_size, config.kv_identity)
        self.device_alloc = PageAllocator(config.num_device_pages, "device")
        windowed = self.move_data and grouped is not None and any(grouped.local_layers)
        host_page_bytes = self.page_bytes or None
        if windowed and host_page_bytes:  # L2 with layer groups: a page holds a share of the local layers' KV
            host_page_bytes = max(
                1, int(grouped_host_page_bytes(self.page_bytes, grouped.local_share, host_local_ratio))
            )  # type: ignore[union-attr]
        self.host_alloc = PageAllocator(config.num_host_pages(host_page_bytes, self.device_page_bytes or None), "host")
        self.device_pool = None
        self.host_pool = None
        self.local_pages: TreeLocalPages | None = None  # a pool with layer groups: where local KV is
        if self.move_data:
            from strata_jax.cache.pools import DevicePool, HostPool

            self.device_pool = DevicePool(
                layout,
                self.device_alloc.num_pages,
                device,
                kernel_backend=config.kernel_backend,  # type: ignore[arg-type]
                tier_format=self.tier_format,
                grouped=grouped,
            )
            if self.device_pool.local is not None:  # local-layer pages go back with their device pages
                self.device_alloc.listener = self.device_pool.local
            if windowed:
                if local_window <= 0:
                    raise CacheError("a pool with sliding-window layers needs their window (local_window)")
                host_local = DeviceLocalPages(0, 0)  # no L2: no host page has local KV
                if self.host_alloc.num_pages:
                    self.host_pool = GroupedHostPool(
                        layout,
                        self.host_alloc.num_pages,
                        self.tier_format,
                        grouped.local_layers,
                        host_local_ratio,  # type: ignore[arg-type]
                    )
                    self.host_alloc.listener = self.host_pool
                    host_local = self.host_pool.local
                self.local_pages = TreeLocalPages(local_window, self.page_size, self.device_pool.local, host_local)  # type: ignore[arg-type]
                self.tree.local_pages = self.local_pages
            if self.host_alloc.num_pages and self.host_pool is None:
                self.host_pool = HostPool(layout, self.host_alloc.num_pages, self.tier_format)  # type: ignore[arg-type]
        self.storage: StorageBackend | None = None
        if config.has_storage:
            self.storage = storage if storage is not None else make_storage(config)
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-io") if self.move_data else None
        # Stamps when each load lands, so the bandwidth estimate does not depend on how
        # late the engine polls (a long step in between once made it read low).
        self._watcher = ThreadPoolExecutor(1, thread_name_prefix="kv-watch") if self.move_data else None
        self._pending: list[TransferHandle] = []
        self._host_pending: dict[int, TransferHandle] = {}
        # backups issued, their device gathers not dispatched yet (transfers.flush_backups)
        self._backup_queue: list[tuple[TransferHandle, TreeNode, list[int], list[int], list | None]] = []
        self._prefetch_reserved: set[int] = set()
        self._key_memo: dict[tuple[bytes, tuple[int, ...]], list[bytes]] = {}
        self._key_memo_tokens = 0
        self._probe_memo: dict[tuple[bytes, bytes], tuple[int, float]] = {}  # (first, last key) -> (hits, when)
        self._recent_writes: dict[bytes, float] = {}  # keys this instance wrote to L3 lately
        self._storage_read_bps: float | None = None  # measured on prefetches (storage_io)
        self._bandwidth = float(config.initial_bandwidth_bytes_per_s)
        self._bandwidth_samples = 0
        self._link_free_at = float("-inf")  # when the last measured load landed
        self.counters = {
            "loaded_pages": 0,
            "backed_up_pages": 0,
            "storage_written_pages": 0,
            "prefetched_pages": 0,
            "evicted_device_pages": 0,
            "evicted_host_pages": 0,
            "storage_errors": 0,  # L3 reads/writes that raised (served as misses / not written)
            "storage_format_misses": 0,  # L3 objects of another format / shape / length: misses, never decoded
            # bytes in the tier format (values + scales): what crossed the link / went to or came from L3
            "loaded_bytes": 0,
            "backed_up_bytes": 0,
            "storage_written_bytes": 0,
            "prefetched_bytes": 0,
        }
        self._last_error_log = float("-inf")

    @classmethod
    def on_device(
        cls,
        config: CacheConfig,
        layout: KVLayout,
        *,
        storage: StorageBackend | None = None,
        device: Any = None,
        grouped: GroupedPoolLayout | None = None,
        local_window: int = 0,
        host_local_ratio: float = 1.0,
    ) -> CacheController:
        """A controller that moves KV: an L1 pool on ``device``, an L2 pool in host memory."""
        return cls(
            config,
            layout,
            storage=storage,
            device=device,
            grouped=grouped,
            local_window=local_window,
            host_local_ratio=host_local_ratio,
        )

    @classmethod
    def simulated(
        cls,
        config: CacheConfig,
        *,
        page_bytes: int = 0,
        storage: StorageBackend | None = None,
        clock: Callable[[], float] = time.perf_counter,
        timer: TransferTimer | None = None,
    ) -> CacheController:
        """A controller that keeps the books and moves no bytes: transfers land at once, or in
        the virtual time of ``timer`` (the simulator); ``page_bytes`` is one page's size."""
        return cls(config, None, storage=storage, clock=clock, timer=timer, page_bytes=page_bytes)

    # ------------------------------------------------------------------ queries
    def match_prefix(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        *,
        requester: Hashable | None = None,
        touch: bool = True,
        hint: PrefixMatch | None = None,
    ) -> PrefixMatch:
        """Tree match plus the L3 pages the backend holds right after the tree's data prefix.

        ``storage_tokens`` counts consecutive backend hits (``batch_exists`` on the
        hash chain) starting at ``device_tokens + host_tokens``; the transient part
        is then counted beyond it.  With ``touch`` and ``write_through_selective``
        nodes reaching the hit threshold are backed up to L2 here.  ``hint``: an
        earlier match of the same tokens object (``HiRadixTree.match_prefix``).
        """
        m = self.tree.match_prefix(tokens, namespace, requester=requester, touch=touch, hint=hint)
        if touch and self.config.write_policy == "write_through_selective" and self.config.has_host:
            node = m.last_node
            path = []
            while node.parent is not None:
                if (
                    node.device is not None
                    and node.host is None
                    and node.hit_count >= self.config.write_through_threshold
                ):
                    path.append(node)
                node = node.parent
            for node in reversed(path):
                if not self._back_up(node):
                    break
        if self.storage is None:
            return m
        ps = self.page_size
        start = (m.device_tokens + m.host_tokens) // ps
        total = len(tokens) // ps
        if total <= start:
            return m
        keys = self._chain_keys(self.tree.last_hash(m.last_node), tokens[start * ps : total * ps])
        hits = self._storage_hits(keys)
        storage_tokens = hits * ps
        transient = max(0, m.transient_tokens - storage_tokens)
        return replace(
            m,
            storage_tokens=storage_tokens,
            transient_tokens=transient,
            transient_owners=m.transient_owners if transient else (),
            storage_keys=tuple(keys[:hits]),
        )

    @property
    def link_bandwidth(self) -> float:
        """Estimated L2->L1 bandwidth in bytes/s: EMA over completed loads (initial value until then)."""
        return self._bandwidth

    def free_device_tokens(self) -> int:
        return self.device_alloc.num_free * self.page_size

    def evictable_device_tokens(self) -> int:
        """Device tokens ``evict_device`` can free now (every unlocked device node)."""
        return self.tree.evictable_device_pages() * self.page_size

    def load_pending(self, request_id: Hashable) -> bool:
        """True while a load or prefetch issued for ``request_id`` has not landed."""
        return any(not h.done and h.request_id == request_id and not self._finished(h) for h in self._pending)

    # ------------------------------------------------------------------ locks and tree life cycle
    def lock(self, node: TreeNode) -> None:
        self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def insert_transient(self, tokens: Sequence[int], namespace: str, owner: Hashable) -> InsertResult:
        return self.tree.insert(tokens, namespace, owner=owner)

    def mark_in_flight(self, owner: Hashable) -> int:
        return self.tree.mark_in_flight(owner)

    def abort(self, owner: Hashable) -> int:
        """Remove ``owner``'s transient nodes and cancel its prefetches; returns tokens removed."""
        for h in list(self._pending):
            if isinstance(h, PrefetchHandle) and h.request_id == owner and not h.finished:
                self.cancel_prefetch(h)
        return self.tree.remove_transient(owner)

    def cache_unfinished(
        self,
        tokens: Sequence[int],
        namespace: str,
        device_pages: Sequence[int],
        locked: TreeNode,
        hint: PrefixMatch | InsertResult | None = None,
    ) -> tuple[TreeNode, list[int]]:
        """Insert a still-running request's computed KV and move its lock down.

        Same as ``insert`` (duplicate pages are freed at once), then locks the new
        deepest node and unlocks ``locked``.  Returns ``(new_lock, page_table)``:
        the request must switch the full-page part of its page table to
        ``page_table`` before its next step (its own duplicates are gone).
        """
        node = self.insert(tokens, namespace, device_pages, hint=hint).last_node
        assert node is not None
        self.tree.lock(node)
        self.tree.unlock(locked)
        return node, self.tree.device_pages_of(node)

    # ------------------------------------------------------------------ local-layer KV (layer groups)
    def attach_local(self, pages: Sequence[int]) -> None:
        """Device ``pages`` will hold their local-layer KV (a step writes it, a load brings it):
        give them local pages, trimming unpinned ones if none is free.  Raises
        ``CacheFullError`` when the running requests' windows pin every other one."""
        if self.local_pages is None:
            return
        self.flush_backups()  # a queued backup reads the local pages its page had when issued
        try:
            self.local_pages.device.attach(pages)
        except LocalPagesFull as exc:
            raise CacheFullError(str(exc)) from None

    def pin_local(self, owner: Hashable, page_table: Sequence[int], next_position: int) -> None:
        """``owner``'s next token is at ``next_position``: it still reads the local KV of the
        pages of ``page_table`` from ``first_needed_page`` on; the rest becomes evictable.
        One page more is kept: the window of the page boundary before the last one, where a
        repeat of a fully cached prompt resumes (the scheduler recomputes its last page)."""
        if self.local_pages is None:
            return
        first = first_needed_page(max(0, next_position - self.page_size), self.local_pages.window, self.page_size)
        self.local_pages.device.pin(owner, page_table[first:])

    def unpin_local(self, owner: Hashable) -> None:
        if self.local_pages is not None:
            self.local_pages.device.unpin(owner)

    def new_request_room(self, step_tokens: int) -> int | None:
        """Requests that may start running now for the local-layer pages (layer groups; None
        without): each pins its window plus the page it writes (``window_pages + 2``), after
        room for one prefill step of ``step_tokens``; 1 when no page is pinned (the engine
        refuses a ratio too small for one request's window and chunk)."""
        if self.local_pages is None:
            return None
        local = self.local_pages.device
        room = max(0, (local.room - -(-step_tokens // self.page_size)) // (self.local_pages.window_pages + 2))
        return max(room, 1) if local.pinned_pages == 0 else room

    def device_kv_bytes(self, owner: Hashable, page_table: Sequence[int]) -> int:
        """L1 KV bytes a running request holds: its pages' global layers, plus the local layers
        of the pages its window pins (every layer of every page without layer groups)."""
        pages = len(page_table)
        grouped = self.device_pool.grouped if self.device_pool is not None else None
        if grouped is None or self.local_pages is None:
            return pages * self.device_page_bytes
        layer_page = self.device_page_bytes // len(grouped.local_layers)
        local = sum(grouped.local_layers)
        return layer_page * (
            pages * (len(grouped.local_layers) - local) + self.local_pages.device.pinned(owner) * local
        )

    def complete_window_end(self, pages: Sequence[int], end: int) -> int:
        """The largest ``e <= end`` whose window (the ``window_pages`` before it) has its local
        KV on the device: where a prefix of the device ``pages`` may end (``end`` without layer groups)."""
        if self.local_pages is None:
            return end
        w, has = self.local_pages.window_pages, self.local_pages.on_device
        e = end
        while e > 0 and not all(has(p) for p in pages[max(0, e - w) : e]):
            e -= 1
        return e

    def page_table(self, tokens: Sequence[int], namespace: str = "") -> list[int]:
        """L1 page ids of the cached device prefix of ``tokens`` (lock first if you keep using them)."""
        return list(self.tree.match_prefix(tokens, namespace, touch=False).device_page_ids)

    def finish_request(self, owner: Hashable) -> int:
        """A request ended normally: drop transient nodes it still owns (tokens it never computed)."""
        return self.tree.remove_transient(owner)

    def insert(
        self,
        tokens: Sequence[int],
        namespace: str,
        device_pages: Sequence[int],
        hint: PrefixMatch | InsertResult | None = None,
    ) -> InsertResult:
        """Computed KV of ``tokens`` (full pages) sits in ``device_pages``: hand it to the tree.

        Ownership of the request's page table after this call::

            |<- pages the tree already had ->|<- pages adopted by the tree ->|
              caller's ids equal the tree's     now owned by the tree
              (or duplicates: freed here)

        so the caller owns none of ``device_pages`` afterwards (a partial last
        page beyond the full pages is the caller's to free).  Under
        ``write_through`` the new device-only nodes are backed up to L2 (and L3).
        """
        res = self.tree.insert(tokens, namespace, device_pages=device_pages, hint=hint)  # hint: tree.insert
        if res.unused_pages:
            if self.local_pages is not None:  # a duplicate's local KV goes to the tree's page if it has none
                assert res.last_node is not None
                for mine, kept in zip(device_pages, self.tree.device_pages_of(res.last_node)):
                    if mine != kept:
                        self.local_pages.device.move(mine, kept)
            self.device_alloc.free(res.unused_pages)
        if self.config.write_policy == "write_through" and self.config.has_host:
            last = res.last_node  # the deepest node of the path (all of it on the device now)
            assert last is not None
            path = []
            while last.parent is not None:
                path.append(last)
                last = last.parent
            for node in reversed(path):
                if node.device is not None and node.host is None:
                    if not self._back_up(node):
                        break
                elif node.host is not None and self.storage is not None and not node.storage_backed:
                    self._write_storage(node)
        return res

    def check(self, device_held: Sequence[int] = ()) -> None:
        """Assert tree invariants and exact page accounting (``device_held``: pages callers own)."""
        self.tree.check(
            device_free=self.device_alloc.free_pages(),
            device_total=self.device_alloc.num_pages,
            host_free=self.host_alloc.free_pages(),
            host_total=self.host_alloc.num_pages,
            device_reserved=device_held,
            host_reserved=sorted(self._prefetch_reserved),
        )
        if self.device_pool is not None and self.device_pool.local is not None:
            free = set(self.device_alloc.free_pages())
            self.device_pool.local.check(p for p in range(self.device_alloc.num_pages) if p not in free)
        if isinstance(self.host_pool, GroupedHostPool):
            free = set(self.host_alloc.free_pages())
            self.host_pool.check([p for p in range(self.host_alloc.num_pages) if p not in free])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device_pages": self.device_alloc.num_pages,
            "device_free_pages": self.device_alloc.num_free,
            "host_pages": self.host_alloc.num_pages,
            "host_free_pages": self.host_alloc.num_free,
            "link_bandwidth_bytes_per_s": self._bandwidth,
            "pending_transfers": len(self._pending),
            **self.counters,
            **self.bytes_per_token(),
        }
        if self.storage is not None:
            try:
                storage = self.storage.stats()
                out["storage"] = storage.__dict__
                if storage.objects > 0 and storage.bytes >= 0:  # (Redis does not count bytes)
                    out["storage_bytes_per_token"] = storage.bytes / (storage.objects * self.page_size)
            except Exception as exc:  # noqa: BLE001 - stats must not fail because L3 is down
                self._storage_failed("stats", exc)
                out["storage"] = None
        return out

    def bytes_per_token(self) -> dict[str, Any]:
        """KV bytes per token from the pools' and transfers' own counts (the tier format's).

        ``device``: one L1 token; ``host``: one L2 token (``HostPool``: values + scales);
        ``load``: bytes moved per token loaded L2 -> L1 so far (None before the first load);
        ``backup``: the same for L1 -> L2.  ``stats()`` adds ``storage_bytes_per_token``
        (objects with their framing, from the backend's byte count)."""
        ps = self.page_size
        # the L1 pool's own count of what it moved when there is one, else the controller's (simulated)
        c = self.device_pool.moved if self.device_pool is not None else self.counters
        host = self.host_pool.page_bytes / ps if self.host_pool is not None else self.page_bytes / ps
        return {
            "tier_format": self.tier_format.name if self.tier_format is not None else self.config.kv_tier_format,
            "device_bytes_per_token": self.device_page_bytes / ps,
            "host_bytes_per_token": host,
            "load_bytes_per_token": c["loaded_bytes"] / (c["loaded_pages"] * ps) if c["loaded_pages"] else None,
            "backup_bytes_per_token": c["backed_up_bytes"] / (c["backed_up_pages"] * ps)
            if c["backed_up_pages"]
            else None,
        }

    def close(self) -> None:
        for h in list(self._pending):
            if isinstance(h, PrefetchHandle):
                self.cancel_prefetch(h)
        self.drain()
        if self._watcher is not None:
            self._watcher.shutdown(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()
