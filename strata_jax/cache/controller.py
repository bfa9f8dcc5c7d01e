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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pallas_kernels.layout import KVLayout
from strata_jax.cache.allocator import PageAllocator
from strata_jax.cache.config import CacheConfig
from strata_jax.cache.hashing import chain_hashes
from strata_jax.cache.radix_tree import HiRadixTree, InsertResult, PrefixMatch, TreeNode
from strata_jax.cache.storage import StorageBackend, make_storage


log = logging.getLogger(__name__)

_ERROR_LOCK = threading.Lock()
_KEY_MEMO_TOKENS = 4 << 20  # prompt tokens whose storage keys stay memoized (~32 MiB of references)
_PROBE_MEMO_ENTRIES = 4096


def _await_arrays(handle: TransferHandle, arrays: Sequence[Any]) -> None:
    """``handle`` lands when every (device or staging) array in ``arrays`` is ready."""

    def block() -> None:
        for a in arrays:
            a.block_until_ready()

    handle._is_finished = lambda: all(a.is_ready() for a in arrays)
    handle._block = block


class CacheError(RuntimeError):
    """Misuse of the controller (e.g. loading an unlocked match)."""


class CacheFullError(CacheError):
    """L1 cannot provide the pages even after evicting every unlocked page."""


@dataclass(eq=False)
class TransferHandle:
    """One asynchronous transfer.  ``done`` flips in ``poll``/``is_ready``/``wait``."""

    kind: str  # "load" | "backup" | "storage_write" | "prefetch"
    request_id: Hashable | None
    num_pages: int
    nbytes: int
    issued_at: float
    done: bool = False
    completed_at: float | None = None  # when poll/is_ready/wait noticed it
    landed_at: float | None = None  # when it landed, stamped by a watcher thread (loads)
    _is_finished: Callable[[], bool] = field(default=lambda: True, repr=False)
    _block: Callable[[], None] = field(default=lambda: None, repr=False)
    _on_done: Callable[[], None] = field(default=lambda: None, repr=False)

    @property
    def seconds(self) -> float | None:
        """Issue to landing (to being noticed where no landing was stamped); None while in flight."""
        end = self.landed_at if self.landed_at is not None else self.completed_at
        return None if end is None else max(end - self.issued_at, 1e-9)


@dataclass(eq=False)
class PrefetchHandle(TransferHandle):
    """An L3 -> L2 prefetch: pages ``start_page .. start_page + num_pages`` of ``tokens``."""

    tokens: tuple[int, ...] = ()
    namespace: str = ""
    start_page: int = 0
    keys: list[bytes] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    anchor: TreeNode | None = None
    deadline: float = 0.0
    landed: int = 0
    missed: bool = False  # an object the probe promised was gone or did not verify
    finished: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future | None = None


