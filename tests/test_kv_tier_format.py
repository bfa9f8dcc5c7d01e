"""Quantized KV tier formats (issue 20): fp8 / int8 with scales in L2 and L3.

* the kernels (pure-JAX reference and Pallas in interpret mode) against a plain NumPy
  re-implementation of the quantization formula, and lowering for CUDA and ROCm;
* the controller: L1 -> L2 -> L3 -> L2 -> L1 gives exactly NumPy's quantize-dequantize
  of the data; bytes per token from the pools' own counters;
* L3 objects carry their format: another format is another key, a forged header, a
  corrupted scale or a truncated object is a miss (and through the engine: the tokens
  of a cold run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import quant_transfer as qt
from pallas_kernels.aot import lower_for_gpu
from pallas_kernels.layout import KVLayout
from strata_jax.cache.config import CacheConfig, CacheConfigError
from strata_jax.cache.controller import CacheController
from strata_jax.cache.pools import bucket
from strata_jax.cache.tier_format import PAGE_HEADER, TierFormat, TierFormatError

FORMATS = ("fp8", "int8")


# ---------------------------------------------------------------------------------------
# NumPy re-implementation of the formula (independent of the JAX code)


def np_quantize(pages: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """pages[n, L, 2, S, H, D] -> (q, scales[n, L, 2, H]) as documented in quant_transfer."""
    limit = 448.0 if fmt == "fp8" else 127.0
    x = pages.astype(np.float32)
    amax = np.abs(x).max(axis=(3, 5))
    scales = np.where(amax > 0, amax * (np.float32(1) / np.float32(limit)), np.float32(1.0)).astype(np.float32)
    inv = (np.float32(1) / scales)[:, :, :, None, :, None]
    y = np.clip(x * inv, -limit, limit).astype(np.float32)
    if fmt == "fp8":
        return y.astype(ml_dtypes.float8_e4m3fn), scales
    return np.floor(y + np.float32(0.5)).astype(np.int8), scales


def np_dequantize(q: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:  # noqa: ANN001
    return (q.astype(np.float32) * scales[:, :, :, None, :, None]).astype(dtype)


def _f32(a) -> np.ndarray:  # noqa: ANN001
    return np.asarray(a).astype(np.float32)


def _pages(seed: int, shape, dtype=np.float32) -> np.ndarray:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= rng.uniform(0.01, 50.0, size=(*shape[:3], 1, shape[4], 1)).astype(np.float32)  # heads of very different sizes
    return x.astype(dtype)


# ---------------------------------------------------------------------------------------
# Kernels


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", (1, 16, 64))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_gather_quantize_matches_numpy(fmt, page_size, dtype):
    layers, heads, dim, num_pages = 2, 3, 16, 9
    np_dtype = np.dtype(jnp.dtype(dtype))
    pool_np = _pages(page_size, (layers, 2, num_pages, page_size, heads, dim), np_dtype)
    pool_np[:, :, 4] = 0  # an all-zero page: scale 1, values 0
    pool = jnp.asarray(pool_np)
    ids = np.array([4, 0, 8, 3, 100], np.int32)  # 100: clipped to the last page, like gather_pages
    staged = np.transpose(pool_np[:, :, np.clip(ids, 0, num_pages - 1)], (2, 0, 1, 3, 4, 5))
    want_q, want_s = np_quantize(staged, fmt)
    for q, s in (
        qt.gather_quantize_reference(pool, jnp.asarray(ids), fmt),
        qt.gather_quantize_pallas(pool, jnp.asarray(ids), fmt, interpret=True),
        jax.jit(lambda p, i: qt.gather_quantize(p, i, fmt, backend="interpret"))(pool, jnp.asarray(ids)),
    ):
        assert q.dtype == qt.quantized_dtype(fmt) and q.shape == staged.shape and s.shape == (5, layers, 2, heads)
        np.testing.assert_array_equal(np.asarray(s), want_s)
        np.testing.assert_array_equal(_f32(q), _f32(want_q))
    assert (np.asarray(s)[0] == 1).all() and (_f32(q)[0] == 0).all()
    assert np.isfinite(_f32(q)).all()  # the clip keeps fp8 off its NaN code


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", (1, 16))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_scatter_dequantize_matches_numpy_and_writes_only_named_pages(fmt, page_size, dtype):
    layers, heads, dim, num_pages, n = 2, 2, 32, 11, 6
    staged = _pages(7 + page_size, (n, layers, 2, page_size, heads, dim))
    q_np, s_np = np_quantize(staged, fmt)
    ids = np.array([3, -1, 0, 11, 7, 5], np.int32)  # -1: the last page; 11: out of range, dropped
    pool = jnp.full((layers, 2, num_pages, page_size, heads, dim), jnp.nan, dtype)
    want = np.full(pool.shape, np.nan, np.float32)
    deq = _f32(np_dequantize(q_np, s_np, np.dtype(jnp.dtype(dtype))))
    for row, page in enumerate(ids):
        if -num_pages <= page < num_pages:
            want[:, :, page] = deq[row]
    for got in (
        qt.scatter_dequantize_reference(pool, jnp.asarray(q_np), jnp.asarray(s_np), jnp.asarray(ids)),
        qt.scatter_dequantize_xla(pool, jnp.asarray(q_np), jnp.asarray(s_np), jnp.asarray(ids)),
        qt.scatter_dequantize_pallas(pool, jnp.asarray(q_np), jnp.asarray(s_np), jnp.asarray(ids), interpret=True),
    ):
        assert got.dtype == pool.dtype
        np.testing.assert_array_equal(_f32(got), want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", (5, qt._UNROLL_MAX_PAGES + 6))  # unrolled, and the loop
def test_xla_scatter_dequantize_is_the_reference_in_place(fmt, n):
    """The CPU load path (one in-place update per page, donated pool) writes exactly what the
    reference writes, with padding ids (out of range, also past a wrapped negative) dropped,
    and the page before it untouched."""
    layers, heads, dim, page_size, num_pages = 2, 2, 16, 2, 96
    rng = np.random.default_rng(n)
    q, s = qt.quantize_pages_reference(jnp.asarray(_pages(n, (n, layers, 2, page_size, heads, dim))), fmt)
    ids = rng.choice(num_pages - 1, n, replace=False).astype(np.int32)  # the last page stays unnamed
    ids[1], ids[2], ids[3] = num_pages, -num_pages - 1, -2  # dropped, dropped, wraps to num_pages - 2
    ids[ids == num_pages - 2] = num_pages + 7  # keep -2 the only writer of its page
    ids[3] = -2
    pool = jnp.asarray(rng.standard_normal((layers, 2, num_pages, page_size, heads, dim)).astype(np.float32))
    want = np.asarray(qt.scatter_dequantize_reference(pool, q, s, jnp.asarray(ids)))
    got = np.asarray(jax.jit(qt.scatter_dequantize_xla, donate_argnums=0)(jnp.array(pool), q, s, jnp.asarray(ids)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:, :, -1], np.asarray(pool)[:, :, -1])
    assert not np.array_equal(got[:, :, num_pages - 2], np.asarray(pool)[:, :, num_pages - 2])


def test_quantization_error_is_within_half_a_step():
    """Round trip error per element <= half a quantization step (int8) / relative 2^-4 (fp8)."""
    x = _pages(3, (4, 2, 2, 16, 3, 64))
    for fmt in FORMATS:
        q, s = qt.quantize_pages_reference(jnp.asarray(x), fmt)
        back = np.asarray(qt.dequantize_pages_reference(q, s, jnp.float32))
        step = np.asarray(s)[:, :, :, None, :, None]
        err = np.abs(back - x)
        if fmt == "int8":
            assert (err <= 0.5 * step * (1 + 1e-5)).all()
        else:  # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, absolute <= 2^-10 * scale below
            assert (err <= np.maximum(np.abs(x) * 2.0**-4, step * 2.0**-10) * (1 + 1e-5)).all()


@pytest.mark.parametrize("platform", ("cuda", "rocm"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size,dtype", [(1, jnp.bfloat16), (16, jnp.bfloat16), (64, jnp.float32)])
def test_quantizing_transfer_kernels_lower_for_gpus(platform, fmt, page_size, dtype):
    pool = jax.ShapeDtypeStruct((4, 2, 32, page_size, 8, 128), dtype)
    ids = jax.ShapeDtypeStruct((5,), jnp.int32)
    q = jax.ShapeDtypeStruct((5, 4, 2, page_size, 8, 128), qt.quantized_dtype(fmt))
    scales = jax.ShapeDtypeStruct((5, 4, 2, 8), jnp.float32)
    text = lower_for_gpu(lambda p, i: qt.gather_quantize_pallas(p, i, fmt), pool, ids, platform=platform).as_text()
    assert "__gpu$xla.gpu.triton" in text
    text = lower_for_gpu(
        qt.scatter_dequantize_pallas, pool, q, scales, ids, platform=platform, donate_argnums=(0,)
    ).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "tf.aliasing_output = 0" in text and "output_operand_aliases" in text  # in place, no pool copy


def test_backend_selection_and_unsupported_head_dim_use_the_reference():
    assert qt._implementation("reference", 64) == "reference"
    assert qt._implementation("xla", 64) == qt._implementation("xla", 80) == "xla"
    assert qt._implementation("interpret", 64) == "interpret"
    assert qt._implementation("interpret", 80) == "reference"  # Triton blocks need a power-of-two head_dim
    with pytest.raises(qt.UnknownTierFormatError):
        qt.quantized_dtype("fp4")


# ---------------------------------------------------------------------------------------
# Formats, config, sizes


def test_tier_format_resolution_sizes_and_config():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype="bfloat16")
    full, fp8, int8 = (TierFormat.resolve(n, "bfloat16") for n in ("full", "fp8", "int8"))
    assert full.page_bytes(layout) == layout.page_bytes and not full.quantized
    for f in (fp8, int8):
        # values: half of bf16; scales: one float32 per (layer, K/V, head) per page
        assert f.page_bytes(layout) == layout.page_bytes // 2 + 4 * 30 * 2 * 3
        assert f.page_bytes(layout) / layout.page_bytes == pytest.approx(0.5 + 2 / (16 * 64))
    assert TierFormat.resolve("fp8", "float8_e4m3fn").name == "full"  # already fp8: nothing to quantize
    assert TierFormat.resolve("int8", jnp.float32).l1_dtype == "float32"
    assert (
        fp8.object_key(b"k" * 32) != int8.object_key(b"k" * 32) != b"k" * 32 and full.object_key(b"k" * 32) == b"k" * 32
    )
    with pytest.raises(TierFormatError):
        TierFormat.resolve("fp4", "float32")
    with pytest.raises(CacheConfigError, match="kv_tier_format"):
        CacheConfig(device_pages=4, kv_tier_format="fp4")
    # the same L2 byte budget holds more quantized pages
    cfg = CacheConfig(device_pages=10, hicache_ratio=2.0)
    assert cfg.num_host_pages(1000, 1000) == 20 and cfg.num_host_pages(500, 1000) == 40


def test_engine_config_flags():
    from strata_jax.api import InvalidRequestError
    from strata_jax.engine import EngineConfig

    cfg = EngineConfig(kv_tier_format="int8")
    assert cfg.cache_config(512).kv_tier_format == "int8"
    assert EngineConfig(kv_dtype="fp8", kv_tier_format="int8").kv_dtype == "fp8"  # an fp8 L1 (test_kv_fp8_l1.py)
    with pytest.raises(InvalidRequestError, match="kv_tier_format"):
        EngineConfig(kv_tier_format="q4")
    from serving.server_cli import engine_flag_fields

    assert "kv_tier_format" in {path for path, _f, _d in engine_flag_fields(EngineConfig)}  # -> serve --kv-tier-format


# ---------------------------------------------------------------------------------------
# Controller: round trips through every tier, counters


def _controller(tmp_path, fmt, *, ps=4, dtype="float32", device_pages=24, storage_dir=None, **kw):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=ps, dtype=dtype)
    cfg = CacheConfig(
        page_size=ps,
        device_pages=device_pages,
        tiers="L1+L2+L3",
        write_policy="write_through",
        prefetch_policy="wait_complete",
        prefetch_min_tokens=0,
        storage_backend="file",
        storage_dir=str(storage_dir or tmp_path / "kv"),
        kv_tier_format=fmt,
        storage_probe_ttl_s=0,
        **kw,
    )
    return CacheController.on_device(cfg, layout), layout


def _store(ctl, layout, tokens, data):  # noqa: ANN001
    n = data.shape[0]
    pages = ctl.alloc_device(n)
    staging = np.zeros(layout.page_first_shape(bucket(n)), data.dtype)
    staging[:n] = data
    ctl.device_pool.load_pages(staging, pages)
    ctl.insert(tokens, "", pages)
    ctl.drain()


def _from_l3_to_device(ctl, tokens):  # noqa: ANN001
    """Prefetch L3 -> L2, load L2 -> L1; the device pages' contents (page-first) and tokens landed."""
    m = ctl.match_prefix(tokens)
    ctl.lock(m.last_node)
    pf = ctl.prefetch(tokens, "", m)
    landed = ctl.finish_prefetch(pf) if pf is not None else 0
    ctl.unlock(m.last_node)
    m = ctl.match_prefix(tokens)
    ctl.lock(m.last_node)
    ctl.wait(ctl.load(m))
    pages = ctl.tree.device_pages_of(m.last_node)
    got = np.asarray(ctl.device_pool.gather_pages(pages))[: len(pages)] if pages else None
    ctl.unlock(m.last_node)
    return got, landed


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_round_trip_through_every_tier_is_numpys_quantize_dequantize(tmp_path, fmt, dtype):
    tier_page = TierFormat.resolve(fmt, dtype).page_bytes(KVLayout(2, 2, 16, 4, dtype))
    ctl, layout = _controller(tmp_path, fmt, dtype=dtype, transfer_chunk_bytes=2 * tier_page)
    # the chunk budget counts staged (tier format) bytes: 2 pages here (1 at full width), so
    # the 7 pages go in 4 chunks
    assert ctl.transfers.chunk_pages() == 2 and layout.page_bytes > tier_page
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 1000, size=7 * 4 + 2).tolist()
    data = _pages(11, layout.page_first_shape(7), np_dtype)
    _store(ctl, layout, tokens, data)
    want_q, want_s = np_quantize(data, fmt)
    node = ctl.tree.match_prefix(tokens, touch=False).last_node
    host = list(node.host)
    np.testing.assert_array_equal(_f32(ctl.transfers.host_pool.read(host)), _f32(want_q))  # L2 holds the 8-bit values
    np.testing.assert_array_equal(ctl.transfers.host_pool.read_scales(host), want_s)
    ctl.flush()  # only L3 is left
    got, landed = _from_l3_to_device(ctl, tokens)
    assert landed == 28
    np.testing.assert_array_equal(_f32(got), _f32(np_dequantize(want_q, want_s, np_dtype)))
    # bytes per token from the pools' own counters
    s = ctl.stats()
    full = layout.token_bytes
    per_token = TierFormat.resolve(fmt, dtype).page_bytes(layout) / layout.page_size
    assert s["device_bytes_per_token"] == full and s["tier_format"] == fmt
    assert s["host_bytes_per_token"] == s["load_bytes_per_token"] == s["backup_bytes_per_token"] == per_token
    scale_overhead = 4 / (layout.page_size * layout.head_dim * (4 if dtype == "float32" else 2))
    limit = (0.25 if dtype == "float32" else 0.5) + scale_overhead
    assert per_token / full == pytest.approx(limit)
    assert s["storage_bytes_per_token"] == pytest.approx(per_token + (PAGE_HEADER.size + 80) / layout.page_size)
    ctl.check()
    ctl.close()


