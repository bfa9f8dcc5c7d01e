"""L3 storage: the backend interface, the object format, and the name registry.

Objects are content-addressed pages: the key is the page's SHA-256 chain value
(``hashing.py``; for a quantized tier format a hash of the format and that value,
``tier_format.TierFormat.object_key``), the payload one page-first page (all layers' K
and V) behind a page header naming its tier format (``tier_format.py``: the controller
writes and checks it; backends treat payloads as opaque bytes).  Every object is framed
as (v1, no storage secret)::

    MAGIC "SJKVOBJ1" (8) | key (32) | payload length (8, little-endian) | SHA-256(payload) (32) | payload

or, when the fleet shares a storage secret (``CacheConfig.storage_secret`` or the
``STRATA_STORAGE_SECRET`` environment variable), as v2::

    MAGIC "SJKVOBJ2" (8) | key (32) | length (8) | SHA-256(payload) (32) | tag (32) | payload
    tag = HMAC-SHA256(secret, the 80 bytes before it)

The tag covers the key, the length and (through its SHA-256) the payload, so only a
holder of the secret can make an object that verifies under a key; the payload is
hashed once, as in v1, and the HMAC runs over 80 bytes only.  Keeping the plain digest
tells damage from forgery.  A read classifies what it cannot use (a miss, counted in
``StorageStats``, never returned):

* ``corrupt``: damaged framing or payload (bad magic, truncated, checksum mismatch;
  without a secret also a v1 object under another key);
* ``forged`` (secret set): an intact v2 object whose tag does not verify, or that was
  copied under another key: written by someone without this secret;
* ``unauthenticated``: an intact object of the other mode: a v1 object read with a
  secret, or a v2 object read without one (such a reader cannot verify it).

Corrupt, forged and (for a reader with a secret) unauthenticated objects are deleted,
so that a proper write can replace them (Redis writes are ``SET NX``); a reader
without a secret leaves v2 objects alone: they belong to a fleet that can check them.

**Store marker.**  A backend with a secret writes, if absent, a marker under a name
no page key can take (``<dir>/store-auth`` next to ``objects/``, Redis
``<prefix>store-auth``): ``"SJKVAUTH" | HMAC-SHA256(secret, MARKER_TEXT)``.  At start-up
a backend with a secret refuses (``StorageError``) a store whose marker does not verify
(written with another secret); one without a secret refuses a store that has a marker
(it could read nothing there, and would make the fleet's stores a mix).  A backend
without a secret on a store without a marker checks nothing: such a store is
unauthenticated by choice.  The marker is a start-up
guard against misconfiguration; the security is the tags (a reader with a secret never
returns an untagged object, marker or not).  ``clear()`` keeps it, capacity eviction
and ``stats()`` never see it.

Contract of every backend (thread-safe: the controller calls from worker threads):

* ``batch_exists(keys) -> int``: how many keys *from the first* are present
  (stops at the first miss);
* ``batch_get(keys) -> list[bytes | None]``: payloads, ``None`` for a miss;
* ``batch_set(keys, payloads) -> int``: stores (skipping keys already present),
  returns how many are now present; writes are atomic (never a half object);
* ``delete(keys) -> int``, ``clear()``, ``stats() -> StorageStats``, ``close()``.

Backends are chosen by name (``--storage file|redis|memory``) through
``STORAGE_BACKENDS`` / ``make_storage``, which also resolves the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata_jax.cache.config import MIN_STORAGE_SECRET_BYTES

if TYPE_CHECKING:
    from strata_jax.cache.config import CacheConfig

MAGIC = b"SJKVOBJ1"  # v1: checksummed, untagged
MAGIC_V2 = b"SJKVOBJ2"  # v2: checksummed and tagged with the storage secret
HEADER = struct.Struct("<8s32sQ32s")  # v1 header; also the first 80 bytes of a v2 one
HEADER_V2 = struct.Struct("<8s32sQ32s32s")  # ... followed by the tag
SECRET_ENV = "STRATA_STORAGE_SECRET"
MARKER_NAME = "store-auth"  # not 64 hex digits: never a page key's name in any backend
MARKER_MAGIC = b"SJKVAUTH"
MARKER_TEXT = b"strata-jax L3 store authenticated with this secret"


class StorageError(RuntimeError):
    """A backend could not be reached or configured."""


class ObjectCodec:
    """Frames objects and checks them on read: v1 without a secret, v2 (tagged) with one.

    The HMAC is keyed once here and ``copy()``-ed per object: keying hashes the secret
    into two SHA-256 states, which a copy reuses (the per-object cost is the payload's
    SHA-256, as in v1, plus two compressions over the 80-byte header)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret
        self._mac = hmac.new(secret, digestmod=hashlib.sha256) if secret is not None else None
        self.header_size = HEADER.size if secret is None else HEADER_V2.size

    def _tag(self, head: bytes | memoryview) -> bytes:
        mac = self._mac.copy()  # type: ignore[union-attr]  # callers tag only with a secret set
        mac.update(head)
        return mac.digest()

    def encode(self, key: bytes, payload: bytes | memoryview) -> bytes:
        digest = hashlib.sha256(payload).digest()
        if self._mac is None:
            return HEADER.pack(MAGIC, key, len(payload), digest) + bytes(payload)
        head = HEADER.pack(MAGIC_V2, key, len(payload), digest)
        return head + self._tag(head) + bytes(payload)

    def decode(self, key: bytes, blob: bytes | None) -> tuple[bytes | None, str | None]:
        """``(payload, None)`` if ``blob`` is a whole, intact object for ``key`` that this
        codec trusts; else ``(None, why)``: ``why`` is ``None`` for an absent object, or the
        ``StorageStats`` counter of the failure (``corrupt``, ``forged``, ``unauthenticated``)."""
        if blob is None:
            return None, None
        if len(blob) < HEADER.size:
            return None, "corrupt"
        magic, okey, length, digest = HEADER.unpack_from(blob)
        size = HEADER_V2.size if magic == MAGIC_V2 else HEADER.size
        if magic not in (MAGIC, MAGIC_V2) or len(blob) != size + length:
            return None, "corrupt"
        payload = blob[size:]
        if hashlib.sha256(payload).digest() != digest:
            return None, "corrupt"
        if self._mac is None:
            if magic == MAGIC_V2:
                return None, "unauthenticated"  # tagged: this reader cannot verify it
            return (payload, None) if okey == key else (None, "corrupt")
        if magic == MAGIC:
            return None, "unauthenticated"  # anyone who can write the store can make one
        # An attacker can copy a tagged object under another key (the tag names the
        # key in the header) or rewrite the header's key: both fail here.
        tag = blob[HEADER.size : size]
        if okey != key or not hmac.compare_digest(self._tag(memoryview(blob)[: HEADER.size]), tag):
            return None, "forged"
        return payload, None

    def discards(self, why: str) -> bool:
        """Whether a backend deletes an object that ``decode`` refused for ``why``.

        A reader with a secret deletes whatever it cannot trust, so that its own write
        can take the key (Redis writes are SET NX); one without a secret keeps tagged
        objects: they are good for the readers that hold the secret."""
        return self.secret is not None or why != "unauthenticated"

    def marker(self) -> bytes:
        """The store marker's bytes for this secret (``MARKER_MAGIC | HMAC(secret, MARKER_TEXT)``)."""
        return MARKER_MAGIC + self._tag(MARKER_TEXT)

    def verifies_marker(self, blob: bytes) -> bool:
        return self._mac is not None and hmac.compare_digest(blob, self.marker())


