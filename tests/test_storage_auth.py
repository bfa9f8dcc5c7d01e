"""L3 authentication (issue "No one writes into another's cache"): objects tagged with the
fleet's storage secret, forged / re-keyed / untagged objects as counted misses, and the
store marker that makes a server with another secret, or none, refuse the store.

The expected bytes are computed here with ``struct``/``hmac`` from the documented format,
independently of ``storage.py``.  Redis cases run against a real ``redis-server`` (helpers
of ``test_storage_redis.py``) and are skipped where it is not installed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_storage_redis import RedisServer, needs_server

from strata_jax.cache.config import CacheConfig, CacheConfigError
from strata_jax.cache.storage import MemoryStorage, StorageBackend, StorageError, make_storage
from strata_jax.cache.storage_file import FileStorage
from strata_jax.cache.storage_redis import RedisStorage

A = b"fleet-secret-A-0123456789abcdef"
B = b"fleet-secret-B-0123456789abcdef"
ENV = "STRATA_STORAGE_SECRET"
V1_HEAD = struct.Struct("<8s32sQ32s")


def v1_blob(key: bytes, payload: bytes) -> bytes:
    return V1_HEAD.pack(b"SJKVOBJ1", key, len(payload), hashlib.sha256(payload).digest()) + payload


def v2_blob(secret: bytes, key: bytes, payload: bytes) -> bytes:
    head = V1_HEAD.pack(b"SJKVOBJ2", key, len(payload), hashlib.sha256(payload).digest())
    return head + hmac.new(secret, head, hashlib.sha256).digest() + payload


def marker_blob(secret: bytes) -> bytes:
    text = b"strata-jax L3 store authenticated with this secret"
    return b"SJKVAUTH" + hmac.new(secret, text, hashlib.sha256).digest()


class Store:
    """One underlying store (a directory, a Redis server, a process's memory) that backends
    with various secrets open, plus raw access to it: what an attacker with write access does."""

    def __init__(self, kind: str, tmp_path: Path, redis: RedisServer | None) -> None:
        self.kind, self.dir, self.redis = kind, str(tmp_path / "kv"), redis

    def open(self, secret: bytes | None) -> StorageBackend:
        if self.kind == "memory":
            return MemoryStorage(secret=secret)
        if self.kind == "file":
            return FileStorage(self.dir, secret=secret)
        return RedisStorage.from_url(self.redis.url, secret=secret)  # type: ignore[union-attr]

    def put(self, store: StorageBackend, key: bytes, blob: bytes) -> None:
        store.write_object(key, blob)

    def get(self, store: StorageBackend, key: bytes) -> bytes | None:
        return store.read_object(key)

    def marker(self) -> bytes | None:
        if self.kind == "file":
            path = Path(self.dir) / "store-auth"
            return path.read_bytes() if path.exists() else None
        import redis

        return redis.Redis.from_url(self.redis.url).get("strata-jax:kv:store-auth")  # type: ignore[union-attr]

    def drop_marker(self) -> None:
        if self.kind == "file":
            (Path(self.dir) / "store-auth").unlink()
        else:
            import redis

            redis.Redis.from_url(self.redis.url).delete("strata-jax:kv:store-auth")  # type: ignore[union-attr]


@pytest.fixture(params=["memory", "file", pytest.param("redis", marks=needs_server)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    yield from _store(request.param, tmp_path)


@pytest.fixture(params=["file", pytest.param("redis", marks=needs_server)])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The backends whose store outlives a process (and so carries a marker)."""
    yield from _store(request.param, tmp_path)


def _store(kind: str, tmp_path: Path) -> Iterator[Store]:
    server = RedisServer(str(tmp_path)) if kind == "redis" else None
    try:
        yield Store(kind, tmp_path, server)
    finally:
        if server is not None:
            server.stop()


KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
PAYLOADS = [b"page-%d " % i * 40 for i in range(3)]


def test_round_trip_with_a_secret_writes_tagged_objects(any_store: Store) -> None:
    store = any_store.open(A)
    assert store.batch_set(KEYS, [memoryview(p) for p in PAYLOADS]) == 3
    assert store.batch_get(KEYS) == PAYLOADS
    for key, payload in zip(KEYS, PAYLOADS):
        assert any_store.get(store, key) == v2_blob(A, key, payload)  # the documented v2 framing, byte for byte
    stats = store.stats()
    assert stats.authenticated and stats.hits == 3 and stats.objects == 3
    assert (stats.corrupt, stats.forged, stats.unauthenticated) == (0, 0, 0)


def test_forged_and_rekeyed_objects_are_counted_misses(any_store: Store) -> None:
    store = any_store.open(A)
    # an attacker who can write the store but holds another secret: valid framing, correct SHA-256, wrong tag
    any_store.put(store, KEYS[0], v2_blob(B, KEYS[0], PAYLOADS[0]))
    assert store.batch_get(KEYS[:1]) == [None]
    assert store.stats().forged == 1 and store.stats().corrupt == 0
    assert any_store.get(store, KEYS[0]) is None  # deleted: the fleet's own write can take the key (SET NX)
    assert store.batch_set(KEYS[:1], [PAYLOADS[0]]) == 1 and store.batch_get(KEYS[:1]) == [PAYLOADS[0]]

    # a genuine object copied under another key, as is and with the header's key rewritten
    genuine = any_store.get(store, KEYS[0])
    assert genuine is not None
    any_store.put(store, KEYS[1], genuine)
    any_store.put(store, KEYS[2], genuine[:8] + KEYS[2] + genuine[40:])
    assert store.batch_get(KEYS) == [PAYLOADS[0], None, None]
    stats = store.stats()
    assert (stats.forged, stats.corrupt, stats.unauthenticated, stats.hits) == (3, 0, 0, 2)


def test_untagged_objects_are_misses_with_a_secret_and_damage_stays_corrupt(any_store: Store) -> None:
    store = any_store.open(A)
    any_store.put(store, KEYS[0], v1_blob(KEYS[0], PAYLOADS[0]))  # what a server without the secret writes
    damaged = bytearray(v2_blob(A, KEYS[1], PAYLOADS[1]))
    damaged[-1] ^= 1  # a bit flip, not a forgery: the plain checksum tells them apart
    any_store.put(store, KEYS[1], bytes(damaged))
    assert store.batch_get(KEYS[:2]) == [None, None]
    stats = store.stats()
    assert (stats.unauthenticated, stats.corrupt, stats.forged, stats.misses) == (1, 1, 0, 2)
    assert any_store.get(store, KEYS[0]) is None and any_store.get(store, KEYS[1]) is None


def test_without_a_secret_v1_works_as_before_and_v2_is_a_kept_miss(any_store: Store) -> None:
    store = any_store.open(None)
    assert store.batch_set(KEYS[:1], [PAYLOADS[0]]) == 1
    assert any_store.get(store, KEYS[0]) == v1_blob(KEYS[0], PAYLOADS[0])  # unchanged format
    any_store.put(store, KEYS[1], v2_blob(A, KEYS[1], PAYLOADS[1]))
    assert store.batch_get(KEYS[:2]) == [PAYLOADS[0], None]
    stats = store.stats()
    assert not stats.authenticated and (stats.unauthenticated, stats.corrupt, stats.forged) == (1, 0, 0)
    assert any_store.get(store, KEYS[1]) is not None  # it cannot check it, so it does not destroy it


def test_store_marker_cases(shared_store: Store) -> None:
    # (d) no secret, no marker: today's behaviour, and no marker is written
    plain = shared_store.open(None)
    plain.batch_set(KEYS[:1], [PAYLOADS[0]])
    assert shared_store.marker() is None
    plain.close()
    # a secret over an unmarked store marks it (an independent HMAC of the fixed text)
    first = shared_store.open(A)
    assert shared_store.marker() == marker_blob(A)
    first.batch_set(KEYS[1:3], PAYLOADS[1:3])
    # (a) the same secret: accepted, and the other server's objects are hits
    second = shared_store.open(A)
    assert second.batch_get(KEYS[1:3]) == PAYLOADS[1:3]
    assert second.stats().objects == 3  # the marker is not an object (the v1 one is, until read)
    # (b) another secret: refused at start-up
    with pytest.raises(StorageError, match="different storage secret"):
        shared_store.open(B)
    # (c) no secret over a marked store: refused, naming the variable
    with pytest.raises(StorageError, match="written with a storage secret.*STRATA_STORAGE_SECRET"):
        shared_store.open(None)
    # clear() keeps the marker, so the guard holds over an emptied store too
    second.clear()
    assert second.stats().objects == 0 and shared_store.marker() == marker_blob(A)
    with pytest.raises(StorageError, match="different storage secret"):
        shared_store.open(B)
    with pytest.raises(StorageError, match=ENV):
        shared_store.open(None)


def test_a_damaged_marker_is_refused(shared_store: Store) -> None:
    shared_store.open(A).close()
    shared_store.drop_marker()
    if shared_store.kind == "file":
        (Path(shared_store.dir) / "store-auth").write_bytes(b"SJKVAUTH" + b"\0" * 32)
    else:
        import redis

        client = redis.Redis.from_url(shared_store.redis.url)  # type: ignore[union-attr]
        client.set("strata-jax:kv:store-auth", b"junk")
    with pytest.raises(StorageError, match="different storage secret"):
        shared_store.open(A)


def test_file_eviction_never_evicts_the_marker(tmp_path: Path) -> None:
    size = 112 + 100  # the v2 header and a 100-byte payload
    store = FileStorage(str(tmp_path / "kv"), 3 * size, secret=A)
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(10)]
    for key in keys:
        assert store.batch_set([key], [b"x" * 100]) == 1
    stats = store.stats()
    assert stats.evictions == 7 and stats.objects == 3 and stats.bytes == 3 * size  # exactly the header's size
    assert (tmp_path / "kv" / "store-auth").read_bytes() == marker_blob(A)
    assert FileStorage(str(tmp_path / "kv"), 3 * size, secret=A).stats().objects == 3  # the rescan skips it too