def test_objects_of_another_format_are_other_keys_and_forged_headers_are_misses(tmp_path):
    store_dir = tmp_path / "shared"
    tokens = list(range(6 * 4))
    data = _pages(5, (6, 2, 2, 4, 2, 16))
    ctl, layout = _controller(tmp_path, "fp8", storage_dir=store_dir)
    _store(ctl, layout, tokens, data)
    ctl.close()
    for other in ("int8", "full"):  # same directory, same chain keys: nothing found
        c2, _ = _controller(tmp_path, other, storage_dir=store_dir)
        assert c2.match_prefix(tokens).storage_tokens == 0
        c2.close()
    c3, _ = _controller(tmp_path, "fp8", storage_dir=store_dir)  # same format: every page found
    got, landed = _from_l3_to_device(c3, tokens)
    assert landed == 24
    q, s = np_quantize(data, "fp8")
    np.testing.assert_array_equal(_f32(got), np_dequantize(q, s, np.float32))
    # an int8 page under the fp8 key of page 2 (valid frame, checksum right): the header says int8 -> a miss
    c3.flush()
    keys = c3.match_prefix(tokens).storage_keys
    int8_payload = TierFormat.resolve("int8", "float32").header(layout) + bytes(
        TierFormat.resolve("int8", "float32").page_bytes(layout)
    )
    c3.storage.delete([c3.transfers.tier_format.object_key(keys[2])])
    c3.storage.batch_set([c3.transfers.tier_format.object_key(keys[2])], [int8_payload])
    got, landed = _from_l3_to_device(c3, tokens)
    assert landed == 8 and c3.counters["storage_format_misses"] == 1  # pages 0, 1 only
    c3.close()


