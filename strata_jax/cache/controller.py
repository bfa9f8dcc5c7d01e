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

Parts (one job each, composed here): ``transfer_backend.py`` (what moves pages:
``DeviceTransfers`` over real pools, ``SimulatedTransfers`` in virtual time),
``storage_service.py`` (L3 keys, probes, writes, errors), ``prefetch.py`` (L3 -> L2
prefetches), ``inflight.py`` (handles in flight and their completion), ``handles.py``
(handles, completions, errors).  This module: queries, locks, inserts, write and eviction
policy, the link estimate, accounting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from strata_jax.cache.allocator import PageAllocator
from strata_jax.cache.config import CacheConfig
from strata_jax.cache.eviction import Eviction
from strata_jax.cache.handles import (
    CacheError,
    CacheFullError,
    PrefetchHandle,
    TransferHandle,
    TransferTimer,
)
from strata_jax.cache.inflight import InFlight
from strata_jax.cache.local_pages import TreeLocalPages
from strata_jax.cache.prefetch import Prefetcher
from strata_jax.cache.radix_tree import HiRadixTree, InsertResult, PrefixMatch, TreeNode
from strata_jax.cache.sim_transfers import SimulatedTransfers
from strata_jax.cache.storage import StorageBackend, make_storage
from strata_jax.cache.storage_service import StorageService
from strata_jax.cache.transfer_backend import TransferBackend
from strata_jax.cache.windows import LayerWindows, NoWindows
from strata_jax.cache.write_policy import Writes

if TYPE_CHECKING:
    from pallas_kernels.layout import GroupedPoolLayout, KVLayout
    from strata_jax.cache.device_transfers import DeviceTransfers
    from strata_jax.cache.pools import DevicePool

Mover = TypeVar("Mover", bound=TransferBackend)

__all__ = ["CacheController", "CacheError", "CacheFullError", "LinkEstimate", "PrefetchHandle", "TransferHandle"]


class LinkEstimate:
    """L2 -> L1 bandwidth in bytes/s: an EMA over the *service* times of landed loads.

    A load's service time runs from when it could start (issued, and the previous load
    landed: loads share one link, first in first out) to its landing.  Issue-to-landing
    would count the queue in front of it, and a backlog would read as a slow link (the
    scheduler then sees loads as dearer)."""

    def __init__(self, initial_bytes_per_s: float, ema: float) -> None:
        self.bytes_per_s = float(initial_bytes_per_s)
        self.samples = 0
        self._ema = ema
        self._free_at = float("-inf")  # when the last measured load landed

    def measure(self, handle: TransferHandle) -> None:
        if handle.completion.instant:  # landed as issued: says nothing about a link
            return
        end = handle.landed_at if handle.landed_at is not None else handle.completed_at
        if end is None:
            return
        start = max(handle.issued_at, self._free_at)
        self._free_at = max(self._free_at, end)
        elapsed = max(end - start, 1e-9)
        handle.service_seconds = elapsed
        if handle.nbytes > 0:
            sample = handle.nbytes / elapsed
            a = self._ema
            self.bytes_per_s = sample if self.samples == 0 else (1 - a) * self.bytes_per_s + a * sample
            self.samples += 1


