"""Embedded L3 backend: one file per page object in a local directory.

Layout: ``<dir>/objects/<2 hex>/<64 hex>.kv`` (framed as in ``storage.py``),
``<dir>/tmp/`` for writes in progress, and with a storage secret the store marker
``<dir>/store-auth`` (outside ``objects/``: the LRU index, capacity eviction, ``stats()``
and ``clear()`` never see it).  A write goes to a unique temp file and is
published with ``os.replace`` (atomic on POSIX): a crash before the rename leaves
only a temp file, which is invisible to readers and deleted at the next start.
Without ``fsync`` a power loss may leave a published but short object; its
checksum makes it a miss.

Capacity: an in-memory LRU index (rebuilt from file mtimes at start) evicts the
least recently used objects once ``capacity_bytes`` is exceeded.  Several
processes may share a directory: ``batch_exists``/``batch_get`` look at the
files, so objects written by another instance are found; each instance enforces
the capacity on what it knows.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence

from strata_jax.cache.storage import MARKER_NAME, ObjectCodec, StorageBackend, StorageStats, empty_counts


class FileStorage(StorageBackend):
    name = "file"

    def __init__(
        self, directory: str, capacity_bytes: int = 64 << 30, *, fsync: bool = False, secret: bytes | None = None
    ) -> None:
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._codec = ObjectCodec(secret)
        self._objects_dir = os.path.join(self.directory, "objects")
        self._tmp_dir = os.path.join(self.directory, "tmp")
        self._marker_path = os.path.join(self.directory, MARKER_NAME)
        os.makedirs(self._objects_dir, exist_ok=True)
        shutil.rmtree(self._tmp_dir, ignore_errors=True)  # leftovers of a crash: never visible
        os.makedirs(self._tmp_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._counts = empty_counts()
        self._open_store(self._codec, f"at {self.directory}")
        self._scan()

    def _read_marker(self) -> bytes | None:
        try:
            with open(self._marker_path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _create_marker(self, blob: bytes) -> None:
        # Written whole to a temp file, then hard-linked into place: link fails if a
        # marker exists, so of two servers starting at once exactly one marker wins
        # (and readers never see half of one).
        tmp = os.path.join(self._tmp_dir, f"{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())  # once per store: cheap, and the guard survives a power loss
            try:
                os.link(tmp, self._marker_path)
            except FileExistsError:
                pass
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self._objects_dir, h[:2], h + ".kv")

    def read_object(self, key: bytes) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_object(self, key: bytes, blob: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(blob)

    def _scan(self) -> None:
        found = []
        for sub in os.listdir(self._objects_dir):
            d = os.path.join(self._objects_dir, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                if not name.endswith(".kv"):
                    continue
                try:
                    key = bytes.fromhex(name[:-3])
                    st = os.stat(os.path.join(d, name))
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _remove(self, key: bytes) -> None:
        self._forget(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        # Always asks the file system: another instance may have written or
        # evicted an object since this one indexed it.
        n = 0
        with self._lock:
            for key in keys:
                try:
                    size = os.stat(self._path(key)).st_size
                except OSError:
                    self._forget(key)
                    break
                if key in self._index:
                    self._index.move_to_end(key)
                else:
                    self._index[key] = size
                    self._bytes += size
                n += 1
        return n

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    blob = f.read()
            except OSError:
                blob = None
            payload, why = self._codec.decode(key, blob)
            with self._lock:
                if payload is None:
                    self._counts["misses"] += 1
                    if why is None:
                        self._forget(key)
                    else:
                        self._counts[why] += 1
                        if self._codec.discards(why):
                            self._remove(key)
                else:
                    self._counts["hits"] += 1
                    if key in self._index:
                        self._index.move_to_end(key)
                    elif blob is not None:  # always: a hit was read
                        self._index[key] = len(blob)
                        self._bytes += len(blob)
            out.append(payload)
        return out

    def batch_set(self, keys: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> int:
        stored = 0
        if not os.path.isdir(self._tmp_dir):  # the store was removed while serving: start it afresh
            with self._lock:
                self._index.clear()
                self._bytes = 0
            os.makedirs(self._tmp_dir, exist_ok=True)
        for key, payload in zip(keys, payloads):
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    stored += 1
                    continue
            size = self._codec.header_size + len(payload)
            if size > self.capacity_bytes:
                continue
            path = self._path(key)
            tmp = os.path.join(self._tmp_dir, f"{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(self._codec.encode(key, payload))
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            with self._lock:
                self._forget(key)
                self._index[key] = size
                self._bytes += size
                self._counts["writes"] += 1
                stored += 1
                while self._bytes > self.capacity_bytes and self._index:
                    old = next(iter(self._index))
                    self._remove(old)
                    self._counts["evictions"] += 1
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                present = key in self._index or os.path.exists(self._path(key))
                self._remove(key)
                n += present
        return n

    def clear(self) -> None:
        """Delete every object; the store marker stays (the store remains authenticated)."""
        with self._lock:
            shutil.rmtree(self._objects_dir, ignore_errors=True)
            os.makedirs(self._objects_dir, exist_ok=True)
            self._index.clear()
            self._bytes = 0

    def stats(self) -> StorageStats:
        with self._lock:
            return StorageStats(
                self.name,
                len(self._index),
                self._bytes,
                self.capacity_bytes,
                **self._counts,
                authenticated=self._codec.secret is not None,
            )