@pytest.mark.parametrize("damage", ("scale", "truncate", "nan_scale"))
def test_corrupted_scale_and_truncated_object_are_misses(tmp_path, damage):
    ctl, layout = _controller(tmp_path, "int8")
    tokens = list(range(5 * 4))
    data = _pages(9, (5, 2, 2, 4, 2, 16))
    _store(ctl, layout, tokens, data)
    ctl.flush()
    keys = ctl.match_prefix(tokens).storage_keys
    key = ctl.transfers.tier_format.object_key(keys[3])
    blob = bytearray(ctl.storage.read_object(key) or b"")
    if damage == "scale":
        blob[-3] ^= 0x40  # a byte of the last scale: the checksum catches it
    elif damage == "truncate":
        blob = blob[:-100]
    else:  # a NaN scale with a *valid* checksum (a writer bug, not a bit flip): refused too
        from strata_jax.cache.storage import HEADER, decode_object, encode_object

        payload = bytearray(decode_object(ctl.transfers.tier_format.object_key(keys[3]), bytes(blob)))
        payload[-4:] = np.float32(np.nan).tobytes()
        blob = bytearray(encode_object(ctl.transfers.tier_format.object_key(keys[3]), bytes(payload)))
        assert len(blob) == HEADER.size + len(payload)
    ctl.storage.write_object(key, bytes(blob))
    got, landed = _from_l3_to_device(ctl, tokens)
    assert landed == 12  # pages 0..2
    ctl.check()
    ctl.close()


