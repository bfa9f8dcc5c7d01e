"""L3 (storage) side of the cache controller: key chains, existence probes, writes, prefetch.

``StorageIO`` is a mixin of ``CacheController`` (it uses the controller's tree,
allocators, host pool, config, clock, counters and pending list; see there).
Contract:

* ``prefetch(tokens, ns, match, rid)`` starts an L3 -> L2 copy of the storage hit
  after the tree's data prefix; the handle holds a lock on ``match.last_node`` and
  reserves its host pages until ``finish_prefetch`` (stop policy; landed pages join
  the tree as host nodes) or ``cancel_prefetch`` (everything dropped).
* ``_storage_hits(keys)`` is the one place existence probes happen (memoized for
  ``storage_probe_ttl_s``); ``_write_storage_pages`` the one place writes happen;
  ``_storage_failed`` the one place backend errors are counted and logged: an L3
  call that raises is a miss / an unwritten page, never a crash.
* Storage workers touch only the backend, the host pages reserved for them and
  their handle.
* Objects are in the controller's tier format (``tier_format.py``): the payload is a
  page header naming the format, then the values (and scales); a quantized format's
  objects are stored under ``TierFormat.object_key`` of the chain key.  A read whose
  header, length or scales do not match is a miss (``storage_format_misses``), never
  decoded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from strata_jax.cache.handles import PrefetchHandle, TransferHandle, land_at
from strata_jax.cache.hashing import chain_hashes
from strata_jax.cache.host_grouped import GroupedHostPool
from strata_jax.cache.radix_tree import PrefixMatch, TreeNode
from strata_jax.cache.tier_format import GLOBAL_ONLY

log = logging.getLogger("strata_jax.cache.controller")

_ERROR_LOCK = threading.Lock()
_KEY_MEMO_TOKENS = 4 << 20  # prompt tokens whose storage keys stay memoized (~32 MiB of references)
_PROBE_MEMO_ENTRIES = 4096


class StorageIO:
    """Mixin: everything that talks to the L3 backend."""

    def _chain_keys(self, prev: bytes, tokens: Sequence[int]) -> list[bytes]:
        """Storage keys of ``tokens``' pages after ``prev``, memoized (the scheduler re-matches
        waiting requests every round; hashing a 128K-token prompt costs ~8 ms)."""
        memo_key = (prev, tuple(tokens))
        keys = self._key_memo.get(memo_key)
        if keys is None:
            keys = chain_hashes(prev, memo_key[1], self.page_size)
            self._key_memo[memo_key] = keys
            self._key_memo_tokens += len(memo_key[1])
            # Bounded by tokens held, not entries: a queue of many waiting requests must
            # not evict its own entries every round (a 16-entry bound once did).
            while self._key_memo_tokens > _KEY_MEMO_TOKENS and len(self._key_memo) > 1:
                old_key = next(iter(self._key_memo))
                self._key_memo_tokens -= len(old_key[1])
                del self._key_memo[old_key]
        return keys

    def _storage_hits(self, keys: list[bytes]) -> int:
        """``batch_exists(keys)``, remembered for ``storage_probe_ttl_s``.

        Every waiting request is re-matched every round, and with Redis each probe
        is a network round trip.  A chain of keys is named by its first and last key
        (each key hashes its predecessor).  An answer is re-probed early when this
        instance wrote its first missing page since; otherwise staleness is safe: a
        page that vanished (another instance's eviction) makes the prefetch stop at
        it and the rest is recomputed, one that appeared is seen on a later probe.
        """
        now = self._clock()
        ttl = self.config.storage_probe_ttl_s
        name = (keys[0], keys[-1])
        seen = self._probe_memo.get(name)
        if (
            seen is not None
            and now - seen[1] < ttl
            and (seen[0] == len(keys) or keys[seen[0]] not in self._recent_writes)
        ):
            return seen[0]
        try:
            hits = self.storage.batch_exists(self._object_keys(keys))  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - L3 is a cache: unreachable means no hits
            self._storage_failed("exists", exc)
            return 0
        if ttl > 0:
            self._probe_memo[name] = (hits, now)
            if len(self._probe_memo) > _PROBE_MEMO_ENTRIES:
                self._probe_memo = {k: v for k, v in self._probe_memo.items() if now - v[1] < ttl}
                while len(self._probe_memo) > _PROBE_MEMO_ENTRIES:
                    self._probe_memo.pop(next(iter(self._probe_memo)))
        return hits

    def _object_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """L3 keys of the chain keys ``keys`` in this controller's tier format (the chain keys
        themselves for full width; another format's objects are other keys)."""
        fmt = self.tier_format
        if fmt is None or not fmt.quantized:
            return list(keys)
        return [fmt.object_key(k) for k in keys]

    def _note_storage_writes(self, keys: Sequence[bytes]) -> None:
        if self.config.storage_probe_ttl_s <= 0:
            return
        now = self._clock()
        for key in keys:
            self._recent_writes[key] = now
        if len(self._recent_writes) > 4 * _PROBE_MEMO_ENTRIES:  # older writes cannot make a memo entry stale
            ttl = self.config.storage_probe_ttl_s
            self._recent_writes = {k: t for k, t in self._recent_writes.items() if now - t < ttl}

    def _write_storage(self, node: TreeNode) -> None:
        self._write_storage_pages(self.tree.page_hashes(node), list(node.host))  # type: ignore[arg-type]
        self.tree.set_storage_backed(node, True)

    def _write_storage_pages(self, keys: list[bytes], host_pages: list[int]) -> None:
        """Asynchronous L2 -> L3 write of a snapshot of ``host_pages`` under ``keys``."""
        assert self.storage is not None
        storage = self.storage
        n = len(keys)
        self.counters["storage_written_pages"] += n
        self._note_storage_writes(keys)

        object_keys = self._object_keys(keys)

        def write(payloads: Sequence[bytes | memoryview]) -> None:
            try:
                storage.batch_set(object_keys, payloads)
            except Exception as exc:  # noqa: BLE001 - L3 is a cache: a failed write is a later miss
                self._storage_failed("write", exc)

        if not self.move_data:
            self.counters["storage_written_bytes"] += n * self.page_bytes
            write([b""] * n)
            return
        self._wait_host(host_pages)
        raw = self._storage_payloads(host_pages)  # a snapshot: the host pages may be reused once this returns
        self.counters["storage_written_bytes"] += raw.nbytes
        handle = TransferHandle("storage_write", None, n, raw.nbytes, self._clock())
        fut = self._executor.submit(write, [memoryview(raw[i]) for i in range(n)])  # type: ignore[union-attr]
        handle._is_finished = fut.done
        handle._block = fut.result
        self._pending.append(handle)

    def _storage_payloads(self, host_pages: Sequence[int]) -> np.ndarray:
        """L3 payloads of ``host_pages`` as rows of one uint8 array (one copy out of L2):
        page header | values | scales (tier_format.py)."""
        fmt, layout, pool = self.tier_format, self.layout, self.host_pool
        header = np.frombuffer(fmt.header(layout), np.uint8)  # type: ignore[union-attr]
        values = pool.read(host_pages)  # type: ignore[union-attr]
        n, h, v = len(host_pages), header.size, fmt.value_bytes(layout)  # type: ignore[union-attr]
        raw = np.empty((n, fmt.object_bytes(layout)), np.uint8)  # type: ignore[union-attr]
        raw[:, :h] = header
        if self.local_pages is not None:  # a page whose local-layer KV was trimmed says so
            global_only = np.frombuffer(fmt.header(layout, GLOBAL_ONLY), np.uint8)  # type: ignore[union-attr]
            trimmed = [i for i, p in enumerate(host_pages) if not self.local_pages.on_host(p)]
            raw[trimmed, :h] = global_only
        raw[:, h : h + v] = values.reshape(n, -1).view(np.uint8)  # bytes per page, any dtype (bf16, fp8 included)
        if fmt.quantized:  # type: ignore[union-attr]
            raw[:, h + v :] = pool.read_scales(host_pages).astype("<f4").reshape(n, -1).view(np.uint8)  # type: ignore[union-attr]
        return raw

    def _storage_failed(self, op: str, exc: BaseException) -> None:
        """Count (and log, at most every 10 s) an L3 call that raised; callers carry on as a miss.

        The one place backend errors are handled: backends (file, Redis) just raise."""
        now = time.monotonic()
        with _ERROR_LOCK:  # I/O threads report here; errors are rare, one lock for all controllers
            self.counters["storage_errors"] += 1
            loud = now - self._last_error_log >= 10.0
            if loud:
                self._last_error_log = now
        if loud:
            log.warning("L3 %s failed (%s: %s); carrying on without it", op, type(exc).__name__, exc)

    # ------------------------------------------------------------------ prefetch L3 -> L2
    def prefetch(
        self, tokens: Sequence[int], namespace: str, match: PrefixMatch, request_id: Hashable | None = None
    ) -> PrefetchHandle | None:
        """Start fetching ``match.storage_tokens`` from L3 into L2 (asynchronous).

        ``None`` when there is no storage hit of at least ``prefetch_min_tokens``
        or L2 has no room.  The handle holds a lock on ``match.last_node`` and the
        reserved host pages until ``finish_prefetch`` or ``cancel_prefetch``.
        """
        if self.storage is None or self.host_alloc.num_pages == 0:
            return None
        if match.storage_tokens <= 0 or match.storage_tokens < self.config.prefetch_min_tokens:
            return None
        ps = self.page_size
        start = (match.device_tokens + match.host_tokens) // ps
        n = match.storage_tokens // ps
        keys = list(match.storage_keys[:n])
        if len(keys) < n:
            keys = chain_hashes(self.tree.last_hash(match.last_node), tokens[start * ps : (start + n) * ps], ps)
        self.tree.lock(match.last_node)
        host_pages = self._alloc_host(n)
        if host_pages is None:
            self.tree.unlock(match.last_node)
            return None
        now = self._clock()
        handle = PrefetchHandle(
            "prefetch",
            request_id,
            n,
            n * self.page_bytes,
            now,
            tokens=tuple(tokens[: (start + n) * ps]),
            namespace=namespace,
            start_page=start,
            keys=keys,
            host_pages=host_pages,
            anchor=match.last_node,
            deadline=now + self.config.prefetch_timeout_base_s + n * self.config.prefetch_timeout_per_page_s,
        )
        self._prefetch_reserved.update(host_pages)
        if isinstance(self.host_pool, GroupedHostPool):
            # the objects' local-layer KV lands in local host pages pinned for the read; those of
            # objects flagged global-only go back when it settles
            self._attach_host_local(host_pages, tail=host_pages[-(self.local_pages.window_pages + 1) :])  # type: ignore[attr-defined, union-attr]
            self.host_pool.local.pin(("prefetch", id(handle)), host_pages)
            handle.local_slots = self.host_pool.local.local_ids(np.asarray(host_pages)).tolist()
        if self.move_data:
            handle.future = self._executor.submit(self._prefetch_worker, handle)  # type: ignore[union-attr]
            handle._is_finished = handle.future.done
            handle._block = handle.future.result
        elif self._timer is not None:  # simulated: pages land evenly until landed_at
            land_at(handle, self._timer.land_time("prefetch", n, handle.nbytes, now), self._clock, self._timer)
        else:  # bookkeeping only: batch_exists just said they are there
            handle.landed = n
        self._pending.append(handle)
        return handle

    def prefetch_progress(self, request_id: Hashable) -> tuple[int, int, float] | None:
        """``request_id``'s prefetch still in flight: (tokens landed, tokens in all, seconds since issue)."""
        for h in self._pending:
            if (
                isinstance(h, PrefetchHandle)
                and h.request_id == request_id
                and not h.finished
                and not self._finished(h)
            ):
                landed = self._simulated_pages_landed(h) if self._timer is not None else h.landed
                return landed * self.page_size, h.num_pages * self.page_size, self._clock() - h.issued_at
        return None

    @property
    def storage_read_bandwidth(self) -> float | None:
        """L3 -> L2 bytes per second measured on prefetches (an average over recent reads); None before the first."""
        return self._storage_read_bps

    def _note_storage_read(self, nbytes: int, seconds: float) -> None:
        # A read that brought no valid bytes (every object missing or corrupt) says how fast
        # the backend answers, not how fast KV arrives: averaging it in would drive the rate
        # toward 0 and make every L3 load look endless.
        if nbytes <= 0 or not seconds > 0:
            return
        sample = nbytes / seconds
        prev = self._storage_read_bps
        self._storage_read_bps = sample if prev is None else 0.8 * prev + 0.2 * sample

    def _prefetch_worker(self, handle: PrefetchHandle, chunk: int = 32) -> None:
        pool = self.host_pool
        fmt, layout = self.tier_format, self.layout
        shape = layout.page_first_shape(1)[1:]  # type: ignore[union-attr]
        dtype = pool.dtype  # type: ignore[union-attr]
        scale_shape = (layout.num_layers, 2, layout.num_kv_heads)  # type: ignore[union-attr]
        value_bytes = fmt.value_bytes(layout)  # type: ignore[union-attr]
        for s in range(0, len(handle.keys), chunk):
            if handle.cancel.is_set():
                return
            try:
                t0 = time.perf_counter()
                payloads = self.storage.batch_get(self._object_keys(handle.keys[s : s + chunk]))  # type: ignore[union-attr]
                self._note_storage_read(sum(len(p) for p in payloads if p is not None), time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - what landed so far is kept; the rest is recomputed
                self._storage_failed("read", exc)
                handle.missed = True
                return
            with handle.lock:  # settling takes what landed under it: no page is written after
                if handle.cancel.is_set():
                    return  # settled while this read was in flight: the host pages are not ours
                for i, payload in enumerate(payloads):
                    page, flags = None, 0
                    if payload is not None:
                        if self.local_pages is not None:  # pages with global KV only are hits too
                            page, flags = fmt.check_object_flags(layout, payload) or (None, 0)  # type: ignore[union-attr]
                        else:
                            page = fmt.check_object(layout, payload)  # type: ignore[union-attr]
                    scales = None
                    if page is not None and fmt.quantized:  # type: ignore[union-attr]
                        scales = np.frombuffer(page[value_bytes:], dtype="<f4")
                        if not (np.isfinite(scales).all() and (scales > 0).all()):  # written by no quantizer of ours
                            page = None
                    if page is None:
                        if payload is not None:  # another format, shape or length: a miss, never decoded
                            with _ERROR_LOCK:
                                self.counters["storage_format_misses"] += 1
                        handle.missed = True
                        return
                    host_page = handle.host_pages[s + i]
                    values = np.frombuffer(page[:value_bytes], dtype=dtype).reshape(shape)
                    if scales is not None:
                        scales = scales.reshape(scale_shape)
                    if isinstance(pool, GroupedHostPool):
                        with_local = not flags & GLOBAL_ONLY
                        pool.write_slot(host_page, handle.local_slots[s + i], values, scales, with_local)
                        if not with_local:
                            handle.global_only.append(host_page)
                    else:
                        pool.data[host_page] = values  # type: ignore[union-attr]
                        if scales is not None:
                            pool.scales[host_page] = scales  # type: ignore[union-attr]
                    handle.landed = s + i + 1

    def finish_prefetch(self, handle: PrefetchHandle) -> int:
        """Apply the stop policy, put the landed pages into the tree as host nodes; returns tokens landed.

        ``best_effort`` and ``cost``: stop now and keep what landed (under ``cost`` the
        scheduler already waited as long as waiting was estimated to pay); ``wait_complete``: wait for
        every page; ``timeout``: wait until the handle's deadline (base + per-page
        budget), then stop.  Unlocks the anchor and frees unused host pages.
        """
        if handle.finished:
            return handle.landed * self.page_size
        if self._timer is not None:
            return self._settle_prefetch(handle, self._simulated_landing(handle))
        if handle.future is not None:
            policy = self.config.prefetch_policy
            if policy == "wait_complete":
                handle.future.result()
            elif policy == "timeout":
                try:
                    handle.future.result(timeout=max(0.0, handle.deadline - self._clock()))
                except FutureTimeout:
                    pass
            with handle.lock:  # the worker writes no page after this; a read in flight (it may hang) is not waited for
                handle.cancel.set()
        return self._settle_prefetch(handle, handle.landed)

    def _simulated_landing(self, handle: PrefetchHandle) -> int:
        """Pages of a simulated prefetch landed once its stop policy is applied in virtual time."""
        policy = self.config.prefetch_policy
        end = handle.landed_at if handle.landed_at is not None else handle.issued_at
        if policy == "wait_complete":
            self._timer.wait_until(end)  # type: ignore[union-attr]
        elif policy == "timeout":
            self._timer.wait_until(min(end, handle.deadline))  # type: ignore[union-attr]
        return self._simulated_pages_landed(handle)

    def _simulated_pages_landed(self, handle: PrefetchHandle) -> int:
        """Pages of a simulated prefetch landed by now: they land evenly until ``landed_at``."""
        end = handle.landed_at if handle.landed_at is not None else handle.issued_at
        now = self._clock()
        if now >= end:
            return handle.num_pages
        return int(handle.num_pages * max(0.0, now - handle.issued_at) / max(end - handle.issued_at, 1e-12))

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        """Stop a prefetch and drop everything it fetched."""
        if handle.finished:
            return
        with handle.lock:
            handle.cancel.set()
        self._settle_prefetch(handle, 0)

    def _settle_prefetch(self, handle: PrefetchHandle, landed: int) -> int:
        # Host pages reserved by the prefetch:
        #   |<- landed: handed to the tree (or unused -> freed) ->|<- not landed: freed ->|
        ps = self.page_size
        if handle.missed:  # the backend lost objects since it was probed: probe afresh
            self._probe_memo.clear()
        self._prefetch_reserved.difference_update(handle.host_pages)
        if isinstance(self.host_pool, GroupedHostPool):  # the worker is done with the local host pages
            local = self.host_pool.local
            local.unpin(("prefetch", id(handle)))
            local.detach(handle.global_only)
        to_free = list(handle.host_pages[landed:])
        if landed:
            res = self.tree.insert(
                handle.tokens[: (handle.start_page + landed) * ps],
                handle.namespace,
                host_pages=handle.host_pages[:landed],
                start_page=handle.start_page,
            )
            to_free.extend(res.unused_pages)
            for node in res.new_nodes:
                self.tree.set_storage_backed(node, True)
            end = self.tree.match_prefix(
                handle.tokens[: (handle.start_page + landed) * ps], handle.namespace, touch=False
            ).last_node
            self.tree.adopt_hashes(end, handle.keys[:landed], handle.start_page)
        self.host_alloc.free(to_free)
        self.tree.unlock(handle.anchor)  # type: ignore[arg-type]
        handle.finished = True
        handle.landed = landed
        self.counters["prefetched_pages"] += landed
        self.counters["prefetched_bytes"] += landed * self.page_bytes
        if not handle.done:
            self._complete(handle)
        if handle in self._pending:
            self._pending.remove(handle)
        return landed * ps

    def clear_storage(self) -> None:
        """Delete every L3 object (of this store's prefix) and forget what probes saw."""
        if self.storage is None:
            return
        self.storage.clear()
        self._probe_memo.clear()
        for node in list(self.tree.iter_nodes()):
            self.tree.set_storage_backed(node, False)
