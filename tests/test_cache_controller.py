"""Cache controller: bit-exact tier round trips, write/prefetch policies, slot safety, bandwidth."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pallas_kernels.layout import KVLayout
from strata_jax.cache.config import CacheConfig, CacheConfigError
from strata_jax.cache.controller import CacheController, CacheError, CacheFullError
from strata_jax.cache.pools import bucket
from strata_jax.cache.storage import MemoryStorage, StorageBackend
from strata_jax.cache.storage_file import FileStorage

PAGE_SIZES = [1, 2, 4, 16]


def _controller(ps: int, tmp_path, *, device_pages=24, policy="write_through", prefetch="wait_complete", **kw):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=ps)
    cfg = CacheConfig(
        page_size=ps,
        device_pages=device_pages,
        tiers="L1+L2+L3",
        write_policy=policy,
        prefetch_policy=prefetch,
        prefetch_min_tokens=0,
        storage_backend="file",
        storage_dir=str(tmp_path / "kv"),
        **kw,
    )
    return CacheController.on_device(cfg, layout), layout


def _write_device(ctl: CacheController, layout: KVLayout, pages: list[int], data: np.ndarray) -> None:
    staging = np.zeros(layout.page_first_shape(bucket(len(pages))), np.float32)
    staging[: len(pages)] = data
    ctl.device_pool.load_pages(staging, pages)


def _stored(store: StorageBackend, key: bytes) -> bytes:
    """The object under ``key`` as stored (it must be there)."""
    blob = store.read_object(key)
    assert blob is not None, key.hex()
    return blob


def _read_device(ctl: CacheController, pages: list[int]) -> np.ndarray:
    return np.asarray(ctl.device_pool.gather_pages(pages))[: len(pages)]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_round_trip_device_host_storage_host_device_bit_exact(ps: int, tmp_path_factory) -> None:
    ctl, layout = _controller(ps, tmp_path_factory.mktemp(f"rt{ps}"))

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        npages=st.integers(1, 7),
        churn=st.lists(st.integers(1, 5), max_size=4),
        seed=st.integers(0, 2**31 - 1),
    )
    def run(npages: int, churn: list[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        held = [ctl.alloc_device(k) for k in churn]  # scatter the free list
        for i in rng.permutation(len(held)):
            if i % 2:
                ctl.free_device(held[i])
        pages = ctl.alloc_device(npages)
        for i, h in enumerate(held):
            if i % 2 == 0:
                ctl.free_device(h)
        tokens = rng.integers(0, 50_000, size=npages * ps + int(rng.integers(0, ps))).tolist()
        data = rng.standard_normal(layout.page_first_shape(npages)).astype(np.float32)
        _write_device(ctl, layout, pages, data)
        ctl.insert(tokens, "t", pages)  # write_through: L1 -> L2 -> L3
        ctl.drain()
        node = ctl.tree.match_prefix(tokens, "t", touch=False).last_node
        host = [p for n in _path(node) for p in n.host]
        assert np.array_equal(ctl.transfers.host_pool.read(host), data), "L1 -> L2 copy differs"
        ctl.flush()  # drop L1 and L2: only L3 is left
        ctl.check()
        m = ctl.match_prefix(tokens, "t")
        assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, npages * ps)
        ctl.lock(m.last_node)
        pf = ctl.prefetch(tokens, "t", m, "req")
        assert ctl.finish_prefetch(pf) == npages * ps  # wait_complete
        ctl.unlock(m.last_node)
        m = ctl.match_prefix(tokens, "t")
        assert m.host_tokens == npages * ps
        ctl.lock(m.last_node)
        ctl.wait(ctl.load(m, "req"))
        got = _read_device(ctl, ctl.tree.device_pages_of(m.last_node))
        ctl.unlock(m.last_node)
        assert np.array_equal(got, data), "device -> host -> storage -> host -> device changed the KV"
        ctl.check()
        ctl.flush()
        ctl.storage.clear()

    run()
    ctl.close()


@pytest.mark.parametrize(("n", "chunk"), [(1, 1), (7, 2), (8, 8), (9, 4), (5, 64)])
def test_pipelined_load_writes_exactly_the_named_pages(n: int, chunk: int) -> None:
    """``load_from_host`` in chunks == the host pages, at the device pages named; nothing else touched."""
    import jax.numpy as jnp

    from strata_jax.cache.pools import DevicePool, HostPool

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=2)
    rng = np.random.default_rng(n * 31 + chunk)
    host = HostPool(layout, 24)
    host.data[:] = rng.standard_normal(host.data.shape).astype(np.float32)
    device = DevicePool(layout, 20)
    device.kv = jnp.full(device.kv.shape, jnp.nan, device.kv.dtype)
    host_pages = rng.choice(24, n, replace=False).tolist()
    dev_pages = rng.choice(20, n, replace=False).tolist()
    arrays = device.load_from_host(host, host_pages, dev_pages, chunk_pages=chunk)
    assert len(arrays) == -(-n // chunk)
    got = np.asarray(device.kv)
    np.testing.assert_array_equal(np.transpose(got[:, :, dev_pages], (2, 0, 1, 3, 4, 5)), host.data[host_pages])
    others = [p for p in range(20) if p not in dev_pages]
    assert np.isnan(got[:, :, others]).all()
    with pytest.raises(ValueError, match="power of two"):
        device.load_from_host(host, host_pages, dev_pages, chunk_pages=3)
    with pytest.raises(ValueError, match="host pages but"):
        device.load_from_host(host, host_pages[:-1], dev_pages, chunk_pages=chunk)


def test_chunk_pages_for_is_a_power_of_two_of_at_most_the_budget() -> None:
    from strata_jax.cache.pools import chunk_pages_for

    assert chunk_pages_for(1 << 20, 4 << 20) == 4
    assert chunk_pages_for(1 << 20, (5 << 20) - 1) == 4
    assert chunk_pages_for(3 << 20, 4 << 20) == 1
    assert chunk_pages_for(16 << 20, 4 << 20) == 1  # a page larger than the budget still moves
    assert chunk_pages_for(100, 4 << 20) == 32768


def _path(node):
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def test_bfloat16_round_trip_through_host_and_storage(tmp_path) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16")
    cfg = CacheConfig(
        page_size=4,
        device_pages=8,
        write_policy="write_back",
        tiers="L1+L2+L3",
        prefetch_policy="wait_complete",
        prefetch_min_tokens=0,
    )
    ctl = CacheController.on_device(cfg, layout, storage=MemoryStorage())
    rng = np.random.default_rng(1)
    data = rng.standard_normal(layout.page_first_shape(3)).astype(ctl.transfers.host_pool.data.dtype)
    pages = ctl.alloc_device(3)
    staging = np.zeros(layout.page_first_shape(4), data.dtype)
    staging[:3] = data
    ctl.device_pool.load_pages(staging, pages)
    tokens = list(range(12))
    ctl.insert(tokens, "", pages)
    assert ctl.evict_device(3) == 3  # write_back: backed up on eviction
    m = ctl.match_prefix(tokens)
    assert (m.device_tokens, m.host_tokens) == (0, 12)
    ctl.lock(m.last_node)
    ctl.wait(ctl.load(m))
    got = np.asarray(ctl.device_pool.gather_pages(ctl.tree.device_pages_of(m.last_node)))[:3]
    assert got.tobytes() == data.tobytes()
    ctl.unlock(m.last_node)
    ctl.evict_device(3)
    ctl.evict_host(3)  # write_back to L3 on host eviction
    ctl.drain()
    m = ctl.match_prefix(tokens)
    assert m.storage_tokens == 12
    ctl.lock(m.last_node)
    assert ctl.finish_prefetch(ctl.prefetch(tokens, "", m)) == 12
    ctl.unlock(m.last_node)
    m = ctl.match_prefix(tokens)
    ctl.lock(m.last_node)
    ctl.wait(ctl.load(m))
    got = np.asarray(ctl.device_pool.gather_pages(ctl.tree.device_pages_of(m.last_node)))[:3]
    assert got.tobytes() == data.tobytes()
    ctl.unlock(m.last_node)
    ctl.check()
    ctl.close()


def test_corrupt_truncated_and_foreign_objects_are_misses(tmp_path) -> None:
    ctl, layout = _controller(2, tmp_path, storage_probe_ttl_s=0)  # the store is edited behind the controller's back
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=12).tolist()  # 6 pages
    data = rng.standard_normal(layout.page_first_shape(6)).astype(np.float32)
    pages = ctl.alloc_device(6)
    _write_device(ctl, layout, pages, data)
    ctl.insert(tokens, "", pages)
    ctl.drain()
    ctl.flush()
    store: FileStorage = ctl.storage
    keys = ctl.match_prefix(tokens).storage_keys
    assert len(keys) == 6
    # page 3 corrupt (one bit), page 4 truncated, page 5 replaced by another key's object
    blob = bytearray(_stored(store, keys[3]))
    blob[-1] ^= 1
    store.write_object(keys[3], bytes(blob))
    store.write_object(keys[4], _stored(store, keys[4])[:-5])
    store.write_object(keys[5], _stored(store, keys[0]))
    got = store.batch_get(list(keys))
    assert all(g is not None for g in got[:3]) and got[3:] == [None, None, None]
    assert store.stats().corrupt == 3
    assert store.batch_exists(list(keys)) == 3  # bad objects were removed
    m = ctl.match_prefix(tokens)
    assert m.storage_tokens == 6
    ctl.lock(m.last_node)
    assert ctl.finish_prefetch(ctl.prefetch(tokens, "", m)) == 6
    ctl.unlock(m.last_node)
    ctl.check()
    ctl.close()


def test_prefetch_stops_at_a_corrupt_object(tmp_path) -> None:
    ctl, layout = _controller(2, tmp_path)
    tokens = list(range(16))
    pages = ctl.alloc_device(8)
    _write_device(ctl, layout, pages, np.ones(layout.page_first_shape(8), np.float32))
    ctl.insert(tokens, "", pages)
    ctl.drain()
    ctl.flush()
    m = ctl.match_prefix(tokens)
    ctl.storage.write_object(m.storage_keys[5], b"garbage")
    ctl.lock(m.last_node)
    assert ctl.finish_prefetch(ctl.prefetch(tokens, "", m)) == 10  # pages 0..4 landed
    ctl.unlock(m.last_node)
    assert ctl.match_prefix(tokens).host_tokens == 10
    ctl.flush()  # back to L3 only: the same chain as the first probe, which promised 8 pages
    assert ctl.match_prefix(tokens).storage_tokens == 10  # the failed prefetch made it probe afresh
    ctl.check()
    ctl.close()


def test_crash_between_temp_write_and_rename_leaves_no_object(tmp_path, monkeypatch) -> None:
    import strata_jax.cache.storage_file as sf

    store = FileStorage(str(tmp_path / "kv"), 1 << 20)
    key = b"k" * 32

    def crash(src, dst):  # noqa: ANN001, ANN202
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(sf.os, "replace", crash)
    with pytest.raises(OSError):
        store.batch_set([key], [b"payload"])
    monkeypatch.undo()
    assert store.batch_exists([key]) == 0
    assert store.batch_get([key]) == [None]
    # a temp file left by a process killed mid-write is invisible and cleaned at start
    open(tmp_path / "kv" / "tmp" / "dead.tmp", "wb").write(b"half an object")
    again = FileStorage(str(tmp_path / "kv"), 1 << 20)
    assert again.batch_exists([key]) == 0
    assert list((tmp_path / "kv" / "tmp").iterdir()) == []
    assert again.stats().objects == 0


def test_file_storage_lru_capacity_and_sharing(tmp_path) -> None:
    from strata_jax.cache.storage import HEADER

    size = HEADER.size + 100
    store = FileStorage(str(tmp_path / "kv"), 3 * size)
    keys = [bytes([i]) * 32 for i in range(4)]
    store.batch_set(keys[:3], [b"x" * 100] * 3)
    assert store.batch_exists(keys[:1]) == 1  # touch key 0: key 1 is now LRU
    store.batch_set(keys[3:], [b"y" * 100])
    assert store.stats().evictions == 1
    assert store.batch_exists([keys[1]]) == 0
    assert store.batch_exists([keys[0], keys[2], keys[3]]) == 3
    other = FileStorage(str(tmp_path / "kv"), 3 * size)  # a second instance sees the objects
    assert other.batch_get([keys[3]]) == [b"y" * 100]
    assert store.delete([keys[0]]) == 1
    store.clear()
    assert store.stats().objects == 0 and other.batch_exists([keys[3]]) == 0


def test_storage_keys_are_namespaced(tmp_path) -> None:
    ctl, layout = _controller(4, tmp_path)
    tokens = list(range(16))
    ctl.insert(tokens, "a", ctl.alloc_device(4))
    ctl.drain()
    ctl.flush()
    assert ctl.match_prefix(tokens, "a").storage_tokens == 16
    assert ctl.match_prefix(tokens, "b").storage_tokens == 0
    ctl.close()


def _bookkeeping(policy: str, tiers: str = "L1+L2", device_pages: int = 8, **kw) -> CacheController:
    cfg = CacheConfig(
        page_size=1, device_pages=device_pages, tiers=tiers, write_policy=policy, storage_backend="memory", **kw
    )
    return CacheController.simulated(cfg)


def test_write_policies() -> None:
    wt = _bookkeeping("write_through")
    wt.insert([1, 2, 3], "", wt.alloc_device(3))
    assert wt.tree.host_pages == 3
    sel = _bookkeeping("write_through_selective", write_through_threshold=2)
    sel.insert([1, 2, 3], "", sel.alloc_device(3))
    assert sel.tree.host_pages == 0
    sel.match_prefix([1, 2, 3])
    assert sel.tree.host_pages == 0
    sel.match_prefix([1, 2, 3])  # second hit
    assert sel.tree.host_pages == 3
    wb = _bookkeeping("write_back", device_pages=4)
    wb.insert([1, 2, 3], "", wb.alloc_device(3))
    assert wb.tree.host_pages == 0
    held = wb.alloc_device(4)  # evicts: backs up on eviction
    assert wb.tree.host_pages == 3
    wb.check(device_held=held)
    assert wb.match_prefix([1, 2, 3]).host_tokens == 3
    # write_through_selective without the threshold: eviction drops the data
    sel2 = _bookkeeping("write_through_selective", device_pages=4, write_through_threshold=5)
    sel2.insert([1, 2, 3], "", sel2.alloc_device(3))
    sel2.alloc_device(4)
    assert sel2.match_prefix([1, 2, 3]).cached_tokens == 0
    for c in (wt, sel):
        c.check()


def test_locked_prefix_survives_pressure_and_full_cache_raises() -> None:
    ctl = _bookkeeping("write_through", tiers="L1", device_pages=6)
    ctl.insert([1, 2, 3, 4], "", ctl.alloc_device(4))
    m = ctl.match_prefix([1, 2, 3, 4])
    ctl.lock(m.last_node)
    with pytest.raises(CacheFullError):
        ctl.alloc_device(3)
    assert ctl.match_prefix([1, 2, 3, 4]).device_tokens == 4
    ctl.unlock(m.last_node)
    assert len(ctl.alloc_device(6)) == 6
    assert ctl.match_prefix([1, 2, 3, 4]).device_tokens == 0


def test_load_requires_lock() -> None:
    ctl = _bookkeeping("write_through")
    ctl.insert([1, 2], "", ctl.alloc_device(2))
    ctl.evict_device(2)
    m = ctl.match_prefix([1, 2])
    with pytest.raises(CacheError):
        ctl.load(m)


class SlowStorage(MemoryStorage):
    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.gate = threading.Event()

    def batch_get(self, keys):  # noqa: ANN001, ANN201
        time.sleep(self.delay * len(keys))
        return super().batch_get(keys)


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_stop_policies(policy: str) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_size=1)
    store = SlowStorage(0.002)
    cfg = CacheConfig(
        page_size=1,
        device_pages=256,
        tiers="L1+L2+L3",
        prefetch_policy=policy,
        prefetch_min_tokens=0,
        prefetch_timeout_base_s=0.02,
        prefetch_timeout_per_page_s=0.0,
    )
    ctl = CacheController.on_device(cfg, layout, storage=store)
    tokens = list(range(200))
    ctl.insert(tokens, "", ctl.alloc_device(200))
    ctl.drain()
    ctl.flush()
    m = ctl.match_prefix(tokens)
    assert m.storage_tokens == 200
    ctl.lock(m.last_node)
    t0 = time.perf_counter()
    pf = ctl.prefetch(tokens, "", m, "r")
    assert ctl.load_pending("r")
    landed = ctl.finish_prefetch(pf)
    elapsed = time.perf_counter() - t0
    ctl.unlock(m.last_node)
    if policy == "wait_complete":
        assert landed == 200
    elif policy == "timeout":
        # waited ~the 20 ms budget (plus at most one 32-page chunk), not for all 200 pages (400 ms)
        assert landed < 200 and elapsed < 0.35
    else:
        assert landed < 200
    assert ctl.match_prefix(tokens).host_tokens == landed
    assert not ctl.load_pending("r")
    ctl.check()
    ctl.close()


def test_prefetch_min_tokens_and_abort_cancels() -> None:
    cfg = CacheConfig(page_size=1, device_pages=64, tiers="L1+L2+L3", storage_backend="memory", prefetch_min_tokens=10)
    ctl = CacheController.simulated(cfg)
    ctl.insert(list(range(8)), "", ctl.alloc_device(8))
    ctl.flush()
    m = ctl.match_prefix(list(range(8)))
    assert m.storage_tokens == 8
    assert ctl.prefetch(list(range(8)), "", m, "r") is None  # shorter than prefetch_min_tokens
    ctl.check()


def test_poll_is_ready_and_bandwidth_estimate() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4)
    ctl = CacheController.on_device(CacheConfig(page_size=4, device_pages=64), layout)
    tokens = list(range(128))
    ctl.insert(tokens, "", ctl.alloc_device(32))
    ctl.drain()
    ctl.evict_device(32)
    m = ctl.match_prefix(tokens)
    ctl.lock(m.last_node)
    h = ctl.load(m, "r")
    while not ctl.is_ready(h):
        time.sleep(0.0005)
    assert not ctl.load_pending("r")
    ctl.poll()
    assert h.done
    assert ctl.link_bandwidth > 0 and ctl.link.samples == 1
    ctl.unlock(m.last_node)
    ctl.check()


def test_bandwidth_is_measured_when_the_load_lands_not_when_it_is_polled() -> None:
    """An engine polls between steps: a load noticed 0.3 s late must not read as a slow link."""
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16)  # 32 KiB pages
    ctl = CacheController.on_device(CacheConfig(page_size=16, device_pages=256), layout)
    tokens = list(range(16 * 128))  # 128 pages, 4 MiB
    ctl.insert(tokens, "", ctl.alloc_device(128))
    ctl.drain()
    ctl.evict_device(128)
    m = ctl.match_prefix(tokens)
    ctl.lock(m.last_node)
    start = time.perf_counter()
    h = ctl.load(m, "r")
    h.completion.block()
    landed = time.perf_counter() - start
    time.sleep(0.3)  # a long step before the engine polls
    ctl.poll()
    assert h.done and h.landed_at is not None and h.landed_at <= h.completed_at
    late = h.nbytes / (landed + 0.3)  # what polling time alone would have measured
    assert ctl.link_bandwidth > 2 * late, (ctl.link_bandwidth, late, h.nbytes / landed)
    ctl.unlock(m.last_node)
    ctl.close()


def test_config_validation() -> None:
    with pytest.raises(CacheConfigError):
        CacheConfig()
    with pytest.raises(CacheConfigError):
        CacheConfig(device_pages=4, tiers="L2")
    with pytest.raises(CacheConfigError):
        CacheConfig(device_pages=4, write_policy="sometimes")
    with pytest.raises(CacheConfigError):
        CacheConfig(device_pages=4, host_bytes=100).num_host_pages()
    assert CacheConfig(device_tokens=100, page_size=16).num_device_pages == 6
    assert CacheConfig(device_pages=10).num_host_pages() == 20
    assert CacheConfig(device_pages=10, tiers="L1").num_host_pages() == 0
    with pytest.raises(CacheConfigError, match="transfer_chunk_bytes"):
        CacheConfig(device_pages=4, transfer_chunk_bytes=0)


class FakeRedis:
    """Just enough of redis-py for the backend (no server here)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get(self, name: str) -> bytes | None:
        return self.data.get(name)

    def set(self, name: str, value: bytes) -> bool:
        self.data[name] = value
        return True

    def pipeline(self, transaction: bool = False):  # noqa: ANN201
        outer = self

        class Pipe:
            def __init__(self) -> None:
                self.ops = []

            def exists(self, k):  # noqa: ANN001, ANN202
                self.ops.append(lambda: int(k in outer.data))

            def set(self, k, v, nx=False):  # noqa: ANN001, ANN202
                def op():  # noqa: ANN202
                    if nx and k in outer.data:
                        return None
                    outer.data[k] = v
                    return True

                self.ops.append(op)

            def execute(self):  # noqa: ANN202
                return [op() for op in self.ops]

        return Pipe()

    def exists(self, *names):  # noqa: ANN002, ANN201
        return sum(n in self.data for n in names)

    def mget(self, names):  # noqa: ANN001, ANN201
        return [self.data.get(n) for n in names]

    def delete(self, *names):  # noqa: ANN002, ANN201
        return sum(self.data.pop(n, None) is not None for n in names)

    def scan_iter(self, match: str):  # noqa: ANN201
        prefix = match.rstrip("*")
        return [k for k in list(self.data) if k.startswith(prefix)]