# ---------------------------------------------------------------------------------------
# Engine: L3 shared by servers of one format; damaged objects give the cold run's tokens


def _engine(tmp_path, fmt, **kw):
    from strata_jax.engine import Engine, EngineConfig

    return Engine(
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
            kv_tier_format=fmt,
            **kw,
        )
    )


def test_engine_l3_in_a_quantized_format_is_shared_and_damage_means_cold_tokens(tmp_path):
    from strata_jax.api import SamplingParams

    prompt = np.random.default_rng(5).integers(3, 250, size=200).tolist()
    params = SamplingParams(max_tokens=6)

    def run(fmt, damage=None):  # noqa: ANN001, ANN202
        engine = _engine(tmp_path, fmt)
        try:
            if damage is not None:
                damage(engine)
            out = engine.generate([prompt], params)[0]
            engine.ctl.drain()
            return out, engine.ctl.stats()
        finally:
            engine.shutdown()

    cold, stats = run("int8")  # writes L3 in int8
    assert stats["host_bytes_per_token"] / stats["device_bytes_per_token"] < 0.26
    warm, _ = run("int8")  # another server, same format: reads it
    assert warm.cached_tokens["storage"] == 192
    other, _ = run("fp8")  # another format: other keys, a miss, a cold run's tokens
    assert other.cached_tokens["storage"] == 0 and other.token_ids == cold.token_ids

    def damage(page, how):  # noqa: ANN001, ANN202
        def apply(engine):  # noqa: ANN001, ANN202
            ctl = engine.ctl
            key = ctl.transfers.tier_format.object_key(ctl.match_prefix(prompt).storage_keys[page])
            blob = bytearray(ctl.storage.read_object(key) or b"")
            if how == "scale":
                blob[-2] ^= 0x10  # inside the last scale
            else:
                blob = blob[:-9]
            ctl.storage.write_object(key, bytes(blob))

        return apply

    for how in ("scale", "truncate"):
        hurt, stats = run("int8", damage(0, how))  # the first page unreadable: nothing usable
        assert hurt.cached_tokens["storage"] == 0 and hurt.token_ids == cold.token_ids, how
        assert stats["storage"]["corrupt"] == 1
    hurt, _ = run("int8", damage(5, "truncate"))  # later pages: what precedes is used, the rest recomputed
    assert 0 < hurt.cached_tokens["storage"] < 192


