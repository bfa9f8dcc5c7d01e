"""Transfers that move KV: the L1 pool on the device, the L2 pool in host memory, L3 I/O threads.

``DeviceTransfers`` is the ``TransferBackend`` of a serving controller.  Contract:

* ``load``: one ``device_put`` per staging chunk of L2 pages, scattered into the L1 pool
  (``DevicePool.load_from_host``); a later step reading the pool is ordered after it by
  JAX data flow; a watcher thread stamps when it landed, so the bandwidth estimate does
  not depend on how late the engine polls.
* ``backup``: queued; the device gathers of the backups issued during a step go out
  together at ``flush`` (one coalesced gather per chunk of pages): fifty backups of one
  step were fifty small programs queued behind it, and XLA:CPU admits 32 in flight and
  then blocks the engine thread until the step ends.  A backup lands when its chunks are
  on the host; its rows are written into L2 as it settles.
* ``write_storage`` / ``start_prefetch``: on the I/O threads, which touch only the
  backend (through ``StorageService``), the host pages reserved for them and their handle.
* L2 and L3 hold the tier format (``tier_format.py``): an L3 object is a page header
  naming the format, then the values (and scales); a read whose header, length or scales
  do not match is a miss (``StorageService.format_miss``), never decoded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from strata_jax.cache.allocator import PageAllocator
from strata_jax.cache.config import CacheConfig
from strata_jax.cache.handles import (
    ArraysReady,
    CacheError,
    Completion,
    Deferred,
    FutureDone,
    PrefetchHandle,
    TransferHandle,
)
from strata_jax.cache.host_grouped import GroupedHostPool, grouped_host_page_bytes
from strata_jax.cache.local_pages import DeviceLocalPages, TreeLocalPages
from strata_jax.cache.pools import DevicePool, HostPool, chunk_pages_for
from strata_jax.cache.storage_service import StorageService
from strata_jax.cache.tier_format import GLOBAL_ONLY, TierFormat
from strata_jax.cache.tree_window import TreeNodeLike, host_window_pages

if TYPE_CHECKING:
    from pallas_kernels.layout import GroupedPoolLayout, KVLayout

_PREFETCH_READ_PAGES = 32  # objects per L3 read of a prefetch


def host_page_bytes_for(
    config: CacheConfig, layout: KVLayout, grouped: GroupedPoolLayout | None, host_local_ratio: float
) -> tuple[int, int]:
    """(L2 page bytes as held, L1 page bytes): what sizes the L2 allocator.  With layer groups
    an L2 page holds every global layer and a share of the local layers' KV."""
    fmt = TierFormat.resolve(config.kv_tier_format, layout.dtype)
    page_bytes = fmt.page_bytes(layout)
    if grouped is not None and any(grouped.local_layers) and page_bytes:
        return max(
            1, int(grouped_host_page_bytes(page_bytes, grouped.local_share, host_local_ratio))
        ), layout.page_bytes
    return page_bytes, layout.page_bytes


class _QueuedBackup:
    def __init__(self, completion: Deferred, dev_pages: list[int], host_pages: list[int]) -> None:
        self.completion = completion
        self.dev_pages = dev_pages
        self.host_pages = host_pages