_PLAIN = ObjectCodec()


# One-off helpers (tools, tests); backends keep an ``ObjectCodec``, keyed once.
def encode_object(key: bytes, payload: bytes | memoryview, secret: bytes | None = None) -> bytes:
    return (_PLAIN if secret is None else ObjectCodec(secret)).encode(key, payload)


def decode_object(key: bytes, blob: bytes | None, secret: bytes | None = None) -> bytes | None:
    """The payload if ``blob`` is a whole, intact (with ``secret``: authentic) object for ``key``; else ``None``."""
    return (_PLAIN if secret is None else ObjectCodec(secret)).decode(key, blob)[0]


def empty_counts() -> dict[str, int]:
    """A backend's zeroed counters (the ``StorageStats`` ints it keeps)."""
    return {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "evictions": 0, "forged": 0, "unauthenticated": 0}


def secret_from(config: CacheConfig) -> bytes | None:
    """The storage secret: ``config.storage_secret``, else ``$STRATA_STORAGE_SECRET``, else None.

    Read once, when the backend is built.  The environment is the preferred channel: a
    command-line flag is visible to every user in ``ps``."""
    if config.storage_secret is not None:  # validated by CacheConfig
        return config.storage_secret.encode()
    value = os.environ.get(SECRET_ENV)
    if value is None:
        return None
    secret = value.encode()
    if len(secret) < MIN_STORAGE_SECRET_BYTES:  # (never echo the value: it is a secret)
        raise StorageError(
            f"{SECRET_ENV} is set but holds {len(secret)} bytes; the storage secret needs at least "
            f"{MIN_STORAGE_SECRET_BYTES} (e.g. `openssl rand -hex 32`), or unset it to run unauthenticated"
        )
    return secret


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
    forged: int = 0  # intact objects whose tag did not verify (another secret, or re-keyed)
    unauthenticated: int = 0  # intact objects of the other mode (untagged read with a secret, or the reverse)
    authenticated: bool = False  # this backend tags and checks objects with a storage secret


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

    def close(self) -> None:  # noqa: B027 - a no-op unless the backend holds a connection
        pass

    # The object under ``key`` exactly as stored (frame, checksum and all), bypassing the
    # codec: how fault-injection tests and tools damage or copy an object behind the
    # server's back.  Serving never calls them.
    @abstractmethod
    def read_object(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def write_object(self, key: bytes, blob: bytes) -> None: ...

    # The store marker (module docstring).  Shared backends implement these two; the
    # memory backend has no marker (its store is private to one process).
    def _read_marker(self) -> bytes | None:
        return None

    def _create_marker(self, blob: bytes) -> None:  # noqa: B027 - a no-op: only shared backends keep a marker
        """Write the marker unless one is there (atomically: two starts may race)."""

    def _open_store(self, codec: ObjectCodec, where: str) -> None:
        """Check the store's marker against ``codec``'s secret (writing it first with a
        secret and none there); a mismatch is a ``StorageError`` at start-up."""
        marker = self._read_marker()
        if codec.secret is None:
            if marker is not None:
                raise StorageError(
                    f"the L3 store {where} was written with a storage secret (it has a {MARKER_NAME!r} marker) "
                    f"but this server has none: set the fleet's secret in the {SECRET_ENV} environment variable "
                    "(or CacheConfig.storage_secret), or use another store"
                )
            return
        if marker is None:
            self._create_marker(codec.marker())
            marker = self._read_marker()  # the one that won a race decides
        if marker is None or not codec.verifies_marker(marker):
            raise StorageError(
                f"the L3 store {where} was written with a different storage secret (its {MARKER_NAME!r} marker "
                f"does not verify with this one): give every server of the fleet the same {SECRET_ENV}, "
                "or use another store"
            )


class MemoryStorage(StorageBackend):
    """In-process backend (tests, no-model benchmarks): framed objects in an LRU dict."""

    name = "memory"

    def __init__(self, capacity_bytes: int = 1 << 62, *, secret: bytes | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._codec = ObjectCodec(secret)
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = empty_counts()

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
                payload, why = self._codec.decode(k, blob)
                if why is not None:
                    self._counts[why] += 1
                    if self._codec.discards(why):
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
                blob = self._codec.encode(k, p)
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
            return StorageStats(
                self.name,
                len(self._objects),
                self._bytes,
                self.capacity_bytes,
                **self._counts,
                authenticated=self._codec.secret is not None,
            )

    def read_object(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._objects.get(key)

    def write_object(self, key: bytes, blob: bytes) -> None:
        with self._lock:
            self._objects[key] = blob


def _make_memory(config: CacheConfig) -> StorageBackend:
    return MemoryStorage(config.storage_capacity_bytes, secret=secret_from(config))


def _make_file(config: CacheConfig) -> StorageBackend:
    from strata_jax.cache.storage_file import FileStorage

    return FileStorage(
        config.resolved_storage_dir,
        config.storage_capacity_bytes,
        fsync=config.storage_fsync,
        secret=secret_from(config),
    )


def _make_redis(config: CacheConfig) -> StorageBackend:
    from strata_jax.cache.storage_redis import RedisStorage

    return RedisStorage.from_url(config.storage_url, secret=secret_from(config))


STORAGE_BACKENDS: dict[str, Callable[[CacheConfig], StorageBackend]] = {
    "file": _make_file,
    "redis": _make_redis,
    "memory": _make_memory,
}


def make_storage(config: CacheConfig) -> StorageBackend:
    """The backend named by ``config.storage_backend``, with the storage secret of
    ``config.storage_secret`` or ``$STRATA_STORAGE_SECRET`` (``secret_from``)."""
    factory = STORAGE_BACKENDS.get(config.storage_backend)
    if factory is None:
        raise StorageError(
            f"unknown storage backend {config.storage_backend!r}; choose one of {', '.join(sorted(STORAGE_BACKENDS))}"
        )
    return factory(config)