# ---------------------------------------------------------------------------------------
# Tensor parallelism: a head-sharded pool quantizes / dequantizes per shard, same bytes


@pytest.mark.parametrize("backend", ("reference", "interpret"))
def test_head_sharded_pool_moves_the_same_quantized_pages(backend):
    from strata_jax.cache.pools import DevicePool, HostPool
    from strata_jax.runtime.sharding import make_mesh, pool_sharding

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 host devices")
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, page_size=4)
    fmt = TierFormat.resolve("int8", "float32")
    data = _pages(21, layout.page_first_shape(6))
    q, s = np_quantize(data, "int8")
    host = HostPool.from_array(layout, q, s, fmt)
    want = np_dequantize(q, s, np.float32)
    pools = [
        DevicePool(layout, 12, kernel_backend=backend, tier_format=fmt),
        DevicePool(layout, 12, pool_sharding(make_mesh(2)), kernel_backend=backend, tier_format=fmt),
    ]
    dev_pages = [7, 2, 9, 0, 11, 5]
    for pool in pools:
        for a in pool.load_from_host(host, list(range(6)), dev_pages, chunk_pages=4):
            a.block_until_ready()
        got = np.transpose(np.asarray(pool.kv)[:, :, dev_pages], (2, 0, 1, 3, 4, 5))
        np.testing.assert_array_equal(got, want)
        back_q, back_s = (np.asarray(a)[:6] for a in pool.gather_tier(dev_pages))
        again_q, again_s = np_quantize(want, "int8")  # a backup of those pages: NumPy's quantization of them
        np.testing.assert_array_equal(back_s, again_s)
        np.testing.assert_array_equal(back_q, again_q)
        assert pool.moved["loaded_bytes"] == 6 * fmt.page_bytes(layout)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_kernels_match_the_reference_on_a_gpu(fmt):
    """On a GPU: the Triton kernels against the reference (the division's reciprocal may
    differ in the last bit on a GPU, so a value may sit one quantization step away)."""
    pool = jnp.asarray(_pages(4, (4, 2, 16, 16, 8, 128)), jnp.bfloat16)
    ids = jnp.asarray([3, 0, 15, 7], jnp.int32)
    q_ref, s_ref = qt.gather_quantize_reference(pool, ids, fmt)
    q, s = jax.jit(lambda p, i: qt.gather_quantize_pallas(p, i, fmt))(pool, ids)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-6)
    steps = np.abs(_f32(q) - _f32(q_ref))
    assert (steps <= (1.0 if fmt == "int8" else np.maximum(np.abs(_f32(q_ref)) / 8, 2.0**-9))).all()
    dst = jnp.zeros_like(pool)
    got = jax.jit(qt.scatter_dequantize_pallas, donate_argnums=0)(dst, q_ref, s_ref, ids)
    want = qt.scatter_dequantize_reference(jnp.zeros_like(pool), q_ref, s_ref, ids)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Simulator: loads move, and L2 holds, the tier's bytes


