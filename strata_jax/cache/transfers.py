"""L1 <-> L2 transfers of the cache controller, and the completion of every handle.

``Transfers`` is a mixin of ``CacheController``.  Contract:

* ``load(match, rid)``: host-only nodes on the path to a *locked* ``match.last_node``
  get device pages and a coalesced L2 -> L1 copy; on return the tree already
  points at the device pages (a later step reading the pool is ordered after the
  copy by JAX data flow); the handle says when the link transfer landed.
* ``_back_up(node)`` / ``_issue_backup``: an L1 -> L2 copy (then L2 -> L3 when there
  is storage); the node stays locked and its host pages are marked pending until
  the copy lands, so no reader sees a half-written page.  The device gathers of the
  backups issued during a step go out together, as one coalesced gather per chunk of
  pages, at the next ``poll`` (or as soon as anyone waits on one of them): the pages
  they read are the tree's, which no one writes, and the step that writes them is
  ahead of the gather on the device either way.  Fifty backups of one step were fifty
  small programs queued behind it; XLA:CPU admits 32 in flight and then blocks the
  engine thread until the step ends.
* ``poll`` / ``is_ready`` / ``wait`` / ``drain`` complete handles; nothing else
  flips ``done``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from strata_jax.cache.handles import (
    CacheError,
    CacheFullError,
    PrefetchHandle,
    TransferHandle,
    await_arrays,
    land_at,
)
from strata_jax.cache.host_grouped import GroupedHostPool
from strata_jax.cache.radix_tree import PrefixMatch, TreeNode
from strata_jax.cache.tree_window import host_window_pages


class Transfers:
    """Mixin: loads, backups and handle completion."""

    def _back_up(self, node: TreeNode) -> bool:
        """Give a device-only node a host copy (asynchronous); False if L2 has no room."""
        pages = self._alloc_host(len(node.device))  # type: ignore[arg-type]
        if pages is None:
            return False
        self.tree.set_host(node, pages)
        self._issue_backup(node, pages)
        return True

    def _issue_backup(self, node: TreeNode, host_pages: list[int]) -> TransferHandle:
        """Copy ``node``'s device pages into ``host_pages`` (attached to it by the caller)."""
        dev_pages = list(node.device)  # type: ignore[arg-type]
        n = len(dev_pages)
        keys = self.tree.page_hashes(node) if self.storage is not None else None
        self.tree.lock(node)  # host pages are being written: no eviction until done
        if self.local_pages is not None and self.host_pool is not None:
            # the host pages of device pages with local KV get local host pages; the landing writes
            # those still attached then (no device local page changes before the gather:
            # attach_local and eviction flush it first)
            self._attach_host_local([h for d, h in zip(dev_pages, host_pages) if self.local_pages.on_device(d)])
        nbytes = n * self.page_bytes
        if isinstance(self.host_pool, GroupedHostPool):  # every page's global layers, the local ones where kept
            nbytes = self._layer_group_bytes(n, sum(self.host_pool.has_local(h) for h in host_pages))
        handle = TransferHandle("backup", None, n, nbytes, self._clock())
        if self.move_data:
            self._backup_queue.append((handle, node, dev_pages, host_pages, keys))
            handle._is_finished = lambda: False  # not dispatched yet

            def block() -> None:
                self.flush_backups()
                handle._block()  # the dispatched gather's, now

            handle._block = block
            self._track_backup(handle, host_pages)
        elif self._timer is not None:  # simulated: lands in virtual time, same bookkeeping as above
            land_at(
                handle, self._timer.land_time("backup", n, handle.nbytes, handle.issued_at), self._clock, self._timer
            )
            handle._on_done = lambda: self._backup_landed(node, host_pages, keys)
            self._track_backup(handle, host_pages)
        else:
            self._backup_landed(node, host_pages, keys)
            self._complete(handle)
        self.counters["backed_up_pages"] += n
        self.counters["backed_up_bytes"] += handle.nbytes
        return handle

    def _attach_host_local(self, host_pages: Sequence[int], tail: Sequence[int] = ()) -> None:
        """Local host pages for ``host_pages`` (L2 with layer groups), the windows before the
        tree's leaves and branch points (and ``tail``, pages not in the tree yet) first."""
        pool = self.host_pool
        if len(host_pages) <= pool.local.map.free_pages:  # type: ignore[union-attr]
            pool.attach_local(host_pages)  # type: ignore[union-attr]
            return
        windows = host_window_pages(self.tree.iter_nodes(), self.local_pages.window_pages + 1)  # type: ignore[union-attr]
        pool.attach_local(host_pages, windows | set(tail))  # type: ignore[union-attr]

    def _layer_group_bytes(self, n: int, with_local: int) -> int:
        """Tier-format bytes of ``n`` pages of a pool with layer groups that move (or keep)
        every page's global layers and the local layers of ``with_local`` of them."""
        share = self.device_pool.grouped.local_share  # type: ignore[union-attr]
        return round(self.page_bytes * (n * (1 - share) + with_local * share))

    def flush_backups(self) -> None:
        """Dispatch the queued backups' device gathers: their pages end to end, one gather
        per chunk of pages; each backup lands when the chunks holding its pages are on the host."""
        queue, self._backup_queue = self._backup_queue, []
        if not queue:
            return
        if isinstance(self.host_pool, GroupedHostPool):
            self._flush_backups_grouped(queue)
            return
        chunk = self._transfer_chunk_pages()
        dev = [p for _h, _n, dev_pages, _hp, _k in queue for p in dev_pages]
        # In the tier format: (values,) or (q, scales) quantized on the device after the gather.
        stagings = [self.device_pool.gather_tier(dev[s : s + chunk]) for s in range(0, len(dev), chunk)]  # type: ignore[union-attr]
        offset = 0
        for handle, node, dev_pages, host_pages, keys in queue:
            first, last = offset // chunk, (offset + len(dev_pages) - 1) // chunk
            mine = [(c, stagings[c]) for c in range(first, last + 1)]

            def on_done(node=node, host_pages=host_pages, keys=keys, offset=offset, mine=mine) -> None:
                for c, arrays in mine:
                    lo, hi = max(offset, c * chunk), min(offset + len(host_pages), (c + 1) * chunk)
                    if lo < hi:
                        rows = [np.asarray(a)[lo - c * chunk : hi - c * chunk] for a in arrays]
                        self.host_pool.write(host_pages[lo - offset : hi - offset], *rows)  # type: ignore[union-attr]
                self._backup_landed(node, host_pages, keys)

            await_arrays(handle, [a for _c, arrays in mine for a in arrays])
            handle._on_done = on_done
            offset += len(dev_pages)

    def _flush_backups_grouped(self, queue: list) -> None:
        """``flush_backups`` into an L2 with layer groups: per backup, one gather of every
        page's global layers and one of the local layers of the pages whose host pages keep
        them (in chunks), so the device->host copy moves only what L2 will hold."""
        pool, device_pool = self.host_pool, self.device_pool
        chunk = self._transfer_chunk_pages()
        groups = [g for g in (pool.global_layers, pool.local_layers) if len(g)]  # type: ignore[union-attr]
        for handle, node, dev_pages, host_pages, keys in queue:
            moves = []  # (layers, host pages, gathered arrays) per chunk
            for layers in groups:
                picked = range(len(host_pages))
                if layers is pool.local_layers:  # type: ignore[union-attr]
                    picked = [i for i, h in enumerate(host_pages) if pool.has_local(h)]  # type: ignore[union-attr]
                for s in range(0, len(picked), chunk):
                    part = picked[s : s + chunk]
                    arrays = device_pool.gather_tier(  # type: ignore[union-attr]
                        [dev_pages[i] for i in part],
                        layers,
                        count_pages=layers is groups[0],
                    )
                    moves.append((layers, [host_pages[i] for i in part], arrays))

            def on_done(node=node, host_pages=host_pages, keys=keys, moves=moves) -> None:
                for layers, hosts, arrays in moves:
                    pool.write_layers(hosts, layers, *[np.asarray(a)[: len(hosts)] for a in arrays])  # type: ignore[union-attr]
                self._backup_landed(node, host_pages, keys)

            await_arrays(handle, [a for _l, _h, arrays in moves for a in arrays])
            handle._on_done = on_done

    def _track_backup(self, handle: TransferHandle, host_pages: list[int]) -> None:
        """Register an in-flight backup: its host pages are not read until it lands."""
        for p in host_pages:
            self._host_pending[p] = handle
        self._pending.append(handle)

    def _backup_landed(self, node: TreeNode, host_pages: list[int], keys: list | None) -> None:
        """A backup's host copy is complete: release its pages and lock, then write L3 if asked."""
        for p in host_pages:
            self._host_pending.pop(p, None)
        self.tree.unlock(node)
        if keys is not None:
            self._write_storage_pages(keys, host_pages)
            self.tree.set_storage_backed(node, True)

    def _wait_host(self, host_pages: Sequence[int]) -> None:
        for p in host_pages:
            h = self._host_pending.get(p)
            if h is not None:
                self.wait(h)

    def load(
        self, match: PrefixMatch, request_id: Hashable | None = None, use_tokens: int | None = None
    ) -> TransferHandle | None:
        """Bring the host-only nodes on the path to ``match.last_node`` into L1.

        ``use_tokens``: where the caller's prefix will end if before the match's end (a
        scheduler recomputing the last page): with layer groups, the local-layer KV loaded
        is that end's window.

        The caller must hold a lock on ``match.last_node`` (allocation may evict).
        Coalesced and pipelined: host pages are gathered into page-first staging
        buffers of ``transfer_chunk_bytes`` (bucketed row counts), each moved with one
        ``device_put`` as soon as it is gathered and scattered into the pool
        (``DevicePool.load_from_host``).  On return the nodes carry their device pages
        and any later step reading the pool sees the data (JAX data flow); the
        handle reports when the link transfer landed.  ``None``: nothing to load.
        """
        nodes = self.tree.host_only_path(match.last_node)
        if not nodes:
            return None
        if match.last_node.lock_ref <= 0:
            raise CacheError("lock match.last_node before load()")
        n = sum(len(x.host) for x in nodes)  # type: ignore[arg-type]
        dev_pages = self.alloc_device(n)
        host_pages = [p for x in nodes for p in x.host]  # type: ignore[union-attr]
        nbytes = n * self.page_bytes
        with_local = None
        if self.local_pages is not None:
            # Window-only: the local layers' KV of the pages the match end's window covers (and
            # the host holds); every page's global layers.  Earlier pages stay global-only.
            w = self.local_pages.window_pages
            first = len(self.tree.device_pages_of(match.last_node))  # the path's page of host_pages[0]
            end = first + n if use_tokens is None else min(first + n, use_tokens // self.page_size)
            with_local = [end - w <= first + i < end and self.local_pages.on_host(h) for i, h in enumerate(host_pages)]
            try:
                self.attach_local([d for d, keep in zip(dev_pages, with_local) if keep])
            except CacheFullError:
                self.device_alloc.free(dev_pages)
                raise
            nbytes = self._layer_group_bytes(n, sum(with_local))
        handle = TransferHandle("load", request_id, n, nbytes, self._clock())
        if self.move_data:
            self._wait_host(host_pages)
            arrays = self.device_pool.load_from_host(  # type: ignore[union-attr]
                self.host_pool,
                host_pages,
                dev_pages,
                chunk_pages=self._transfer_chunk_pages(),
                with_local=with_local,  # type: ignore[arg-type]
            )
            await_arrays(handle, arrays)

            def stamp_landing() -> None:
                handle._block()
                handle.landed_at = self._clock()

            self._watcher.submit(stamp_landing)  # type: ignore[union-attr]
            handle._on_done = lambda: self._measure(handle)
            self._pending.append(handle)
        elif self._timer is not None:  # simulated: lands in virtual time
            self._wait_host(host_pages)
            land_at(handle, self._timer.land_time("load", n, handle.nbytes, self._clock()), self._clock, self._timer)
            handle._on_done = lambda: self._measure(handle)
            self._pending.append(handle)
        else:
            self._complete(handle)
        off = 0
        for x in nodes:
            k = len(x.host)  # type: ignore[arg-type]
            self.tree.set_device(x, dev_pages[off : off + k])
            off += k
        self.counters["loaded_pages"] += n
        self.counters["loaded_bytes"] += handle.nbytes
        return handle

    def _measure(self, handle: TransferHandle) -> None:
        """Bandwidth from the load's *service* time on the link: from when it could start
        (issued, and the previous load landed: loads share one link, first in first out)
        to its landing.  Issue-to-landing would count the queue in front of it, and a
        backlog would read as a slow link (the scheduler then sees loads as dearer)."""
        end = handle.landed_at if handle.landed_at is not None else handle.completed_at
        if end is None:
            return
        start = max(handle.issued_at, self._link_free_at)
        self._link_free_at = max(self._link_free_at, end)
        elapsed = max(end - start, 1e-9)
        handle.service_seconds = elapsed
        if handle.nbytes > 0:
            sample = handle.nbytes / elapsed
            a = self.config.bandwidth_ema
            self._bandwidth = sample if self._bandwidth_samples == 0 else (1 - a) * self._bandwidth + a * sample
            self._bandwidth_samples += 1

    def _finished(self, handle: TransferHandle) -> bool:
        if isinstance(handle, PrefetchHandle) and not handle.done and self.config.prefetch_policy == "timeout":
            if self._clock() >= handle.deadline:
                return True
        return handle._is_finished()

    def _complete(self, handle: TransferHandle) -> None:
        handle.done = True
        handle.completed_at = self._clock()
        handle._on_done()

    def poll(self) -> list[TransferHandle]:
        """Complete every finished transfer (bookkeeping, bandwidth); returns them.

        A prefetch counts as complete when all its pages landed (or its timeout
        passed); it still needs ``finish_prefetch`` to join the tree.
        """
        self.flush_backups()
        done = []
        keep = []
        for h in self._pending:
            if not h.done and self._finished(h):
                self._complete(h)
            if h.done:
                done.append(h)
                if isinstance(h, PrefetchHandle) and not h.finished:
                    keep.append(h)
            else:
                keep.append(h)
        self._pending = keep
        return done

    def is_ready(self, handle: TransferHandle | None) -> bool:
        """Has this transfer landed (completing it if so)?  ``None`` counts as ready."""
        if handle is None or handle.done:
            return True
        if self._finished(handle):
            self._complete(handle)
            return True
        return False

    def wait(self, handle: TransferHandle | None) -> None:
        """Block until ``handle`` landed."""
        if handle is None or handle.done:
            return
        handle._block()
        self._complete(handle)

    def drain(self) -> None:
        """Wait for every in-flight transfer (prefetches excluded: finish or cancel them)."""
        self.flush_backups()
        for h in list(self._pending):
            if not isinstance(h, PrefetchHandle):
                self.wait(h)
        self.poll()

    def warmup_transfers(self) -> int:
        """Compile the L1 pool's load and backup programs now (none without L2); returns compiles."""
        if self.device_pool is None or self.host_pool is None:
            return 0
        return self.device_pool.warmup(self._transfer_chunk_pages())

    def _transfer_chunk_pages(self) -> int:
        from strata_jax.cache.pools import chunk_pages_for

        # The budget counts the bytes a chunk stages (what crosses the link).  A quantized
        # chunk so holds 2x (bf16 L1) or 4x (float32) the pages of a full-width one: fewer
        # chunks, each paying its fixed dispatch and copy cost once, loaded 10-20% faster on
        # XLA:CPU with the per-page dequantizing update (docs/cache.md).
        device_pool = self.device_pool
        if device_pool is not None and device_pool.tier_format.quantized:
            return chunk_pages_for(self.page_bytes, self.config.transfer_chunk_bytes)
        return chunk_pages_for(self.device_page_bytes or self.page_bytes, self.config.transfer_chunk_bytes)

    def next_landing(self) -> float | None:
        """Earliest stamped landing time of a transfer still in flight (simulated runs know it ahead)."""
        times = [h.landed_at for h in self._pending if not h.done and h.landed_at is not None]
        return min(times) if times else None