@needs_server
def test_redis_writes_restore_an_evicted_marker(tmp_path: Path) -> None:
    server = RedisServer(str(tmp_path))
    try:
        store = Store("redis", tmp_path, server)
        backend = store.open(A)
        store.drop_marker()  # what allkeys-lru may do to it
        assert backend.batch_set(KEYS[:2], PAYLOADS[:2]) == 2
        assert store.marker() == marker_blob(A) and backend.stats().writes == 2
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_secret_from_the_environment_and_the_config(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def built(**kw: object) -> StorageBackend:
        cfg = CacheConfig(device_pages=4, tiers="L1+L2+L3", storage_backend=backend, **kw)  # type: ignore[arg-type]
        return make_storage(cfg)

    def written_with(store: StorageBackend, key: bytes) -> bytes:
        store.batch_set([key], [PAYLOADS[0]])
        return Store(backend, tmp_path, None).get(store, key)  # type: ignore[return-value]

    monkeypatch.delenv(ENV, raising=False)
    assert written_with(built(storage_dir=str(tmp_path / "none")), KEYS[0]) == v1_blob(KEYS[0], PAYLOADS[0])
    monkeypatch.setenv(ENV, A.decode())
    store = built(storage_dir=str(tmp_path / "env"))
    assert store.stats().authenticated and written_with(store, KEYS[0]) == v2_blob(A, KEYS[0], PAYLOADS[0])
    # the config field wins over the environment
    store = built(storage_dir=str(tmp_path / "field"), storage_secret=B.decode())
    assert written_with(store, KEYS[0]) == v2_blob(B, KEYS[0], PAYLOADS[0])
    monkeypatch.setenv(ENV, "tooShortXY")
    with pytest.raises(StorageError, match=f"{ENV} is set but holds 10 bytes") as info:
        built(storage_dir=str(tmp_path / "short"))
    assert "tooShortXY" not in str(info.value)  # a secret is never echoed


def test_config_field_is_validated_and_kept_out_of_repr() -> None:
    for bad in ("", "fifteen-bytes!!", b"x" * 32):
        with pytest.raises(CacheConfigError, match="CacheConfig.storage_secret") as info:
            CacheConfig(device_pages=4, storage_secret=bad)  # type: ignore[arg-type]
        assert "fifteen" not in str(info.value)
    cfg = CacheConfig(device_pages=4, storage_secret=A.decode())
    assert A.decode() not in repr(cfg)


def test_engine_ignores_objects_forged_with_another_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Secret A fills L3; an attacker with write access but secret B re-tags every object
    (same payload, valid framing); an engine with A over that directory loads nothing from
    L3, counts the forgeries, and its greedy tokens are the cold run's."""
    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    monkeypatch.setenv(ENV, A.decode())
    prompt = np.random.default_rng(7).integers(3, 250, size=300).tolist()
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)

    def run() -> tuple[object, dict]:
        engine = Engine(
            EngineConfig(
                model="tiny",
                warmup=False,
                show_progress=False,
                tiers="L1+L2+L3",
                storage_dir=str(tmp_path / "l3"),
                device_tokens=2048,
                max_context_tokens=512,
                prefetch_min_tokens=0,
                prefetch_policy="wait_complete",
            )
        )
        try:
            out = engine.generate([prompt], greedy)[0]
            return out, engine.cache_stats()["storage"]
        finally:
            engine.shutdown()  # drains the L3 writes

    cold, cold_stats = run()
    assert cold.cached_tokens["storage"] == 0 and cold_stats["authenticated"]
    files = sorted((tmp_path / "l3" / "objects").rglob("*.kv"))
    assert len(files) >= 300 // 16
    for path in files:
        blob = path.read_bytes()
        key, payload = bytes.fromhex(path.stem), blob[112:]
        assert blob == v2_blob(A, key, payload)  # what secret A wrote
        path.write_bytes(v2_blob(B, key, payload))
    warm, stats = run()
    assert warm.token_ids == cold.token_ids
    assert warm.cached_tokens["storage"] == 0 and stats["hits"] == 0
    assert stats["forged"] >= 1 and stats["corrupt"] == 0


def test_helpers_agree_with_the_module(tmp_path: Path) -> None:
    """The module's own encode/decode helpers speak the same format as the independent one here."""
    from strata_jax.cache.storage import decode_object, encode_object

    assert encode_object(KEYS[0], PAYLOADS[0]) == v1_blob(KEYS[0], PAYLOADS[0])
    assert encode_object(KEYS[0], PAYLOADS[0], A) == v2_blob(A, KEYS[0], PAYLOADS[0])
    assert decode_object(KEYS[0], v2_blob(A, KEYS[0], PAYLOADS[0]), A) == PAYLOADS[0]
    assert decode_object(KEYS[0], v2_blob(B, KEYS[0], PAYLOADS[0]), A) is None
    assert decode_object(KEYS[0], v2_blob(A, KEYS[0], PAYLOADS[0])) is None