def test_simulator_counts_the_tier_formats_bytes():
    from strata_jax.sim import workloads as W
    from strata_jax.sim.cost import SimCostModel
    from strata_jax.sim.model_spec import load_model_spec
    from strata_jax.sim.profile import load_profile
    from strata_jax.sim.runner import SimSetup, simulate
    from strata_jax.sim.systems import get_system

    model, h200 = load_model_spec("llama-3.1-8b"), load_profile("h200")
    c = model.config
    assert model.tier_page_bytes(32, "fp8") == c.num_layers * 2 * c.num_kv_heads * (32 * c.head_dim + 4)
    full, fp8 = SimCostModel(h200, model, 32), SimCostModel(h200, model, 32, "fp8")
    assert fp8.tier_page_bytes / full.tier_page_bytes == pytest.approx(0.5 + 2 / (32 * 128))
    p = h200
    for pages in (1, 64, 700):  # coalesced: fixed overhead + bytes at the path's efficiency
        want = p.transfer_overhead_s + pages * fp8.tier_page_bytes / (p.link_peak_bytes_per_s * p.coalesced_efficiency)
        assert fp8.link_seconds(pages, "coalesced") == pytest.approx(want)
        assert fp8.storage_read_seconds(pages) == pytest.approx(
            full.storage_read_seconds(pages) * fp8.tier_page_bytes / full.tier_page_bytes
        )
    assert fp8.host_kv_tokens() == pytest.approx(2 * full.host_kv_tokens(), rel=2e-3)  # same bytes, half per token
    # a run: same tokens loaded, half the bytes per loaded page
    reqs = W.multiturn(num_requests=40, rate=4.0, seed=3)
    runs = {}
    for fmt in ("full", "fp8"):
        setup = SimSetup(model, h200, device_tokens=20_000, host_tokens=200_000, tier_format=fmt)
        runs[fmt] = simulate(reqs, get_system("strata"), setup, 4.0)
    assert runs["full"].extra["loaded_pages"] > 0 and runs["full"].finished == runs["fp8"].finished == 40
    assert runs["fp8"].extra["h2d_link_busy_s"] < 0.6 * runs["full"].extra["h2d_link_busy_s"]