class CacheController(Generic[Mover]):
    """Tree + L1/L2 allocators + a transfer backend + the L3 store, and the policy over them.

    Build one with ``on_device`` (moves KV: ``DeviceTransfers``) or ``simulated`` (moves no
    bytes: ``SimulatedTransfers``, the simulator and the no-model benchmarks); the policy
    code is the same over both.

    ``config.kv_tier_format`` (``full``, ``fp8``, ``int8``) is the format of L2 and L3
    (``tier_format.py``): ``page_bytes`` is one page in that format (values and scales),
    which is what a load or backup moves, what L2 holds and what the bandwidth estimate is
    measured in; ``device_page_bytes`` is one L1 page.  With layer groups (sliding-window
    models) the backend's ``local_pages`` says where each page's local-layer KV is: requests
    ``attach_local`` the pages they write and ``pin_local`` their windows, loads move only the
    window a match end needs, and matches end where a window is complete (``tree_window``).
    """

    def __init__(
        self,
        config: CacheConfig,
        transfers: Mover,
        device_alloc: PageAllocator,
        host_alloc: PageAllocator,
        *,
        storage: StorageBackend | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.transfers = transfers
        self.page_bytes = transfers.page_bytes
        self.device_page_bytes = transfers.device_page_bytes
        self.local_pages: TreeLocalPages | None = transfers.local_pages
        self.windows = (
            NoWindows() if self.local_pages is None else LayerWindows(self.local_pages, self.page_size, transfers.flush)
        )
        self._clock = clock
        self.tree = HiRadixTree(config.page_size, config.kv_identity)
        self.tree.local_pages = self.local_pages
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc
        self.store: StorageService | None = None
        if config.has_storage:
            backend = storage if storage is not None else make_storage(config)
            self.store = StorageService(backend, config, transfers.tier_format, clock)
        self.inflight = InFlight(clock, transfers.flush, config.prefetch_policy == "timeout")
        self.link = LinkEstimate(config.initial_bandwidth_bytes_per_s, config.bandwidth_ema)
        self.eviction = Eviction(self.tree, device_alloc, host_alloc, self.inflight, transfers.flush)
        self.writes = Writes(config, self.tree, transfers, self.inflight, self.store, self.eviction.alloc_host)
        write_back = config.write_policy == "write_back" and config.has_host
        self.eviction.hook_writes(self.writes.write_back if write_back else None, self.writes)
        self.prefetcher: Prefetcher | None = None
        if self.store is not None:
            self.prefetcher = Prefetcher(
                config, self.tree, host_alloc, transfers, self.store, self.inflight, self.eviction.alloc_host, clock
            )
        # bytes in the tier format (values + scales): what crossed the link
        self._counts = {"loaded_pages": 0, "loaded_bytes": 0}

    @staticmethod
    def on_device(
        config: CacheConfig,
        layout: KVLayout,
        *,
        storage: StorageBackend | None = None,
        device: Any = None,
        grouped: GroupedPoolLayout | None = None,
        local_window: int = 0,
        host_local_ratio: float = 1.0,
    ) -> CacheController[DeviceTransfers]:
        """A controller that moves KV: an L1 pool on ``device``, an L2 pool in host memory."""
        from strata_jax.cache.device_transfers import DeviceTransfers, host_page_bytes_for

        host_page_bytes, device_page_bytes = host_page_bytes_for(config, layout, grouped, host_local_ratio)
        device_alloc = PageAllocator(config.num_device_pages, "device")
        host_alloc = PageAllocator(config.num_host_pages(host_page_bytes or None, device_page_bytes or None), "host")
        transfers = DeviceTransfers(
            config,
            layout,
            device_alloc,
            host_alloc,
            device=device,
            grouped=grouped,
            local_window=local_window,
            host_local_ratio=host_local_ratio,
        )
        ctl: CacheController[DeviceTransfers] = CacheController(
            config, transfers, device_alloc, host_alloc, storage=storage
        )
        transfers.bind_tree(ctl.tree.iter_nodes)
        return ctl

    @staticmethod
    def simulated(
        config: CacheConfig,
        *,
        page_bytes: int = 0,
        storage: StorageBackend | None = None,
        clock: Callable[[], float] = time.perf_counter,
        timer: TransferTimer | None = None,
    ) -> CacheController[SimulatedTransfers]:
        """A controller that keeps the books and moves no bytes: transfers land at once, or in
        the virtual time of ``timer`` (the simulator); ``page_bytes`` is one page's size."""
        transfers = SimulatedTransfers(page_bytes, clock, timer, config.kv_tier_format)
        device_alloc = PageAllocator(config.num_device_pages, "device")
        host_alloc = PageAllocator(config.num_host_pages(page_bytes or None, page_bytes or None), "host")
        return CacheController(config, transfers, device_alloc, host_alloc, storage=storage, clock=clock)

    # ------------------------------------------------------------------ parts
    @property
    def storage(self) -> StorageBackend | None:
        """The L3 backend (None without L3)."""
        return self.store.backend if self.store is not None else None

    @property
    def device_pool(self) -> DevicePool:
        """The L1 pool (a controller that moves KV only)."""
        from strata_jax.cache.device_transfers import DeviceTransfers

        if not isinstance(self.transfers, DeviceTransfers):
            raise CacheError(f"a controller over {type(self.transfers).__name__} has no device pool")
        return self.transfers.device_pool

    @property
    def counters(self) -> dict[str, int]:
        """Pages and bytes moved, evicted, prefetched; L3 errors and format misses."""
        out = {**self._counts, **self.writes.counts, **self.eviction.counts}
        prefetched = self.prefetcher.counts if self.prefetcher is not None else {}
        out["prefetched_pages"] = prefetched.get("prefetched_pages", 0)
        out["prefetched_bytes"] = prefetched.get("prefetched_bytes", 0)
        out["storage_errors"] = self.store.errors if self.store is not None else 0
        out["storage_format_misses"] = self.store.format_misses if self.store is not None else 0
        return out

    # ------------------------------------------------------------------ queries
    def match_prefix(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        *,
        requester: Hashable | None = None,
        touch: bool = True,
        hint: PrefixMatch | InsertResult | None = None,
    ) -> PrefixMatch:
        """Tree match plus the L3 pages the store holds right after the tree's data prefix.

        ``storage_tokens`` counts consecutive store hits (``batch_exists`` on the hash chain)
        starting at ``device_tokens + host_tokens``; the transient part is then counted beyond
        it.  ``hint``: an earlier match of the same tokens object (``HiRadixTree.match_prefix``).
        With ``touch``, hot nodes are backed up under ``write_through_selective``.
        """
        m = self.tree.match_prefix(tokens, namespace, requester=requester, touch=touch, hint=hint)
        if touch:
            self.writes.back_up_hot(m.last_node)
        if self.store is None:
            return m
        ps = self.page_size
        start = (m.device_tokens + m.host_tokens) // ps
        total = len(tokens) // ps
        if total <= start:
            return m
        keys = self.store.chain_keys(self.tree.last_hash(m.last_node), tokens[start * ps : total * ps])
        hits = self.store.hits(keys)
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
        return self.link.bytes_per_s

    @property
    def storage_read_bandwidth(self) -> float | None:
        """L3 -> L2 bytes per second measured on prefetches; None before the first (or without L3)."""
        return self.store.read_bandwidth if self.store is not None else None

    def free_device_tokens(self) -> int:
        return self.device_alloc.num_free * self.page_size

    def evictable_device_tokens(self) -> int:
        """Device tokens ``evict_device`` can free now (every unlocked device node)."""
        return self.tree.evictable_device_pages() * self.page_size

    def load_pending(self, request_id: Hashable) -> bool:
        """True while a load or prefetch issued for ``request_id`` has not landed."""
        return self.inflight.pending_for(request_id)

    def page_table(self, tokens: Sequence[int], namespace: str = "") -> list[int]:
        """L1 page ids of the cached device prefix of ``tokens`` (lock first if you keep using them)."""
        return list(self.tree.match_prefix(tokens, namespace, touch=False).device_page_ids)

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
        if self.prefetcher is not None:
            self.prefetcher.cancel_all(owner)
        return self.tree.remove_transient(owner)

    def finish_request(self, owner: Hashable) -> int:
        """A request ended normally: drop transient nodes it still owns (tokens it never computed)."""
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

        Same as ``insert`` (duplicate pages are freed at once), then locks the new deepest
        node and unlocks ``locked``.  Returns ``(new_lock, page_table)``: the request must
        switch the full-page part of its page table to ``page_table`` before its next step
        (its own duplicates are gone).
        """
        node = self.insert(tokens, namespace, device_pages, hint=hint).last_node
        assert node is not None  # an insert of full pages ends at a node
        self.tree.lock(node)
        self.tree.unlock(locked)
        return node, self.tree.device_pages_of(node)

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

        so the caller owns none of ``device_pages`` afterwards (a partial last page beyond
        the full pages is the caller's to free).  Under ``write_through`` the new device-only
        nodes are backed up to L2 (and L3).
        """
        res = self.tree.insert(tokens, namespace, device_pages=device_pages, hint=hint)
        if res.unused_pages:
            assert res.last_node is not None  # an insert of full pages ends at a node
            self.windows.moved_duplicates(device_pages, self.tree.device_pages_of(res.last_node))
            self.device_alloc.free(res.unused_pages)
        assert res.last_node is not None  # the deepest node of the path (all of it on the device now)
        self.writes.write_through(res.last_node)
        return res

    # ------------------------------------------------------------------ local-layer KV (layer groups)
    def attach_local(self, pages: Sequence[int]) -> None:
        """Device ``pages`` will hold their local-layer KV (``LayerWindows.attach``)."""
        self.windows.attach(pages)

    def pin_local(self, owner: Hashable, page_table: Sequence[int], next_position: int) -> None:
        """``owner``'s window from ``next_position`` on stays on the device (``LayerWindows.pin``)."""
        self.windows.pin(owner, page_table, next_position)

    def unpin_local(self, owner: Hashable) -> None:
        self.windows.unpin(owner)

    def new_request_room(self, step_tokens: int) -> int | None:
        """Requests that may start now for the local-layer pages (None without layer groups)."""
        return self.windows.new_request_room(step_tokens)

    def complete_window_end(self, pages: Sequence[int], end: int) -> int:
        """Where a prefix of the device ``pages`` may end: its window's local KV is on the device."""
        return self.windows.complete_end(pages, end)

    def device_kv_bytes(self, owner: Hashable, page_table: Sequence[int]) -> int:
        """L1 KV bytes a running request holds: its pages' global layers, plus the local layers
        of the pages its window pins (every layer of every page without layer groups)."""
        return self.transfers.device_kv_bytes(len(page_table), self.windows.pinned(owner))

    # ------------------------------------------------------------------ L1 <-> L2
    def load(
        self, match: PrefixMatch, request_id: Hashable | None = None, use_tokens: int | None = None
    ) -> TransferHandle | None:
        """Bring the host-only nodes on the path to ``match.last_node`` into L1.

        ``use_tokens``: where the caller's prefix will end if before the match's end (a
        scheduler recomputing the last page): with layer groups, the local-layer KV loaded
        is that end's window.  The caller must hold a lock on ``match.last_node`` (allocation
        may evict).  On return the nodes carry their device pages and any later step reading
        the pool sees the data (JAX data flow); the handle reports when the link transfer
        landed.  ``None``: nothing to load.
        """
        nodes = self.tree.host_only_path(match.last_node)
        if not nodes:
            return None
        if match.last_node.lock_ref <= 0:
            raise CacheError("lock match.last_node before load()")
        host_pages = [p for x in nodes for p in (x.host or ())]
        n = len(host_pages)
        dev_pages = self.alloc_device(n)
        first = len(self.tree.device_pages_of(match.last_node))  # the path's page of host_pages[0]
        end = first + n if use_tokens is None else min(first + n, use_tokens // self.page_size)
        with_local = self.windows.load_mask(first, end, host_pages)
        if with_local is not None:
            try:
                self.attach_local([d for d, keep in zip(dev_pages, with_local, strict=True) if keep])
            except CacheFullError:
                self.device_alloc.free(dev_pages)
                raise
        self.inflight.wait_host(host_pages)
        handle = self.transfers.load(host_pages, dev_pages, with_local, request_id, self.link.measure)
        self.inflight.track(handle)
        off = 0
        for x in nodes:
            k = len(x.host or ())
            self.tree.set_device(x, dev_pages[off : off + k])
            off += k
        self._counts["loaded_pages"] += n
        self._counts["loaded_bytes"] += handle.nbytes
        return handle

    # ------------------------------------------------------------------ completion
    def flush_backups(self) -> None:
        """Dispatch the backups issued this step (their device gathers go out together)."""
        self.transfers.flush()

    def poll(self) -> list[TransferHandle]:
        """Complete every finished transfer (bookkeeping, bandwidth); returns them.

        A prefetch counts as complete when all its pages landed (or its timeout passed);
        it still needs ``finish_prefetch`` to join the tree.
        """
        return self.inflight.poll()

    def is_ready(self, handle: TransferHandle | None) -> bool:
        """Has this transfer landed (completing it if so)?  ``None`` counts as ready."""
        return self.inflight.is_ready(handle)

    def wait(self, handle: TransferHandle | None) -> None:
        """Block until ``handle`` landed."""
        self.inflight.wait(handle)

    def drain(self) -> None:
        """Wait for every in-flight transfer (prefetches excluded: finish or cancel them)."""
        self.inflight.drain()

    def next_landing(self) -> float | None:
        """Earliest stamped landing time of a transfer still in flight (simulated runs know it ahead)."""
        return self.inflight.next_landing()

    def warmup_transfers(self) -> int:
        """Compile the L1 pool's load and backup programs now (none without L2); returns compiles."""
        return self.transfers.warmup()

    # ------------------------------------------------------------------ allocation and eviction
    def alloc_device(self, n: int) -> list[int]:
        """``n`` L1 pages, evicting as needed; ``CacheFullError`` when locked data leaves too little room."""
        return self.eviction.alloc_device(n)

    def free_device(self, pages: Sequence[int]) -> None:
        """Return caller-owned L1 pages (e.g. an aborted request's new pages)."""
        self.eviction.free_device(pages)

    def evict_device(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L1 pages if possible; returns pages freed."""
        return self.eviction.evict_device(num_pages)

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` L2 pages if possible (L3 write-back first where due); returns pages freed."""
        return self.eviction.evict_host(num_pages)

    def flush(self, scope: Callable[[str], bool] | None = None) -> None:
        """Drop every unlocked cached page from L1 and L2 (storage is left alone); ``scope``:
        only those of the namespaces it accepts."""
        self.eviction.drop_unlocked(scope)

    # ------------------------------------------------------------------ L3
    def prefetch(
        self, tokens: Sequence[int], namespace: str, match: PrefixMatch, request_id: Hashable | None = None
    ) -> PrefetchHandle | None:
        """Start fetching ``match.storage_tokens`` from L3 into L2 (``Prefetcher.start``); None without L3."""
        if self.prefetcher is None:
            return None
        return self.prefetcher.start(tokens, namespace, match, request_id)

    def prefetch_progress(self, request_id: Hashable) -> tuple[int, int, float] | None:
        """``request_id``'s prefetch still in flight: (tokens landed, tokens in all, seconds since issue)."""
        return self.prefetcher.progress(request_id) if self.prefetcher is not None else None

    def finish_prefetch(self, handle: PrefetchHandle) -> int:
        """Stop policy, then the landed pages join the tree (``Prefetcher.finish``); returns tokens landed."""
        assert self.prefetcher is not None  # a handle comes from prefetch()
        return self.prefetcher.finish(handle)

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        """Stop a prefetch and drop everything it fetched."""
        assert self.prefetcher is not None  # a handle comes from prefetch()
        self.prefetcher.cancel(handle)

    def clear_storage(self) -> None:
        """Delete every L3 object (of this store's prefix) and forget what probes saw."""
        if self.store is None:
            return
        self.store.clear()
        for node in list(self.tree.iter_nodes()):
            self.tree.set_storage_backed(node, False)

    # ------------------------------------------------------------------ accounting
    def check(self, device_held: Sequence[int] = ()) -> None:
        """Assert tree invariants and exact page accounting (``device_held``: pages callers own)."""
        reserved = sorted(self.prefetcher.reserved) if self.prefetcher is not None else []
        self.tree.check(
            device_free=self.device_alloc.free_pages(),
            device_total=self.device_alloc.num_pages,
            host_free=self.host_alloc.free_pages(),
            host_total=self.host_alloc.num_pages,
            device_reserved=device_held,
            host_reserved=reserved,
        )
        device_free = set(self.device_alloc.free_pages())
        host_free = set(self.host_alloc.free_pages())
        self.transfers.check(
            [p for p in range(self.device_alloc.num_pages) if p not in device_free],
            [p for p in range(self.host_alloc.num_pages) if p not in host_free],
        )

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device_pages": self.device_alloc.num_pages,
            "device_free_pages": self.device_alloc.num_free,
            "host_pages": self.host_alloc.num_pages,
            "host_free_pages": self.host_alloc.num_free,
            "link_bandwidth_bytes_per_s": self.link.bytes_per_s,
            "pending_transfers": len(self.inflight),
            **self.counters,
            **self.bytes_per_token(),
        }
        if self.store is not None:
            try:
                storage = self.store.backend.stats()
                out["storage"] = storage.__dict__
                if storage.objects > 0 and storage.bytes >= 0:  # (Redis does not count bytes)
                    out["storage_bytes_per_token"] = storage.bytes / (storage.objects * self.page_size)
            except Exception as exc:  # noqa: BLE001 - stats must not fail because L3 is down
                self.store.failed("stats", exc)
                out["storage"] = None
        return out

    def bytes_per_token(self) -> dict[str, Any]:
        """KV bytes per token from the pools' and transfers' own counts (the tier format's).

        ``device``: one L1 token; ``host``: one L2 token (values + scales); ``load``: bytes
        moved per token loaded L2 -> L1 so far (None before the first load); ``backup``: the
        same for L1 -> L2.  ``stats()`` adds ``storage_bytes_per_token`` (objects with their
        framing, from the backend's byte count)."""
        ps = self.page_size
        # the L1 pool's own count of what it moved when there is one, else the controller's (simulated)
        c = self.transfers.moved() or self.counters
        return {
            "tier_format": self.transfers.tier_format_name,
            "device_bytes_per_token": self.device_page_bytes / ps,
            "host_bytes_per_token": self.transfers.host_page_bytes() / ps,
            "load_bytes_per_token": c["loaded_bytes"] / (c["loaded_pages"] * ps) if c["loaded_pages"] else None,
            "backup_bytes_per_token": c["backed_up_bytes"] / (c["backed_up_pages"] * ps)
            if c["backed_up_pages"]
            else None,
        }

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel_all()
        self.drain()
        self.transfers.close()
        if self.store is not None:
            self.store.close()