def test_redis_backend_contract() -> None:
    from strata_jax.cache.storage_redis import RedisStorage

    client = FakeRedis()
    store = RedisStorage(client)
    keys = [bytes([i]) * 32 for i in range(3)]
    assert store.batch_set(keys, [b"a", b"b", b"c"]) == 3
    assert store.batch_exists(keys + [b"z" * 32]) == 3
    store.write_object(keys[1], _stored(store, keys[0]))  # foreign object
    assert store.batch_get(keys) == [b"a", None, b"c"]
    assert store.stats().corrupt == 1 and store.batch_exists(keys) == 1
    store.clear()
    assert store.batch_exists(keys) == 0


# A fixed seed, not derandomize: derandomize seeds from the function's source, so any edit of
# its body drew other examples, and the floor in test_random_workload_really_verified_hits
# depends on the examples drawn.
@seed(2)
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    tiers=st.sampled_from(["L1+L2", "L1+L2+L3"]),
    ops=st.lists(
        st.one_of(
            *[st.tuples(st.just("serve"), st.integers(0, 3), st.integers(0, 2), st.integers(0, 1))] * 6,
            st.tuples(st.just("fork"), st.integers(0, 3), st.integers(0, 12)),
            st.tuples(st.just("evict_device"), st.integers(1, 10)),
            st.tuples(st.just("evict_host"), st.integers(1, 10)),
            st.tuples(
                st.just("flush"),
            ),
        ),
        min_size=10,
        max_size=30,
    ),
    seed=st.integers(0, 1000),
)
def test_random_workload_every_hit_is_bit_exact(policy: str, tiers: str, ops: list, seed: int) -> None:
    """Random serve/evict/flush sequences with real arrays: every cached prefix read back from
    L1 (after loads and prefetches) equals what was computed for it, and accounting stays exact."""
    from strata_jax.cache.replay import CacheReplayer

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4)
    cfg = CacheConfig(
        page_size=4,
        device_pages=12,
        hicache_ratio=2.0,
        tiers=tiers,
        write_policy=policy,
        write_through_threshold=1,
        prefetch_policy="wait_complete",
        prefetch_min_tokens=0,
        transfer_chunk_bytes=2 * layout.page_bytes,  # loads of 3+ pages go in several pipelined chunks
    )
    ctl = CacheController.on_device(cfg, layout, storage=MemoryStorage())
    rep = CacheReplayer(ctl, verify=True)
    rng = np.random.default_rng(seed)
    convs: list[tuple[int, ...]] = [() for _ in range(4)]
    ctl.evict_host(0)
    for op in ops:
        if op[0] == "serve":
            _, c, new_pages, out_pages = op
            if rng.random() < 0.5:
                ctl.evict_device(ctl.device_alloc.num_pages)  # force the next hit through L2/L3
            ns = "b" if c % 2 else ""  # namespaces: a fork into the other one never hits
            prompt = convs[c] + tuple(rng.integers(0, 10_000, 4 * new_pages + 1).tolist())
            out = tuple(rng.integers(0, 10_000, 4 * out_pages).tolist())
            res = rep.serve(prompt, out, ns, request_id=c)
            if res.fit:
                convs[c] = prompt + out
        elif op[0] == "fork":
            _, c, cut = op
            convs[(c + 1) % 4] = convs[c][: 4 * cut]
        elif op[0] == "evict_device":
            ctl.evict_device(op[1])
        elif op[0] == "evict_host":
            ctl.drain()
            ctl.evict_host(op[1])
        else:
            ctl.flush()
        ctl.drain()
        ctl.check()
    _VERIFIED.append(rep.verified_pages)
    _LOADED.append(ctl.counters["loaded_pages"])
    ctl.close()