class CacheController:
    """Tree + L1/L2 pools + L3 backend + transfers between them.

    ``layout=None`` (or ``move_data=False``) gives a bookkeeping-only controller
    (no arrays; transfers complete at once; storage objects have empty payloads):
    the no-model benchmarks and the simulator use it with the same policies.
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
    ) -> None:
        self.config = config
        self.layout = layout
        self.move_data = layout is not None if move_data is None else move_data
        if self.move_data and layout is None:
            raise CacheError("move_data=True needs a KVLayout")
        if layout is not None and layout.page_size != config.page_size:
            raise CacheError(f"layout page_size {layout.page_size} != config page_size {config.page_size}")
        self.page_size = config.page_size
        self.page_bytes = layout.page_bytes if layout is not None else 0
        self._clock = clock
        self.tree = HiRadixTree(config.page_size)
        self.device_alloc = PageAllocator(config.num_device_pages, "device")
        self.host_alloc = PageAllocator(config.num_host_pages(self.page_bytes or None), "host")
        self.device_pool = None
        self.host_pool = None
        if self.move_data:
            from strata_jax.cache.pools import DevicePool, HostPool

            self.device_pool = DevicePool(
                layout, self.device_alloc.num_pages, device, kernel_backend=config.kernel_backend  # type: ignore[arg-type]
            )
            if self.host_alloc.num_pages:
                self.host_pool = HostPool(layout, self.host_alloc.num_pages)  # type: ignore[arg-type]
        self.storage: StorageBackend | None = None
        if config.has_storage:
            self.storage = storage if storage is not None else make_storage(config)
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-io") if self.move_data else None
        # Stamps when each load lands, so the bandwidth estimate does not depend on how
        # late the engine polls (a long step in between once made it read low).
        self._watcher = ThreadPoolExecutor(1, thread_name_prefix="kv-watch") if self.move_data else None
        self._pending: list[TransferHandle] = []
        self._host_pending: dict[int, TransferHandle] = {}
        self._prefetch_reserved: set[int] = set()
        self._key_memo: dict[tuple[bytes, tuple[int, ...]], list[bytes]] = {}
        self._key_memo_tokens = 0
        self._probe_memo: dict[tuple[bytes, bytes], tuple[int, float]] = {}  # (first, last key) -> (hits, when)
        self._recent_writes: dict[bytes, float] = {}  # keys this instance wrote to L3 lately
        self._bandwidth = float(config.initial_bandwidth_bytes_per_s)
        self._bandwidth_samples = 0
        self.counters = {
            "loaded_pages": 0,
            "backed_up_pages": 0,
            "storage_written_pages": 0,
            "prefetched_pages": 0,
            "evicted_device_pages": 0,
            "evicted_host_pages": 0,
            "storage_errors": 0,  # L3 reads/writes that raised (served as misses / not written)
        }
        self._last_error_log = float("-inf")

    # ------------------------------------------------------------------ queries
    def match_prefix(
        self, tokens: Sequence[int], namespace: str = "", *, requester: Hashable | None = None, touch: bool = True
    ) -> PrefixMatch:
        """Tree match plus the L3 pages the backend holds right after the tree's data prefix.

        ``storage_tokens`` counts consecutive backend hits (``batch_exists`` on the
        hash chain) starting at ``device_tokens + host_tokens``; the transient part
        is then counted beyond it.  With ``touch`` and ``write_through_selective``
        nodes reaching the hit threshold are backed up to L2 here.
        """
        m = self.tree.match_prefix(tokens, namespace, requester=requester, touch=touch)
        if touch and self.config.write_policy == "write_through_selective" and self.config.has_host:
            node = m.last_node
            path = []
            while node.parent is not None:
                if node.device is not None and node.host is None and node.hit_count >= self.config.write_through_threshold:
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
        if seen is not None and now - seen[1] < ttl and (seen[0] == len(keys) or keys[seen[0]] not in self._recent_writes):
            return seen[0]
        try:
            hits = self.storage.batch_exists(keys)  # type: ignore[union-attr]
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

    def _note_storage_writes(self, keys: Sequence[bytes]) -> None:
        if self.config.storage_probe_ttl_s <= 0:
            return
        now = self._clock()
        for key in keys:
            self._recent_writes[key] = now
        if len(self._recent_writes) > 4 * _PROBE_MEMO_ENTRIES:  # older writes cannot make a memo entry stale
            ttl = self.config.storage_probe_ttl_s
            self._recent_writes = {k: t for k, t in self._recent_writes.items() if now - t < ttl}

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
        self, tokens: Sequence[int], namespace: str, device_pages: Sequence[int], locked: TreeNode
    ) -> tuple[TreeNode, list[int]]:
        """Insert a still-running request's computed KV and move its lock down.

        Same as ``insert`` (duplicate pages are freed at once), then locks the new
        deepest node and unlocks ``locked``.  Returns ``(new_lock, page_table)``:
        the request must switch the full-page part of its page table to
        ``page_table`` before its next step (its own duplicates are gone).
        """
        self.insert(tokens, namespace, device_pages)
        node = self.tree.match_prefix(tokens, namespace, touch=False).last_node
        self.tree.lock(node)
        self.tree.unlock(locked)
        return node, self.tree.device_pages_of(node)

    def page_table(self, tokens: Sequence[int], namespace: str = "") -> list[int]:
        """L1 page ids of the cached device prefix of ``tokens`` (lock first if you keep using them)."""
        return list(self.tree.match_prefix(tokens, namespace, touch=False).device_page_ids)

    def finish_request(self, owner: Hashable) -> int:
        """A request ended normally: drop transient nodes it still owns (tokens it never computed)."""
        return self.tree.remove_transient(owner)

    def insert(self, tokens: Sequence[int], namespace: str, device_pages: Sequence[int]) -> InsertResult:
        """Computed KV of ``tokens`` (full pages) sits in ``device_pages``: hand it to the tree.

        Ownership of the request's page table after this call::

            |<- pages the tree already had ->|<- pages adopted by the tree ->|
              caller's ids equal the tree's     now owned by the tree
              (or duplicates: freed here)

        so the caller owns none of ``device_pages`` afterwards (a partial last
        page beyond the full pages is the caller's to free).  Under
        ``write_through`` the new device-only nodes are backed up to L2 (and L3).
        """
        res = self.tree.insert(tokens, namespace, device_pages=device_pages)
        if res.unused_pages:
            self.device_alloc.free(res.unused_pages)
        if self.config.write_policy == "write_through" and self.config.has_host:
            last = self.tree.match_prefix(tokens, namespace, touch=False).last_node
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

    # ------------------------------------------------------------------ allocation and eviction
    def alloc_device(self, n: int) -> list[int]:
        """``n`` L1 pages, evicting unlocked LRU leaves (to L2 under ``write_back``) as needed.

        Raises ``CacheFullError`` when locked data leaves too little room.
        """
        pages = self.device_alloc.alloc(n)
        if pages is None:
            self.evict_device(n - self.device_alloc.num_free)
            pages = self.device_alloc.alloc(n)
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

    # ------------------------------------------------------------------ backups L1 -> L2 -> L3
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
        handle = TransferHandle("backup", None, n, n * self.page_bytes, self._clock())
        if self.move_data:
            chunk = self._transfer_chunk_pages()
            starts = range(0, n, chunk)
            stagings = [self.device_pool.gather_pages(dev_pages[s : s + chunk]) for s in starts]  # type: ignore[union-attr]

            def on_done() -> None:
                for s, staging in zip(starts, stagings):
                    self.host_pool.write(host_pages[s : s + chunk], np.asarray(staging))  # type: ignore[union-attr]
                for p in host_pages:
                    self._host_pending.pop(p, None)
                self.tree.unlock(node)
                if keys is not None:
                    self._write_storage_pages(keys, host_pages)
                    node.storage_backed = True

            _await_arrays(handle, stagings)
            handle._on_done = on_done
            for p in host_pages:
                self._host_pending[p] = handle
            self._pending.append(handle)
        else:
            self.tree.unlock(node)
            if keys is not None:
                self._write_storage_pages(keys, host_pages)
                node.storage_backed = True
            self._complete(handle)
        self.counters["backed_up_pages"] += n
        return handle

    def _write_storage(self, node: TreeNode) -> None:
        self._write_storage_pages(self.tree.page_hashes(node), list(node.host))  # type: ignore[arg-type]
        node.storage_backed = True

    def _write_storage_pages(self, keys: list[bytes], host_pages: list[int]) -> None:
        """Asynchronous L2 -> L3 write of a snapshot of ``host_pages`` under ``keys``."""
        assert self.storage is not None
        storage = self.storage
        n = len(keys)
        self.counters["storage_written_pages"] += n
        self._note_storage_writes(keys)

        def write(payloads: Sequence[bytes | memoryview]) -> None:
            try:
                storage.batch_set(keys, payloads)
            except Exception as exc:  # noqa: BLE001 - L3 is a cache: a failed write is a later miss
                self._storage_failed("write", exc)

        if not self.move_data:
            write([b""] * n)
            return
        self._wait_host(host_pages)
        snapshot = self.host_pool.read(host_pages).copy()  # type: ignore[union-attr]
        handle = TransferHandle("storage_write", None, n, n * self.page_bytes, self._clock())
        raw = snapshot.view(np.uint8).reshape(n, -1)  # bytes per page, any dtype (bf16 included)
        fut = self._executor.submit(write, [memoryview(raw[i]) for i in range(n)])  # type: ignore[union-attr]
        handle._is_finished = fut.done
        handle._block = fut.result
        self._pending.append(handle)

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

    def _wait_host(self, host_pages: Sequence[int]) -> None:
        for p in host_pages:
            h = self._host_pending.get(p)
            if h is not None:
                self.wait(h)

    # ------------------------------------------------------------------ loads L2 -> L1
    def load(self, match: PrefixMatch, request_id: Hashable | None = None) -> TransferHandle | None:
        """Bring the host-only nodes on the path to ``match.last_node`` into L1.

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
        handle = TransferHandle("load", request_id, n, n * self.page_bytes, self._clock())
        if self.move_data:
            self._wait_host(host_pages)
            arrays = self.device_pool.load_from_host(  # type: ignore[union-attr]
                self.host_pool, host_pages, dev_pages, chunk_pages=self._transfer_chunk_pages()  # type: ignore[arg-type]
            )
            _await_arrays(handle, arrays)

            def stamp_landing() -> None:
                handle._block()
                handle.landed_at = self._clock()

            self._watcher.submit(stamp_landing)  # type: ignore[union-attr]
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
        return handle

    def _measure(self, handle: TransferHandle) -> None:
        elapsed = handle.seconds
        if handle.nbytes > 0 and elapsed is not None:
            sample = handle.nbytes / elapsed
            a = self.config.bandwidth_ema
            self._bandwidth = sample if self._bandwidth_samples == 0 else (1 - a) * self._bandwidth + a * sample
            self._bandwidth_samples += 1

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
        if self.move_data:
            handle.future = self._executor.submit(self._prefetch_worker, handle)  # type: ignore[union-attr]
            handle._is_finished = handle.future.done
            handle._block = handle.future.result
        else:  # bookkeeping only: batch_exists just said they are there
            handle.landed = n
        self._pending.append(handle)
        return handle

    def _prefetch_worker(self, handle: PrefetchHandle, chunk: int = 32) -> None:
        pool = self.host_pool
        shape = self.layout.page_first_shape(1)[1:]  # type: ignore[union-attr]
        dtype = pool.data.dtype  # type: ignore[union-attr]
        for s in range(0, len(handle.keys), chunk):
            if handle.cancel.is_set():
                return
            try:
                payloads = self.storage.batch_get(handle.keys[s : s + chunk])  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - what landed so far is kept; the rest is recomputed
                self._storage_failed("read", exc)
                handle.missed = True
                return
            for i, payload in enumerate(payloads):
                if payload is None or len(payload) != self.page_bytes:
                    handle.missed = True
                    return
                pool.data[handle.host_pages[s + i]] = np.frombuffer(payload, dtype=dtype).reshape(shape)  # type: ignore[union-attr]
                handle.landed = s + i + 1

    def finish_prefetch(self, handle: PrefetchHandle) -> int:
        """Apply the stop policy, put the landed pages into the tree as host nodes; returns tokens landed.

        ``best_effort``: stop now and keep what landed; ``wait_complete``: wait for
        every page; ``timeout``: wait until the handle's deadline (base + per-page
        budget), then stop.  Unlocks the anchor and frees unused host pages.
        """
        if handle.finished:
            return handle.landed * self.page_size
        if handle.future is not None:
            policy = self.config.prefetch_policy
            if policy == "wait_complete":
                handle.future.result()
            elif policy == "timeout":
                try:
                    handle.future.result(timeout=max(0.0, handle.deadline - self._clock()))
                except FutureTimeout:
                    pass
            handle.cancel.set()
            handle.future.result()  # the worker stops after its current chunk
        return self._settle_prefetch(handle, handle.landed)

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        """Stop a prefetch and drop everything it fetched."""
        if handle.finished:
            return
        handle.cancel.set()
        if handle.future is not None:
            handle.future.result()
        self._settle_prefetch(handle, 0)

    def _settle_prefetch(self, handle: PrefetchHandle, landed: int) -> int:
        # Host pages reserved by the prefetch:
        #   |<- landed: handed to the tree (or unused -> freed) ->|<- not landed: freed ->|
        ps = self.page_size
        if handle.missed:  # the backend lost objects since it was probed: probe afresh
            self._probe_memo.clear()
        self._prefetch_reserved.difference_update(handle.host_pages)
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
                node.storage_backed = True
            end = self.tree.match_prefix(
                handle.tokens[: (handle.start_page + landed) * ps], handle.namespace, touch=False
            ).last_node
            self.tree.adopt_hashes(end, handle.keys[:landed], handle.start_page)
        self.host_alloc.free(to_free)
        self.tree.unlock(handle.anchor)  # type: ignore[arg-type]
        handle.finished = True
        handle.landed = landed
        self.counters["prefetched_pages"] += landed
        if not handle.done:
            self._complete(handle)
        if handle in self._pending:
            self._pending.remove(handle)
        return landed * ps

    # ------------------------------------------------------------------ completion
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
        for h in list(self._pending):
            if not isinstance(h, PrefetchHandle):
                self.wait(h)
        self.poll()

    # ------------------------------------------------------------------ maintenance
    def warmup_transfers(self) -> int:
        """Compile the L1 pool's load and backup programs now (none without L2); returns compiles."""
        if self.device_pool is None or self.host_pool is None:
            return 0
        return self.device_pool.warmup(self._transfer_chunk_pages())

    def _transfer_chunk_pages(self) -> int:
        from strata_jax.cache.pools import chunk_pages_for

        return chunk_pages_for(self.page_bytes, self.config.transfer_chunk_bytes)

    def clear_storage(self) -> None:
        """Delete every L3 object (of this store's prefix) and forget what probes saw."""
        if self.storage is None:
            return
        self.storage.clear()
        self._probe_memo.clear()
        for node in self.tree.iter_nodes():
            node.storage_backed = False

    def flush(self) -> None:
        """Drop every unlocked cached page from L1 and L2 (storage is left alone)."""
        self.drain()
        self.device_alloc.free(self.tree.evict_device(1 << 62, drop_host=self.host_alloc.free))
        self.host_alloc.free(self.tree.evict_host(1 << 62))

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

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device_pages": self.device_alloc.num_pages,
            "device_free_pages": self.device_alloc.num_free,
            "host_pages": self.host_alloc.num_pages,
            "host_free_pages": self.host_alloc.num_free,
            "link_bandwidth_bytes_per_s": self._bandwidth,
            "pending_transfers": len(self._pending),
            **self.counters,
        }
        if self.storage is not None:
            try:
                out["storage"] = self.storage.stats().__dict__
            except Exception as exc:  # noqa: BLE001 - stats must not fail because L3 is down
                self._storage_failed("stats", exc)
                out["storage"] = None
        return out

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
