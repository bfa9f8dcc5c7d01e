"""L3 storage: the backend interface, the object format, and the name registry.

Objects are content-addressed pages: the key is the page's SHA-256 chain value
(``hashing.py``; for a quantized tier format a hash of the format and that value,
``tier_format.TierFormat.object_key``), the payload one page-first page (all layers' K
and V) behind a page header naming its tier format (``tier_format.py``: the controller
writes and checks it; backends treat payloads as opaque bytes).  Every object is framed
as::

    MAGIC (8) | key (32) | payload length (8, little-endian) | SHA-256(payload) (32) | payload

so a corrupt, truncated or foreign object (another key's bytes under this name,
another program's file) is detected on read, counted in ``stats().corrupt`` and
treated as a miss, never returned.

Contract of every backend (thread-safe: the controller calls from worker threads):

* ``batch_exists(keys) -> int``: how many keys *from the first* are present
  (stops at the first miss);
* ``batch_get(keys) -> list[bytes | None]``: payloads, ``None`` for a miss;
* ``batch_set(keys, payloads) -> int``: stores (skipping keys already present),
  returns how many are now present; writes are atomic (never a half object);
* ``delete(keys) -> int``, ``clear()``, ``stats() -> StorageStats``, ``close()``.

Backends are chosen by name (``--storage file|redis|memory``) through
``STORAGE_BACKENDS`` / ``make_storage``.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata_jax.cache.config import CacheConfig

MAGIC = b"SJKVOBJ1"
HEADER = struct.Struct("<8s32sQ32s")


class StorageError(RuntimeError):
    """A backend could not be reached or configured."""


def encode_object(key: bytes, payload: bytes | memoryview) -> bytes:
    return HEADER.pack(MAGIC, key, len(payload), hashlib.sha256(payload).digest()) + bytes(payload)


def decode_object(key: bytes, blob: bytes | None) -> bytes | None:
    """The payload if ``blob`` is a whole, intact object for ``key``; else ``None``."""
    if blob is None or len(blob) < HEADER.size:
        return None
    magic, okey, length, digest = HEADER.unpack_from(blob)
    if magic != MAGIC or okey != key or len(blob) != HEADER.size + length:
        return None
    payload = blob[HEADER.size :]
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload


@dataclass(frozen=True)
class StorageStats:
    backend: str
    objects: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    corrupt: int
    writes: int
    evictions: int


class StorageBackend(ABC):
    name: str = "?"

    @abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    @abstractmethod
    def batch_set(self, keys: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> int: ...

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def stats(self) -> StorageStats: ...

    def close(self) -> None:  # noqa: B027 - optional
        pass


class MemoryStorage(StorageBackend):
    """In-process backend (tests, no-model benchmarks): framed objects in an LRU dict."""

    name = "memory"

    def __init__(self, capacity_bytes: int = 1 << 62) -> None:
        self.capacity_bytes = capacity_bytes
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "evictions": 0}

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._objects:
                    break
                self._objects.move_to_end(k)
                n += 1
            return n

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for k in keys:
                blob = self._objects.get(k)
                payload = decode_object(k, blob)
                if blob is not None and payload is None:
                    self._counts["corrupt"] += 1
                    self._bytes -= len(self._objects.pop(k))
                if payload is None:
                    self._counts["misses"] += 1
                else:
                    self._counts["hits"] += 1
                    self._objects.move_to_end(k)
                out.append(payload)
        return out

    def batch_set(self, keys: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> int:
        stored = 0
        with self._lock:
            for k, p in zip(keys, payloads):
                if k in self._objects:
                    self._objects.move_to_end(k)
                    stored += 1
                    continue
                blob = encode_object(k, p)
                if len(blob) > self.capacity_bytes:
                    continue
                self._objects[k] = blob
                self._bytes += len(blob)
                self._counts["writes"] += 1
                stored += 1
                while self._bytes > self.capacity_bytes:
                    _, old = self._objects.popitem(last=False)
                    self._bytes -= len(old)
                    self._counts["evictions"] += 1
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                blob = self._objects.pop(k, None)
                if blob is not None:
                    self._bytes -= len(blob)
                    n += 1
        return n

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()
            self._bytes = 0

    def stats(self) -> StorageStats:
        with self._lock:
            return StorageStats(self.name, len(self._objects), self._bytes, self.capacity_bytes, **self._counts)

    def _corrupt_for_test(self, key: bytes, blob: bytes) -> None:
        with self._lock:
            self._objects[key] = blob


def _make_memory(config: CacheConfig) -> StorageBackend:
    return MemoryStorage(config.storage_capacity_bytes)


def _make_file(config: CacheConfig) -> StorageBackend:
    from strata_jax.cache.storage_file import FileStorage

    return FileStorage(config.resolved_storage_dir, config.storage_capacity_bytes, fsync=config.storage_fsync)


def _make_redis(config: CacheConfig) -> StorageBackend:
    from strata_jax.cache.storage_redis import RedisStorage

    return RedisStorage.from_url(config.storage_url)


STORAGE_BACKENDS: dict[str, Callable[[CacheConfig], StorageBackend]] = {
    "file": _make_file,
    "redis": _make_redis,
    "memory": _make_memory,
}


def make_storage(config: CacheConfig) -> StorageBackend:
    """The backend named by ``config.storage_backend``."""
    factory = STORAGE_BACKENDS.get(config.storage_backend)
    if factory is None:
        raise StorageError(
            f"unknown storage backend {config.storage_backend!r}; choose one of {', '.join(sorted(STORAGE_BACKENDS))}"
        )
    return factory(config)