_VERIFIED: list[int] = []
_LOADED: list[int] = []


def test_random_workload_really_verified_hits() -> None:
    """Guard against a vacuous property test: the run above must have checked many pages."""
    if not _VERIFIED:
        pytest.skip("run together with test_random_workload_every_hit_is_bit_exact")
    # How much L2 holds depends on when asynchronous backups land relative to the next
    # allocation (71 verified / 41 loaded pages on a cold process, 35 / 14 after other JAX
    # work ran first), so the floor is set below both.
    assert sum(_VERIFIED) >= 20, _VERIFIED
    assert sum(_LOADED) >= 10, (sum(_LOADED), _LOADED)  # hits really came back through L2 (and L3)


def test_engine_life_cycle_transient_owners_and_cache_unfinished() -> None:
    ctl = _bookkeeping("write_through", device_pages=32)
    ctl.insert([1, 2, 3], "", ctl.alloc_device(3))
    a = ctl.match_prefix([1, 2, 3, 4, 5, 6], requester="A")
    ctl.lock(a.last_node)
    ctl.insert_transient([1, 2, 3, 4, 5, 6], "", "A")
    ctl.mark_in_flight("A")
    b = ctl.match_prefix([1, 2, 3, 4, 5, 6, 7], requester="B")
    assert (b.device_tokens, b.transient_tokens, b.transient_owners) == (3, 3, ("A",))
    own = ctl.match_prefix([1, 2, 3, 4, 5, 6], requester="A")
    assert own.transient_tokens == 0 and own.transient_owners == ()  # never waits for itself
    # A's prefill lands while A keeps decoding: it computed pages 4..6 into its own pages
    table = list(a.device_page_ids) + ctl.alloc_device(3)
    lock, new_table = ctl.cache_unfinished([1, 2, 3, 4, 5, 6], "", table, a.last_node)
    assert new_table == table and ctl.tree.owned_tokens("A") == 0
    assert ctl.match_prefix([1, 2, 3, 4, 5, 6, 7], requester="B").device_tokens == 6
    ctl.evict_device(100)
    assert ctl.match_prefix([1, 2, 3, 4, 5, 6]).device_tokens == 6  # locked by A
    ctl.unlock(lock)
    ctl.finish_request("A")
    # B aborts after queueing its own suffix: its transient nodes disappear
    ctl.insert_transient([1, 2, 3, 4, 5, 6, 7, 8], "", "B")
    assert ctl.abort("B") == 2
    assert ctl.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).transient_tokens == 0
    ctl.check()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_evictable_device_tokens_is_what_eviction_frees(policy: str) -> None:
    """Brute force over random serving histories: after every operation,
    ``evictable_device_tokens`` (what the scheduler plans with) equals what evicting
    everything frees (on a copy of the controller).

    L1 eviction once kept a device-only node that had host-only children (write-back
    with an L2 too small for the parent's backup, say), so the count overstated what
    eviction could free and admitted work then failed to allocate; now such a node
    goes and takes its host-only subtree with it.  (With the old eviction this test
    fails within the first seeds of write-back.)
    """
    import copy

    for trial in range(60):
        rng = np.random.default_rng(trial)
        cfg = CacheConfig(
            page_size=2,
            device_pages=24,
            hicache_ratio=0.25,
            tiers="L1+L2",
            write_policy=policy,
            write_through_threshold=2,
            storage_backend="memory",
        )
        ctl = CacheController.simulated(cfg)
        stems = [rng.integers(0, 5, 4).tolist() for _ in range(4)]  # shared first pages: a branchy tree
        inserted: list[list[int]] = []
        locks: list = []
        for step in range(40):
            op = int(rng.integers(0, 7))
            if op <= 1:  # a new conversation on a shared stem, or the next turn of an old one
                base = (
                    inserted[int(rng.integers(len(inserted)))] if op == 1 and inserted else stems[int(rng.integers(4))]
                )
                tokens = base + rng.integers(0, 3, 2 * int(rng.integers(1, 5))).tolist()
                inserted.append(tokens)
                m = ctl.match_prefix(tokens, "")
                ctl.lock(m.last_node)
                have = ctl.tree.device_pages_of(m.last_node)
                try:
                    pages = ctl.alloc_device(len(tokens) // 2 - len(have))
                except CacheFullError:
                    ctl.unlock(m.last_node)
                    continue
                ctl.insert(tokens, "", have + pages)
                ctl.unlock(m.last_node)
            elif op == 2:
                ctl.evict_device(int(rng.integers(1, 7)))
            elif op == 3:
                ctl.evict_host(int(rng.integers(1, 7)))
            elif op == 4:  # a waiting request's queued continuation
                ctl.insert_transient(stems[int(rng.integers(4))] + [9, 9], "", owner=("q", trial, step))
            elif op == 5 and inserted:  # a running request pins its prefix
                m = ctl.match_prefix(inserted[int(rng.integers(len(inserted)))], "")
                if m.last_node.parent is not None and not m.last_node.is_transient:
                    ctl.lock(m.last_node)
                    locks.append(m.last_node)
            elif locks:
                ctl.unlock(locks.pop(int(rng.integers(len(locks)))))
            ctl.drain()
            want = copy.deepcopy(ctl).evict_device(1 << 30) * cfg.page_size
            assert ctl.evictable_device_tokens() == want, (trial, step)
            ctl.check()
        ctl.close()


class _CountingStorage(MemoryStorage):
    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    def batch_exists(self, keys):  # noqa: ANN001, ANN201
        self.probes += 1
        return super().batch_exists(keys)


def test_storage_probes_are_reused_within_the_ttl_and_redone_after_own_writes() -> None:
    """Waiting requests are re-matched every round: with L3 each match would probe the
    backend (a network round trip with Redis).  A probe is reused for
    ``storage_probe_ttl_s``, except that this instance's own writes invalidate it."""
    now = [0.0]
    store = _CountingStorage()
    cfg = CacheConfig(page_size=2, device_pages=16, tiers="L1+L2+L3", storage_backend="memory", storage_probe_ttl_s=0.5)
    ctl = CacheController.simulated(cfg, storage=store, clock=lambda: now[0])
    tokens = list(range(12))
    assert [ctl.match_prefix(tokens, "", touch=False).storage_tokens for _ in range(50)] == [0] * 50
    assert store.probes == 1
    now[0] = 0.6  # past the TTL: probed again
    ctl.match_prefix(tokens, "", touch=False)
    assert store.probes == 2
    ctl.insert(tokens, "", ctl.alloc_device(6))  # write-through reaches L3 (bookkeeping: at once)
    ctl.drain()
    ctl.flush()  # L1 and L2 forget it: only L3 has it
    assert ctl.match_prefix(tokens, "", touch=False).storage_tokens == 12  # our write invalidated the memo
    probes = store.probes
    ctl.match_prefix(tokens, "", touch=False)
    assert store.probes == probes
    ctl.clear_storage()
    assert ctl.match_prefix(tokens, "", touch=False).storage_tokens == 0  # clearing forgets the probes too
    zero = CacheController.simulated(
        CacheConfig(page_size=2, device_pages=16, tiers="L1+L2+L3", storage_backend="memory", storage_probe_ttl_s=0),
        storage=_CountingStorage(),
    )
    for _ in range(3):
        zero.match_prefix(tokens, "", touch=False)
    assert zero.storage.probes == 3
    with pytest.raises(CacheConfigError, match="storage_probe_ttl_s"):
        CacheConfig(device_pages=4, storage_probe_ttl_s=-1)


def test_storage_key_memo_holds_a_long_queue(monkeypatch) -> None:
    """The hash chains of many waiting prompts stay memoized (a 16-entry bound once made
    a longer queue rehash every prompt every round)."""
    from strata_jax.cache import storage_service as controller_module  # where the key chain is hashed

    cfg = CacheConfig(page_size=2, device_pages=16, tiers="L1+L2+L3", storage_backend="memory", storage_probe_ttl_s=0)
    ctl = CacheController.simulated(cfg, storage=MemoryStorage())
    prompts = [[i] * 64 for i in range(100)]
    calls = []
    real = controller_module.chain_hashes

    def counting(*args):  # noqa: ANN002, ANN202
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(controller_module, "chain_hashes", counting)
    for _ in range(3):  # three scheduling rounds over a 100-request queue
        for p in prompts:
            ctl.match_prefix(p, "", touch=False)
    assert len(calls) == 100


class _FailingStorage(MemoryStorage):
    """A backend whose disk filled up: writes and reads raise."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def batch_set(self, keys, payloads):  # noqa: ANN001, ANN201
        if self.fail:
            raise OSError(28, "No space left on device")
        return super().batch_set(keys, payloads)

    def batch_get(self, keys):  # noqa: ANN001, ANN201
        if self.fail:
            raise OSError(5, "Input/output error")
        return super().batch_get(keys)


def test_failing_storage_is_counted_and_served_as_misses(caplog) -> None:
    """A full disk (or any L3 error) must neither kill the engine thread nor vanish
    silently: the write is dropped, a read stops the prefetch, both are counted."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4)
    store = _FailingStorage()
    cfg = CacheConfig(
        page_size=4, device_pages=32, tiers="L1+L2+L3", prefetch_policy="wait_complete", prefetch_min_tokens=0
    )
    ctl = CacheController.on_device(cfg, layout, storage=store)
    rng = np.random.default_rng(0)
    stored = rng.integers(0, 1000, 32).tolist()
    ctl.insert(stored, "", ctl.alloc_device(8))  # written to L3 while the disk is fine
    ctl.drain()
    store.fail = True
    other = rng.integers(0, 1000, 32).tolist()
    with caplog.at_level("WARNING", logger="strata_jax.cache.controller"):
        ctl.insert(other, "", ctl.alloc_device(8))  # its L3 write raises in the I/O thread
        ctl.drain()
        ctl.flush()  # only L3 could have them now
        assert ctl.match_prefix(other).storage_tokens == 0  # never written
        m = ctl.match_prefix(stored)
        assert m.storage_tokens == 32
        ctl.lock(m.last_node)
        assert ctl.finish_prefetch(ctl.prefetch(stored, "", m, "r")) == 0  # the read raised: nothing landed
        ctl.unlock(m.last_node)
    assert ctl.counters["storage_errors"] == 2
    assert any("carrying on without it" in r.getMessage() for r in caplog.records)
    ctl.check()
    ctl.close()


def test_pages_a_request_prefetched_from_l3_are_not_written_back_to_l3(tmp_path) -> None:
    """A request's prompt pages come from L3 into the transient nodes its admission queued
    (what the engine does): those nodes are backed by L3 from then on, so handing the
    request's pages to the tree (write_through) writes nothing to L3 again."""
    ps = 4
    ctl, layout = _controller(ps, tmp_path, device_pages=32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=6 * ps).tolist()
    pages = ctl.alloc_device(6)
    _write_device(ctl, layout, pages, rng.standard_normal(layout.page_first_shape(6)).astype(np.float32))
    ctl.insert(tokens, "t", pages)  # write_through: L1 -> L2 -> L3
    ctl.drain()
    ctl.flush()  # only L3 holds them
    written = ctl.stats()["storage_written_pages"]
    assert written == 6
    ctl.insert_transient(tokens, "t", "req")  # the request's admission
    m = ctl.match_prefix(tokens, "t", requester="req")
    assert m.storage_tokens == 6 * ps
    ctl.lock(m.last_node)
    assert ctl.finish_prefetch(ctl.prefetch(tokens, "t", m, "req")) == 6 * ps
    ctl.unlock(m.last_node)
    node = ctl.tree.match_prefix(tokens, "t", touch=False).last_node
    assert all(n.storage_backed for n in _path(node))  # every node the prefetch filled
    m = ctl.match_prefix(tokens, "t", requester="req")
    ctl.lock(m.last_node)
    ctl.wait(ctl.load(m, "req"))
    ctl.mark_in_flight("req")
    table = ctl.tree.device_pages_of(m.last_node)
    lock, _ = ctl.cache_unfinished(tokens, "t", table, m.last_node)  # the request's pages go to the tree
    ctl.unlock(lock)
    ctl.finish_request("req")
    ctl.drain()
    assert ctl.stats()["storage_written_pages"] == written  # nothing written to L3 again
    ctl.check()
    ctl.close()
