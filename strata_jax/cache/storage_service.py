"""The L3 store as the cache controller sees it: key chains, existence probes, writes, errors.

``StorageService`` wraps a ``StorageBackend`` (file, Redis, memory) and is the one place
where

* storage keys of a prompt's pages are derived (memoized: the scheduler re-matches every
  waiting request every round, and hashing a 128K-token prompt costs ~8 ms);
* existence probes happen (``hits``, memoized for ``storage_probe_ttl_s``);
* writes happen (``write``);
* backend errors are counted and logged (``failed``): an L3 call that raises is a miss or an
  unwritten page, never a crash.

A quantized tier format's objects live under ``TierFormat.object_key`` of the chain key,
so another format's objects are other keys.  Thread-safe where it is called from I/O
threads (``write``, ``read``, ``failed``, ``format_miss``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from strata_jax.cache.config import CacheConfig
from strata_jax.cache.hashing import chain_hashes
from strata_jax.cache.storage import StorageBackend
from strata_jax.cache.tier_format import TierFormat

log = logging.getLogger("strata_jax.cache.controller")

_KEY_MEMO_TOKENS = 4 << 20  # prompt tokens whose storage keys stay memoized (~32 MiB of references)
_PROBE_MEMO_ENTRIES = 4096
_ERROR_LOG_INTERVAL_S = 10.0


class StorageService:
    """Probes, reads and writes of one L3 backend, with their memos, counters and read rate."""

    def __init__(
        self,
        backend: StorageBackend,
        config: CacheConfig,
        tier_format: TierFormat | None,
        clock: Callable[[], float],
    ) -> None:
        self.backend = backend
        self._page_size = config.page_size
        self._probe_ttl_s = config.storage_probe_ttl_s
        self._tier_format = tier_format
        self._clock = clock
        self._lock = threading.Lock()  # I/O threads report errors and read rates here
        self._key_memo: dict[tuple[bytes, tuple[int, ...]], list[bytes]] = {}
        self._key_memo_tokens = 0
        self._probe_memo: dict[tuple[bytes, bytes], tuple[int, float]] = {}  # (first, last key) -> (hits, when)
        self._recent_writes: dict[bytes, float] = {}  # keys this instance wrote lately
        self._read_bps: float | None = None
        self._last_error_log = float("-inf")
        self.errors = 0  # L3 calls that raised (served as misses / not written)
        self.format_misses = 0  # objects of another format / shape / length: misses, never decoded

    # ------------------------------------------------------------------ keys
    def chain_keys(self, prev: bytes, tokens: Sequence[int]) -> list[bytes]:
        """Storage keys of ``tokens``' pages after ``prev``, memoized by tokens held."""
        memo_key = (prev, tuple(tokens))
        keys = self._key_memo.get(memo_key)
        if keys is None:
            keys = chain_hashes(prev, memo_key[1], self._page_size)
            self._key_memo[memo_key] = keys
            self._key_memo_tokens += len(memo_key[1])
            # Bounded by tokens held, not entries: a queue of many waiting requests must
            # not evict its own entries every round (a small entry bound did).
            while self._key_memo_tokens > _KEY_MEMO_TOKENS and len(self._key_memo) > 1:
                old_key = next(iter(self._key_memo))
                self._key_memo_tokens -= len(old_key[1])
                del self._key_memo[old_key]
        return keys

    def object_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """L3 keys of the chain keys ``keys`` in this store's tier format."""
        fmt = self._tier_format
        if fmt is None or not fmt.quantized:
            return list(keys)
        return [fmt.object_key(k) for k in keys]

    # ------------------------------------------------------------------ probes
    def hits(self, keys: list[bytes]) -> int:
        """``batch_exists(keys)``, remembered for ``storage_probe_ttl_s``.

        With Redis each probe is a network round trip.  A chain of keys is named by its
        first and last key (each key hashes its predecessor).  An answer is re-probed early
        when this instance wrote its first missing page since; otherwise staleness is safe:
        a page that vanished makes the prefetch stop at it and the rest is recomputed, one
        that appeared is seen on a later probe.
        """
        now = self._clock()
        ttl = self._probe_ttl_s
        name = (keys[0], keys[-1])
        seen = self._probe_memo.get(name)
        if (
            seen is not None
            and now - seen[1] < ttl
            and (seen[0] == len(keys) or keys[seen[0]] not in self._recent_writes)
        ):
            return seen[0]
        try:
            hits = self.backend.batch_exists(self.object_keys(keys))
        except Exception as exc:  # noqa: BLE001 - L3 is a cache: unreachable means no hits
            self.failed("exists", exc)
            return 0
        if ttl > 0:
            self._probe_memo[name] = (hits, now)
            if len(self._probe_memo) > _PROBE_MEMO_ENTRIES:
                self._probe_memo = {k: v for k, v in self._probe_memo.items() if now - v[1] < ttl}
                while len(self._probe_memo) > _PROBE_MEMO_ENTRIES:
                    self._probe_memo.pop(next(iter(self._probe_memo)))
        return hits

    def forget_probes(self) -> None:
        """The backend lost objects a probe promised: probe afresh."""
        self._probe_memo.clear()

    # ------------------------------------------------------------------ writes and reads
    def note_writes(self, keys: Sequence[bytes]) -> None:
        """``keys`` are being written now: a memoized probe that stopped at one is stale."""
        if self._probe_ttl_s <= 0:
            return
        now = self._clock()
        for key in keys:
            self._recent_writes[key] = now
        if len(self._recent_writes) > 4 * _PROBE_MEMO_ENTRIES:  # older writes cannot make a memo entry stale
            self._recent_writes = {k: t for k, t in self._recent_writes.items() if now - t < self._probe_ttl_s}

    def write(self, keys: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> None:
        """Write objects under the chain keys ``keys``; a failure is counted (a later miss)."""
        try:
            self.backend.batch_set(self.object_keys(keys), payloads)
        except Exception as exc:  # noqa: BLE001 - L3 is a cache: a failed write is a later miss
            self.failed("write", exc)

    def read(self, keys: Sequence[bytes]) -> list[bytes | None] | None:
        """The objects of chain keys ``keys`` (None where missing); None when the read raised."""
        try:
            t0 = time.perf_counter()
            payloads = self.backend.batch_get(self.object_keys(keys))
            self._note_read(sum(len(p) for p in payloads if p is not None), time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - what landed so far is kept; the rest is recomputed
            self.failed("read", exc)
            return None
        return list(payloads)

    @property
    def read_bandwidth(self) -> float | None:
        """L3 -> L2 bytes per second measured on reads (an average over recent ones); None before the first."""
        return self._read_bps

    def _note_read(self, nbytes: int, seconds: float) -> None:
        # A read that brought no valid bytes (every object missing or corrupt) says how fast
        # the backend answers, not how fast KV arrives: averaging it in would drive the rate
        # toward 0 and make every L3 load look endless.
        if nbytes <= 0 or not seconds > 0:
            return
        sample = nbytes / seconds
        with self._lock:
            prev = self._read_bps
            self._read_bps = sample if prev is None else 0.8 * prev + 0.2 * sample

    def clear(self) -> None:
        """Delete every object (of this store's prefix) and forget what probes saw."""
        self.backend.clear()
        self._probe_memo.clear()

    # ------------------------------------------------------------------ errors
    def failed(self, op: str, exc: BaseException) -> None:
        """Count (and log, at most every 10 s) an L3 call that raised; callers carry on as a miss."""
        now = time.monotonic()
        with self._lock:
            self.errors += 1
            loud = now - self._last_error_log >= _ERROR_LOG_INTERVAL_S
            if loud:
                self._last_error_log = now
        if loud:
            log.warning("L3 %s failed (%s: %s); carrying on without it", op, type(exc).__name__, exc)

    def format_miss(self) -> None:
        """An object of another format, shape or length: a miss, never decoded."""
        with self._lock:
            self.format_misses += 1

    def close(self) -> None:
        self.backend.close()
