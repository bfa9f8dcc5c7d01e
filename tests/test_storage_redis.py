"""The Redis L3 backend against a real ``redis-server`` (started per test on a free port).

Skipped where no ``redis-server`` binary is installed; ``.ci/run`` installs Debian's
``redis-server`` so CI runs them.  The unreachable-server check needs no server.
"""

from __future__ import annotations

import shutil
import socket

import numpy as np
import pytest

from strata_jax.api import SamplingParams
from strata_jax.cache.storage import StorageError
from strata_jax.cache.storage_redis import RedisStorage, start_local_server

REDIS_SERVER = shutil.which("redis-server")
needs_server = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (`apt-get install redis-server`; .ci/run installs it)"
)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: str) -> None:
        self.proc, self.url = start_local_server(workdir, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture()
def server(tmp_path):
    srv = RedisServer(str(tmp_path))
    yield srv
    srv.stop()


def test_unreachable_server_is_a_clear_startup_error():
    from pallas_kernels.layout import KVLayout
    from strata_jax.cache.config import CacheConfig
    from strata_jax.cache.controller import CacheController

    url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
    with pytest.raises(StorageError, match="cannot reach the Redis server at"):
        RedisStorage.from_url(url, timeout_s=1.0)
    config = CacheConfig(page_size=4, device_pages=8, tiers="L1+L2+L3", storage_backend="redis", storage_url=url)
    with pytest.raises(StorageError, match="--storage-url"):
        CacheController.on_device(config, KVLayout(1, 1, 4, 4))


@needs_server
def test_contract_on_a_real_server(server):
    store = RedisStorage.from_url(server.url)
    keys = [bytes([i]) * 32 for i in range(3)]
    payloads = [b"a" * 100, memoryview(np.arange(64, dtype=np.float32)).cast("B"), b"c"]
    assert store.batch_set(keys, payloads) == 3
    assert store.batch_exists(keys + [b"z" * 32]) == 3
    assert store.batch_exists([keys[0], b"z" * 32, keys[2]]) == 1  # consecutive hits only
    got = store.batch_get(keys)
    assert got[0] == b"a" * 100 and np.array_equal(np.frombuffer(got[1], np.float32), np.arange(64)) and got[2] == b"c"
    store.batch_set(keys[:1], [b"other"])  # SET NX: the first write of a page wins, writers agree anyway
    assert store.batch_get(keys[:1]) == [b"a" * 100]
    other = RedisStorage.from_url(server.url)  # a second engine instance sees the same objects
    assert other.batch_get(keys[2:]) == [b"c"]
    foreign = store.read_object(keys[0])
    assert foreign is not None
    store.write_object(keys[1], foreign)  # an object under the wrong key
    assert store.batch_get(keys) == [b"a" * 100, None, b"c"]
    stats = store.stats()
    assert stats.corrupt == 1 and stats.objects == 2  # the foreign object was deleted
    store.clear()
    assert store.batch_exists(keys) == 0 and other.stats().objects == 0


@needs_server
def test_two_engines_share_l3_and_give_identical_tokens(server, tmp_path):
    from strata_jax.engine import Engine, EngineConfig

    def engine() -> Engine:
        return Engine(
            EngineConfig(
                model="tiny",
                warmup=False,
                show_progress=False,
                tiers="L1+L2+L3",
                page_size=16,
                device_tokens=2048,
                max_batch_tokens=64,
                max_batch_size=4,
                max_context_tokens=512,
                prefetch_policy="wait_complete",
                prefetch_min_tokens=0,
                storage_backend="redis",
                storage_url=server.url,
            )
        )

    prompt = np.random.default_rng(3).integers(0, 256, size=200).tolist()
    first = engine()
    cold = first.generate([prompt], GREEDY)[0]
    first.shutdown()  # drains its L3 writes
    second = engine()
    try:
        warm = second.generate([prompt], GREEDY)[0]
        assert cold.cached_tokens == {"device": 0, "host": 0, "storage": 0}
        assert warm.cached_tokens["storage"] == 192  # 12 full pages written by the other instance
        assert warm.token_ids == cold.token_ids
        assert second.cache_stats()["storage"]["hits"] >= 12
    finally:
        second.shutdown()


@needs_server
def test_server_going_away_is_served_as_misses(server, tmp_path, caplog):
    from strata_jax.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            page_size=16,
            device_tokens=2048,
            max_batch_tokens=64,
            max_batch_size=4,
            max_context_tokens=512,
            prefetch_policy="wait_complete",
            prefetch_min_tokens=0,
            storage_backend="redis",
            storage_url=server.url,
        )
    )
    try:
        prompt = np.random.default_rng(4).integers(0, 256, size=120).tolist()
        cold = engine.generate([prompt], GREEDY)[0]
        engine.flush_cache("device")
        engine.flush_cache("host")
        server.stop()  # L3 disappears while the engine serves
        with caplog.at_level("WARNING", logger="strata_jax.cache.controller"):
            again = engine.generate([prompt], GREEDY)[0]
            other = engine.generate([prompt[:50]], GREEDY)[0]  # and it keeps serving
        assert again.token_ids == cold.token_ids and again.cached_tokens["storage"] == 0
        assert other.finish_reason == "length"
        stats = engine.cache_stats()
        assert stats["transfers"]["storage_errors"] >= 1 and stats["storage"] is None  # L3 is down
        assert any("carrying on without it" in r.getMessage() for r in caplog.records)
        engine.check_accounting()
    finally:
        engine.shutdown()


@needs_server
def test_a_fresh_engine_takes_the_whole_stored_prefix_by_default(server):
    from test_prefetch_wait import check_fresh_engine_takes_the_whole_stored_prefix

    check_fresh_engine_takes_the_whole_stored_prefix(storage_backend="redis", storage_url=server.url)
