"""Shared L3 backend on a Redis/Valkey server (several engine instances, one store).

Keys are ``<prefix><64 hex>``; values are framed objects (``storage.py``), so a
corrupt or foreign value is a counted miss.  ``SET NX`` makes writes atomic and
idempotent.  Capacity and eviction are the server's: run it with ``maxmemory``
and ``maxmemory-policy allkeys-lru``.  Needs the ``redis`` package (the
``serve`` extra) and a reachable server.

With a storage secret the store marker is ``<prefix>store-auth`` (not 64 hex digits,
so never a page's key); ``stats()`` and ``clear()`` leave it out, and every write batch
re-asserts it with ``SET NX`` (which also touches it), because under ``allkeys-lru``
the server may evict it like any key.

``from_url`` pings the server, so a wrong URL fails at start-up with a clear
``StorageError``.  Once serving, a failing call (server restarted, network blip,
timeout) raises like any backend's I/O error; the cache controller counts and logs
it and carries on as a miss (``StorageService.failed``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from strata_jax.cache.storage import MARKER_NAME, ObjectCodec, StorageBackend, StorageError, StorageStats, empty_counts


class RedisStorage(StorageBackend):
    name = "redis"

    def __init__(
        self, client: Any, prefix: str = "strata-jax:kv:", *, secret: bytes | None = None, where: str = ""
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._codec = ObjectCodec(secret)
        self._marker = prefix + MARKER_NAME
        # scan_iter yields bytes from redis-py (str from a decode_responses client)
        self._marker_names = {self._marker, self._marker.encode()}
        self._lock = threading.Lock()
        self._counts = empty_counts()
        self._open_store(self._codec, where or f"under Redis prefix {prefix!r}")

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "strata-jax:kv:", *, timeout_s: float = 5.0, secret: bytes | None = None
    ) -> RedisStorage:
        """Connect to ``url`` (``redis://host:port/db``), check the server answers, and
        check the store marker against ``secret`` (``storage.py``)."""
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise StorageError("the redis backend needs `pip install redis` (the serve extra)") from exc
        shown = _redacted(url)  # start-up errors are logged: never the password
        try:
            client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            client.ping()
        except redis.exceptions.AuthenticationError as exc:
            raise StorageError(
                f"the Redis server at {shown!r} refused to authenticate this server ({exc}): give its password "
                "in --storage-url / storage_url (redis://:PASSWORD@host:port/db)"
            ) from None
        except (redis.exceptions.RedisError, ValueError, OSError) as exc:
            raise StorageError(
                f"cannot reach the Redis server at {shown!r}: {exc}. Start one (e.g. `redis-server --port 6379`) "
                "and pass its URL as storage_url / --storage-url, or use storage_backend='file'"
            ) from exc
        try:
            return cls(client, prefix, secret=secret, where=f"at {shown} (prefix {prefix!r})")
        except BaseException:
            client.close()  # a refused store (marker check): do not leak the connection
            raise

    def _read_marker(self) -> bytes | None:
        marker: bytes | None = self._client.mget([self._marker])[0]  # typed here: redis-py has no annotations
        return marker

    def _create_marker(self, blob: bytes) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._marker, blob, nx=True)  # the first server's marker wins a race
        pipe.execute()

    def _k(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def read_object(self, key: bytes) -> bytes | None:
        blob: bytes | None = self._client.get(self._k(key))
        return blob

    def write_object(self, key: bytes, blob: bytes) -> None:
        self._client.set(self._k(key), blob)

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """Consecutive hits from the start.  One multi-key ``EXISTS`` (a count) settles
        the common all-or-nothing answers; only a partial chain needs a per-key
        pipeline (256 single-key commands cost ~1 ms in redis-py alone)."""
        if not keys:
            return 0
        names = [self._k(key) for key in keys]
        count = int(self._client.exists(*names))
        if count in (0, len(names)):
            return count
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        found = pipe.execute()
        n = 0
        for present in found:
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
            payload, why = self._codec.decode(key, blob)
            with self._lock:
                if payload is None:
                    self._counts["misses"] += 1
                    if why is not None:
                        self._counts[why] += 1
                        if self._codec.discards(why):
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
            pipe.set(self._k(key), self._codec.encode(key, payload), nx=True)
        if self._codec.secret is not None:
            pipe.set(self._marker, self._codec.marker(), nx=True)  # keep the marker (module docstring)
        results = pipe.execute()[: len(keys)]
        with self._lock:
            self._counts["writes"] += sum(1 for r in results if r)
        return len(results)

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return int(self._client.delete(*[self._k(k) for k in keys]))

    def clear(self) -> None:
        """Delete every object under this prefix but the store marker (an explicit admin
        action: errors raise)."""
        try:
            names = [n for n in self._client.scan_iter(match=self._prefix + "*") if n not in self._marker_names]
            for i in range(0, len(names), 512):
                self._client.delete(*names[i : i + 512])
        except Exception as exc:
            raise StorageError(f"clearing the Redis L3 failed: {exc}") from exc

    def stats(self) -> StorageStats:
        objects = sum(1 for n in self._client.scan_iter(match=self._prefix + "*") if n not in self._marker_names)
        with self._lock:
            return StorageStats(
                self.name, objects, -1, -1, **self._counts, authenticated=self._codec.secret is not None
            )

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # pragma: no cover
            pass


def _redacted(url: str) -> str:
    """``url`` with its password, if any, shown as ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    except ValueError:
        return "<an unparsable URL>"


def start_local_server(workdir: str, *extra_args: str, timeout_s: float = 15.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start a private ``redis-server`` on a free loopback port (no persistence), for
    tests and benchmarks; returns the process and its URL once it accepts connections.
    The caller terminates the process."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise StorageError("redis-server is not installed (e.g. `apt-get install redis-server`)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            *extra_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.terminate()
                proc.wait(10)
                raise StorageError("redis-server did not start") from None
            time.sleep(0.05)
