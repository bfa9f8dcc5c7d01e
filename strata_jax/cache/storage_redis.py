"""Shared L3 backend on a Redis/Valkey server (several engine instances, one store).

Keys are ``<prefix><64 hex>``; values are framed objects (``storage.py``), so a
corrupt or foreign value is a counted miss.  ``SET NX`` makes writes atomic and
idempotent.  Capacity and eviction are the server's: run it with ``maxmemory``
and ``maxmemory-policy allkeys-lru``.  Needs the ``redis`` package (the
``serve`` extra) and a reachable server.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from strata_jax.cache.storage import StorageBackend, StorageError, StorageStats, decode_object, encode_object


class RedisStorage(StorageBackend):
    name = "redis"

    def __init__(self, client: Any, prefix: str = "strata-jax:kv:") -> None:
        self._client = client
        self._prefix = prefix
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "evictions": 0}

    @classmethod
    def from_url(cls, url: str, prefix: str = "strata-jax:kv:") -> RedisStorage:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise StorageError("the redis backend needs `pip install redis`") from exc
        return cls(redis.Redis.from_url(url), prefix)

    def _k(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._k(key))
        n = 0
        for present in pipe.execute():
            if not present:
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        blobs = self._client.mget([self._k(k) for k in keys])
        out: list[bytes | None] = []
        bad: list[bytes] = []
        for key, blob in zip(keys, blobs):
            payload = decode_object(key, blob)
            with self._lock:
                if payload is None:
                    self._counts["misses"] += 1
                    if blob is not None:
                        self._counts["corrupt"] += 1
                        bad.append(key)
                else:
                    self._counts["hits"] += 1
            out.append(payload)
        if bad:
            self.delete(bad)
        return out

    def batch_set(self, keys: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> int:
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key, payload in zip(keys, payloads):
            pipe.set(self._k(key), encode_object(key, payload), nx=True)
        results = pipe.execute()
        with self._lock:
            self._counts["writes"] += sum(1 for r in results if r)
        return len(results)

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return int(self._client.delete(*[self._k(k) for k in keys]))

    def clear(self) -> None:
        names = list(self._client.scan_iter(match=self._prefix + "*"))
        for i in range(0, len(names), 512):
            self._client.delete(*names[i : i + 512])

    def stats(self) -> StorageStats:
        objects = sum(1 for _ in self._client.scan_iter(match=self._prefix + "*"))
        with self._lock:
            return StorageStats(self.name, objects, -1, -1, **self._counts)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # pragma: no cover
            pass