class DeviceTransfers:
    """``TransferBackend`` over real pools.  ``grouped``: the L1 pool has layer groups
    (``DevicePool``); ``local_window``: the sliding window of its local layers; L2 is then a
    ``GroupedHostPool`` whose local-layer pages are ``host_local_ratio`` of its pages."""

    def __init__(
        self,
        config: CacheConfig,
        layout: KVLayout,
        device_alloc: PageAllocator,
        host_alloc: PageAllocator,
        *,
        device: Any = None,
        grouped: GroupedPoolLayout | None = None,
        local_window: int = 0,
        host_local_ratio: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if layout.page_size != config.page_size:
            raise CacheError(f"layout page_size {layout.page_size} != config page_size {config.page_size}")
        self.layout = layout
        self.tier_format = TierFormat.resolve(config.kv_tier_format, layout.dtype)
        self.tier_format_name = self.tier_format.name
        self.page_bytes = self.tier_format.page_bytes(layout)
        self.device_page_bytes = layout.page_bytes
        self._chunk_bytes = config.transfer_chunk_bytes
        self._clock = clock
        self.device_pool = DevicePool(
            layout,
            device_alloc.num_pages,
            device,
            kernel_backend=config.kernel_backend,
            tier_format=self.tier_format,
            grouped=grouped,
        )
        self.local_pages: TreeLocalPages | None = None
        self.host_pool: HostPool | GroupedHostPool
        if self.device_pool.local is not None:  # local-layer pages go back with their device pages
            device_alloc.listener = self.device_pool.local
        if grouped is not None and any(grouped.local_layers):
            if local_window <= 0:
                raise CacheError("a pool with sliding-window layers needs their window (local_window)")
            assert self.device_pool.local is not None  # a grouped pool has local pages
            host_local = DeviceLocalPages(0, 0)  # no L2: no host page has local KV
            if host_alloc.num_pages:
                self.host_pool = GroupedHostPool(
                    layout, host_alloc.num_pages, self.tier_format, grouped.local_layers, host_local_ratio
                )
                host_alloc.listener = self.host_pool
                host_local = self.host_pool.local
            else:
                self.host_pool = HostPool(layout, 0, self.tier_format)
            self.local_pages = TreeLocalPages(local_window, config.page_size, self.device_pool.local, host_local)
        else:
            self.host_pool = HostPool(layout, host_alloc.num_pages, self.tier_format)
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-io")
        self._watcher = ThreadPoolExecutor(1, thread_name_prefix="kv-watch")
        self._queue: list[_QueuedBackup] = []
        self._readers: dict[PrefetchHandle, Future[None]] = {}
        self._tree_nodes: Callable[[], Iterable[TreeNodeLike]] | None = None

    def host_page_bytes(self) -> float:
        return self.host_pool.page_bytes

    # ------------------------------------------------------------------ L1 -> L2
    def backup(
        self, dev_pages: Sequence[int], host_pages: Sequence[int], on_done: Callable[[], None]
    ) -> TransferHandle:
        dev, host = list(dev_pages), list(host_pages)
        nbytes = len(dev) * self.page_bytes
        if isinstance(self.host_pool, GroupedHostPool):
            assert self.local_pages is not None  # an L2 with layer groups has local pages
            # the host pages of device pages with local KV get local host pages; the landing
            # writes those still attached then (no device local page changes before the
            # gather: attach_local and eviction flush it first)
            self.attach_host_local([h for d, h in zip(dev, host, strict=True) if self.local_pages.on_device(d)])
            nbytes = self._layer_group_bytes(len(dev), sum(self.host_pool.has_local(h) for h in host))
        completion = Deferred(self.flush)
        self._queue.append(_QueuedBackup(completion, dev, host))
        return TransferHandle("backup", None, len(dev), nbytes, self._clock(), completion, on_done)

    def attach_host_local(self, host_pages: Sequence[int], tail: Sequence[int] = ()) -> None:
        """Local host pages for ``host_pages`` (L2 with layer groups), the windows before the
        tree's leaves and branch points (and ``tail``, pages not in the tree yet) first."""
        pool = self.host_pool
        assert isinstance(pool, GroupedHostPool) and self.local_pages is not None
        if len(host_pages) <= pool.local.map.free_pages:
            pool.attach_local(host_pages)
            return
        if self._tree_nodes is None:
            raise CacheError("attach_host_local needs the tree's nodes (bind_tree)")
        windows = host_window_pages(self._tree_nodes(), self.local_pages.window_pages + 1)
        pool.attach_local(host_pages, windows | set(tail))

    def bind_tree(self, iter_nodes: Callable[[], Iterable[TreeNodeLike]]) -> None:
        """Where L2 local pages run short, the windows kept first are those before the tree's
        leaves and branch points: ``iter_nodes`` walks the tree."""
        self._tree_nodes = iter_nodes

    def _layer_group_bytes(self, n: int, with_local: int) -> int:
        """Tier-format bytes of ``n`` pages that move every page's global layers and the local
        layers of ``with_local`` of them."""
        grouped = self.device_pool.grouped
        assert grouped is not None
        share = grouped.local_share
        return round(self.page_bytes * (n * (1 - share) + with_local * share))

    def flush(self) -> None:
        """Dispatch the queued backups' device gathers: their pages end to end, one gather per
        chunk of pages; each backup lands when the chunks holding its pages are on the host."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        if isinstance(self.host_pool, GroupedHostPool):
            for q in queue:
                self._dispatch_grouped(q, self.host_pool)
            return
        chunk = self.chunk_pages()
        dev = [p for q in queue for p in q.dev_pages]
        # In the tier format: (values,) or (q, scales) quantized on the device after the gather.
        stagings = [self.device_pool.gather_tier(dev[s : s + chunk]) for s in range(0, len(dev), chunk)]
        offset = 0
        for q in queue:
            first, last = offset // chunk, (offset + len(q.dev_pages) - 1) // chunk
            mine = [(c, stagings[c]) for c in range(first, last + 1)]
            write = self._rows_writer(q.host_pages, offset, chunk, mine)
            q.completion.dispatch(ArraysReady([a for _c, arrays in mine for a in arrays], then=write))
            offset += len(q.dev_pages)

    def _rows_writer(
        self, host_pages: list[int], offset: int, chunk: int, mine: list[tuple[int, tuple[Any, ...]]]
    ) -> Callable[[], None]:
        pool = self.host_pool

        def write() -> None:
            for c, arrays in mine:
                lo, hi = max(offset, c * chunk), min(offset + len(host_pages), (c + 1) * chunk)
                if lo < hi:
                    rows = [np.asarray(a)[lo - c * chunk : hi - c * chunk] for a in arrays]
                    pool.write(host_pages[lo - offset : hi - offset], *rows)

        return write

    def _dispatch_grouped(self, q: _QueuedBackup, pool: GroupedHostPool) -> None:
        """One backup into an L2 with layer groups: one gather of every page's global layers
        and one of the local layers of the pages whose host pages keep them (in chunks), so
        the device->host copy moves only what L2 will hold."""
        chunk = self.chunk_pages()
        groups = [g for g in (pool.global_layers, pool.local_layers) if len(g)]
        moves = []  # (layers, host pages, gathered arrays) per chunk
        for layers in groups:
            picked: Sequence[int] = range(len(q.host_pages))
            if layers is pool.local_layers:
                picked = [i for i, h in enumerate(q.host_pages) if pool.has_local(h)]
            for s in range(0, len(picked), chunk):
                part = picked[s : s + chunk]
                arrays = self.device_pool.gather_tier(
                    [q.dev_pages[i] for i in part], layers, count_pages=layers is groups[0]
                )
                moves.append((layers, [q.host_pages[i] for i in part], arrays))

        def write() -> None:
            for layers, hosts, arrays in moves:
                pool.write_layers(hosts, layers, *[np.asarray(a)[: len(hosts)] for a in arrays])

        q.completion.dispatch(ArraysReady([a for _l, _h, arrays in moves for a in arrays], then=write))

    # ------------------------------------------------------------------ L2 -> L1
    def load_bytes(self, num_pages: int, with_local: Sequence[bool] | None) -> int:
        if with_local is None:
            return num_pages * self.page_bytes
        return self._layer_group_bytes(num_pages, sum(with_local))

    def load(
        self,
        host_pages: Sequence[int],
        dev_pages: Sequence[int],
        with_local: Sequence[bool] | None,
        request_id: Hashable | None,
        measure: Callable[[TransferHandle], None],
    ) -> TransferHandle:
        issued = self._clock()
        arrays = self.device_pool.load_from_host(
            self.host_pool, host_pages, dev_pages, chunk_pages=self.chunk_pages(), with_local=with_local
        )
        completion = ArraysReady(arrays)
        n = len(dev_pages)
        handle = TransferHandle(
            "load", request_id, n, self.load_bytes(n, with_local), issued, completion, lambda: measure(handle)
        )

        def stamp_landing() -> None:
            completion.block()
            handle.landed_at = self._clock()

        self._watcher.submit(stamp_landing)
        return handle

    def chunk_pages(self) -> int:
        # The budget counts the bytes a chunk stages (what crosses the link).  A quantized
        # chunk so holds 2x (bf16 L1) or 4x (float32) the pages of a full-width one: fewer
        # chunks, each paying its fixed dispatch and copy cost once, loaded 10-20% faster on
        # XLA:CPU with the per-page dequantizing update (docs/cache.md).
        if self.tier_format.quantized:
            return chunk_pages_for(self.page_bytes, self._chunk_bytes)
        return chunk_pages_for(self.device_page_bytes or self.page_bytes, self._chunk_bytes)

    def warmup(self) -> int:
        if self.host_pool.num_pages == 0:
            return 0
        return self.device_pool.warmup(self.chunk_pages())

    def moved(self) -> dict[str, int] | None:
        return self.device_pool.moved

    def device_kv_bytes(self, num_pages: int, pinned_local_pages: int) -> int:
        grouped = self.device_pool.grouped
        if grouped is None or self.local_pages is None:
            return num_pages * self.device_page_bytes
        layer_page = self.device_page_bytes // len(grouped.local_layers)
        local = sum(grouped.local_layers)
        return layer_page * (num_pages * (len(grouped.local_layers) - local) + pinned_local_pages * local)

    def check(self, device_used: Sequence[int], host_used: Sequence[int]) -> None:
        if self.device_pool.local is not None:
            self.device_pool.local.check(device_used)
        if isinstance(self.host_pool, GroupedHostPool):
            self.host_pool.check(list(host_used))

    # ------------------------------------------------------------------ L2 -> L3
    def write_storage(
        self, storage: StorageService, keys: Sequence[bytes], host_pages: Sequence[int]
    ) -> TransferHandle:
        raw = self._storage_payloads(host_pages)  # a snapshot: the host pages may be reused once this returns
        n = len(keys)
        future = self._io.submit(storage.write, list(keys), [memoryview(raw[i]) for i in range(n)])
        completion = Deferred(lambda: None)
        completion.dispatch(FutureDone(future))
        return TransferHandle("storage_write", None, n, raw.nbytes, self._clock(), completion)

    def _storage_payloads(self, host_pages: Sequence[int]) -> np.ndarray:
        """L3 payloads of ``host_pages`` as rows of one uint8 array (one copy out of L2):
        page header | values | scales (tier_format.py)."""
        fmt, layout, pool = self.tier_format, self.layout, self.host_pool
        header = np.frombuffer(fmt.header(layout), np.uint8)
        values = pool.read(host_pages)
        n, h, v = len(host_pages), header.size, fmt.value_bytes(layout)
        raw = np.empty((n, fmt.object_bytes(layout)), np.uint8)
        raw[:, :h] = header
        if self.local_pages is not None:  # a page whose local-layer KV was trimmed says so
            global_only = np.frombuffer(fmt.header(layout, GLOBAL_ONLY), np.uint8)
            trimmed = [i for i, p in enumerate(host_pages) if not self.local_pages.on_host(p)]
            raw[trimmed, :h] = global_only
        raw[:, h : h + v] = values.reshape(n, -1).view(np.uint8)  # bytes per page, any dtype (bf16, fp8 included)
        if fmt.quantized:
            raw[:, h + v :] = pool.read_scales(host_pages).astype("<f4").reshape(n, -1).view(np.uint8)
        return raw

    # ------------------------------------------------------------------ L3 -> L2
    def start_prefetch(
        self,
        storage: StorageService,
        num_pages: int,
        issued_at: float,
        build: Callable[[Completion], PrefetchHandle],
    ) -> PrefetchHandle:
        completion = Deferred(lambda: None)
        handle = build(completion)
        if isinstance(self.host_pool, GroupedHostPool):
            assert self.local_pages is not None
            # the objects' local-layer KV lands in local host pages pinned for the read; those of
            # objects flagged global-only go back when it settles
            pages = handle.host_pages
            self.attach_host_local(pages, tail=pages[-(self.local_pages.window_pages + 1) :])
            self.host_pool.local.pin(("prefetch", id(handle)), pages)
            handle.local_slots = self.host_pool.local.local_ids(np.asarray(pages)).tolist()
        future = self._io.submit(self._read_objects, handle, storage)
        self._readers[handle] = future
        completion.dispatch(FutureDone(future))
        return handle

    def _read_objects(self, handle: PrefetchHandle, storage: StorageService) -> None:
        """The prefetch's reader (an I/O thread): objects into its reserved host pages, in
        order, stopping at the first miss."""
        for s in range(0, len(handle.keys), _PREFETCH_READ_PAGES):
            if handle.cancel.is_set():
                return
            payloads = storage.read(handle.keys[s : s + _PREFETCH_READ_PAGES])
            if payloads is None:
                handle.missed = True
                return
            with handle.lock:  # settling takes what landed under it: no page is written after
                if handle.cancel.is_set():
                    return  # settled while this read was in flight: the host pages are not ours
                for i, payload in enumerate(payloads):
                    if not self._land_object(handle, s + i, payload, storage):
                        handle.missed = True
                        return
                    handle.landed = s + i + 1

    def _land_object(self, handle: PrefetchHandle, index: int, payload: bytes | None, storage: StorageService) -> bool:
        """Check one object and write it into its host page; False for a miss."""
        fmt, layout, pool = self.tier_format, self.layout, self.host_pool
        if payload is None:
            return False
        grouped = isinstance(pool, GroupedHostPool)
        page, flags = (
            (fmt.check_object_flags(layout, payload) or (None, 0))
            if grouped
            else (fmt.check_object(layout, payload), 0)
        )
        value_bytes = fmt.value_bytes(layout)
        scales = None
        if page is not None and fmt.quantized:
            scales = np.frombuffer(page[value_bytes:], dtype="<f4")
            if not (np.isfinite(scales).all() and (scales > 0).all()):  # written by no quantizer of ours
                page = None
        if page is None:  # another format, shape or length: a miss, never decoded
            storage.format_miss()
            return False
        host_page = handle.host_pages[index]
        values = np.frombuffer(page[:value_bytes], dtype=pool.dtype).reshape(layout.page_first_shape(1)[1:])
        if scales is not None:
            scales = scales.reshape((layout.num_layers, 2, layout.num_kv_heads))
        if isinstance(pool, GroupedHostPool):
            with_local = not flags & GLOBAL_ONLY
            pool.write_slot(host_page, handle.local_slots[index], values, scales, with_local)
            if not with_local:
                handle.global_only.append(host_page)
        else:
            pool.write([host_page], values[None], None if scales is None else scales[None])
        return True

    def pages_landed(self, handle: PrefetchHandle) -> int:
        return handle.landed

    def stop_prefetch(self, handle: PrefetchHandle, policy: str) -> int:
        future = self._readers.get(handle)
        if future is not None:
            if policy == "wait_complete":
                future.result()
            elif policy == "timeout":
                try:
                    future.result(timeout=max(0.0, handle.deadline - self._clock()))
                except FutureTimeout:
                    pass
        with handle.lock:  # the reader writes no page after this; a read in flight (it may hang) is not waited for
            handle.cancel.set()
        return handle.landed

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        with handle.lock:
            handle.cancel.set()

    def release_prefetch(self, handle: PrefetchHandle) -> None:
        self._readers.pop(handle, None)
        if isinstance(self.host_pool, GroupedHostPool):  # the reader is done with the local host pages
            local = self.host_pool.local
            local.unpin(("prefetch", id(handle)))
            local.detach(handle.global_only)

    def close(self) -> None:
        self._watcher.shutdown(wait=True)
        self._io.shutdown(wait=True)