def test_simulate_cli_runs_formats_side_by_side(tmp_path, capsys):
    from strata_jax.cli import build_parser
    from strata_jax.cli.simulate import run_simulate

    out = tmp_path / "runs.json"
    args = build_parser().parse_args(
        [
            "simulate",
            "--workload",
            "multiturn",
            "--systems",
            "strata",
            "--kv-tier-format",
            "full,int8",
            "--rates",
            "4",
            "--num-requests",
            "20",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert run_simulate(args) == 0
    import json

    systems = [r["system"] for r in json.loads(out.read_text())["runs"]]
    assert systems == ["strata[full]", "strata[int8]"]
    assert "L2/L3 format full/int8" in capsys.readouterr().out
    bad = build_parser().parse_args(["simulate", "--kv-tier-format", "fp4", "--no-progress"])
    assert run_simulate(bad) == 2


def test_warmup_compiles_every_quantized_transfer_shape():
    from strata_jax.cache.pools import DevicePool, HostPool

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4)
    fmt = TierFormat.resolve("fp8", "float32")
    host = HostPool(layout, 40, fmt)
    pool = DevicePool(layout, 40, tier_format=fmt, kernel_backend="reference")
    pool.warmup(8)
    assert pool.moved["backed_up_pages"] == pool.moved["loaded_pages"] == 0  # warm-up moves no page
    before = pool.compile_count
    for n in (1, 3, 8, 13, 29):
        for a in pool.load_from_host(host, list(range(n)), list(range(n)), chunk_pages=8):
            a.block_until_ready()
        for start in range(0, n, 8):
            for a in pool.gather_tier(list(range(start, min(n, start + 8)))):
                a.block_until_ready()
    assert pool.compile_count == before


# ---------------------------------------------------------------------------------------
# Quality on the real model (issue 20's must-show; minutes: `pytest -m heavy`)


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_quantized_tiers_keep_smollm2s_greedy_tokens_and_logprobs(smollm2_gguf):
    """32 prompts of 640 tokens, 32 teacher-forced positions each, from L2 in fp8 and int8
    against the full-width run: top-1 agreement >= 0.97, mean |delta logprob| <= 0.05
    (scripts/kv_tier_quality.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from kv_tier_quality import run

    report = run(smollm2_gguf, prompts=32, prompt_tokens=640, positions=32)
    for name in ("L2 fp8", "L2 int8"):
        r = report["runs"][name]
        assert r["positions"] == 1024
        assert r["top1_agreement"] >= 0.97, (name, r)
        assert r["mean_abs_delta_logprob"] <= 0.05, (name, r)
