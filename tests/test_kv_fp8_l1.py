"""An fp8 (float8 e4m3fn) L1 KV pool, ``--kv-dtype fp8`` (issue 20).

References: ml_dtypes' own float8 cast of the clipped values (the pool's bytes), a float64
brute force over the same fp8 values upcast (attention), and the engine's own fp8 cold run
(tiers in the ``full`` format hold the L1 bytes as they are, so every tier gives its tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_pallas_attention import MIXED, brute_force, make_batch

from pallas_kernels import quant_transfer as qt
from pallas_kernels.aot import lower_for_gpu
from pallas_kernels.attention import ragged_paged_attention_pallas
from pallas_kernels.blocked import blocked_paged_attention
from pallas_kernels.reference import (
    ragged_paged_attention_reference,
    scatter_pages_reference,
    to_kv_dtype,
    write_kv_reference,
)
from pallas_kernels.transfer import scatter_pages_pallas
from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.runtime.platform import resolve

FP8 = jnp.float8_e4m3fn


def _numpy_fp8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn)


def test_cast_clips_to_e4m3s_range_instead_of_nan():
    x = np.array([0.0, 1.3, -2.7e-3, 447.0, 449.0, 500.0, -1e6, 3e38, 1e-9], np.float32)
    got = np.asarray(to_kv_dtype(jnp.asarray(x), FP8))
    assert not np.isnan(got.astype(np.float32)).any()
    np.testing.assert_array_equal(got.view(np.uint8), _numpy_fp8(x).view(np.uint8))
    assert got.astype(np.float32)[5] == 448.0 and got.astype(np.float32)[6] == -448.0
    # other pools: a plain cast, no clipping
    assert np.asarray(to_kv_dtype(jnp.asarray(x), jnp.bfloat16)).astype(np.float32)[6] < -9e5


def test_write_and_scatter_into_an_fp8_pool_store_the_clipped_values():
    rng = np.random.default_rng(0)
    layers, pages, page_size, heads, dim = 2, 5, 4, 2, 8
    pool = jnp.zeros((layers, 2, pages, page_size, heads, dim), FP8)
    k = rng.standard_normal((3, heads, dim)).astype(np.float32) * 300  # some past +-448
    v = rng.standard_normal((3, heads, dim)).astype(np.float32)
    slots = jnp.asarray([5, 6, 17], jnp.int32)  # page 1 offsets 1-2, page 4 offset 1
    out = np.asarray(write_kv_reference(pool, 1, jnp.asarray(k), jnp.asarray(v), slots))
    for t, slot in enumerate((5, 6, 17)):
        np.testing.assert_array_equal(
            out[1, 0, slot // page_size, slot % page_size].view(np.uint8), _numpy_fp8(k[t]).view(np.uint8)
        )
        np.testing.assert_array_equal(
            out[1, 1, slot // page_size, slot % page_size].view(np.uint8), _numpy_fp8(v[t]).view(np.uint8)
        )
    assert not np.isnan(out.astype(np.float32)).any()

    staging = rng.standard_normal((2, layers, 2, page_size, heads, dim)).astype(np.float32) * 400
    ids = jnp.asarray([3, 0], jnp.int32)
    want = _numpy_fp8(np.transpose(staging, (1, 2, 0, 3, 4, 5)))
    for scatter in (scatter_pages_reference, functools.partial(scatter_pages_pallas, interpret=True)):
        got = np.asarray(scatter(pool, jnp.asarray(staging), ids))
        np.testing.assert_array_equal(got[:, :, [3, 0]].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("fmt", ("fp8", "int8"))
def test_quantized_tier_pages_load_into_an_fp8_pool(fmt):
    """An fp8 L1 under an int8 (or fp8) tier: the dequantizing scatter clips like any write."""
    rng = np.random.default_rng(1)
    pages = (rng.standard_normal((3, 2, 2, 4, 2, 16)) * 200).astype(np.float32)
    q, scales = qt.quantize_pages_reference(jnp.asarray(pages), fmt)
    pool = jnp.zeros((2, 2, 6, 4, 2, 16), FP8)
    ids = jnp.asarray([4, 1, 2], jnp.int32)
    want = _numpy_fp8(
        np.transpose(np.asarray(qt.dequantize_pages_reference(q, scales, jnp.float32)), (1, 2, 0, 3, 4, 5))
    )
    impls = (
        qt.scatter_dequantize_reference,
        qt.scatter_dequantize_xla,
        functools.partial(qt.scatter_dequantize_pallas, interpret=True),
    )
    for impl in impls:
        got = np.asarray(impl(pool, q, scales, ids))
        np.testing.assert_array_equal(got[:, :, [4, 1, 2]].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("backend", ("reference", "xla", "interpret"))
@pytest.mark.parametrize("q_dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_attention_over_an_fp8_pool_reads_its_values_upcast(backend, q_dtype):
    rng = np.random.default_rng(2)
    args, host = make_batch(
        rng, page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=16, pad_tokens=2, dtype=jnp.float32, **MIXED
    )
    q, k, v = args[0].astype(q_dtype), args[1].astype(FP8), args[2].astype(FP8)
    rest = args[3:]
    if backend == "reference":
        got = ragged_paged_attention_reference(q, k, v, *rest, sm_scale=0.25)
    elif backend == "xla":
        got = blocked_paged_attention(q, k, v, *rest, sm_scale=0.25)
    else:
        got = ragged_paged_attention_pallas(q, k, v, *rest, sm_scale=0.25, interpret=True)
    got = np.asarray(got.astype(jnp.float32))
    real = int(host[5][-1])
    want = brute_force(
        np.asarray(q.astype(jnp.float32)),
        np.asarray(k.astype(jnp.float32)),
        np.asarray(v.astype(jnp.float32)),
        *host[3:],
        0.25,
        None,
    )
    tol = 2e-5 if q_dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=tol)


@pytest.mark.parametrize("platform", ("cuda", "rocm"))
def test_pallas_attention_over_an_fp8_pool_lowers_for_gpus(platform):
    q = jax.ShapeDtypeStruct((24, 8, 64), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((32, 16, 2, 64), FP8)
    table = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    starts = jax.ShapeDtypeStruct((5,), jnp.int32)
    fn = functools.partial(ragged_paged_attention_pallas, sm_scale=0.125)
    text = lower_for_gpu(fn, q, pages, pages, table, lens, starts, platform=platform).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_platform_and_config_take_fp8_and_refuse_other_names():
    from strata_jax.engine import EngineConfig

    assert resolve(kv_dtype="fp8", platform="cpu").kv_dtype == "float8_e4m3fn"
    assert resolve(kv_dtype="float8_e4m3fn", platform="cuda").kv_dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        resolve(kv_dtype="float8_e5m2", platform="cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve(dtype="fp8", platform="cpu")  # weights stay float32 / bfloat16
    EngineConfig(model="tiny", kv_dtype="fp8")
    with pytest.raises(InvalidRequestError, match="kv_dtype must be float32, bfloat16 or fp8"):
        EngineConfig(model="tiny", kv_dtype="int4")
    with pytest.raises(InvalidRequestError, match="EngineConfig.dtype must be float32 or bfloat16"):
        EngineConfig(model="tiny", dtype="fp8")


def _engine(tmp_path, **kw):
    from strata_jax.engine import Engine, EngineConfig

    base = dict(
        model="tiny",
        warmup=False,
        show_progress=False,
        kv_dtype="fp8",
        tiers="L1+L2+L3",
        page_size=8,
        storage_dir=str(tmp_path / "l3"),
        max_batch_tokens=128,
        max_batch_size=4,
        max_context_tokens=512,
        prefetch_min_tokens=0,
        prefetch_policy="wait_complete",
    )
    base.update(kw)
    return Engine(EngineConfig(**base))


def test_engine_with_an_fp8_l1_gives_its_cold_tokens_from_every_tier(tmp_path):
    """Tiers in the ``full`` format over an fp8 L1 hold its bytes: L1, L2 and L3 hits give
    the fp8 cold run's tokens exactly; the pool's counters show 1 byte per value."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (70, 45, 101)]
    params = SamplingParams(max_tokens=6, logprobs=2)
    engine = _engine(tmp_path)
    try:
        cold = engine.generate(prompts, params)
        stats = engine.ctl.stats()
        layout = engine.ctl.transfers.layout
        values_per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
        assert stats["device_bytes_per_token"] == values_per_token  # 1 byte each (float32: 4)
        assert stats["host_bytes_per_token"] == values_per_token
        runs = {"L1": engine.generate(prompts, params)}
        engine.flush_cache("device")
        runs["L2"] = engine.generate(prompts, params)
        engine.ctl.drain()  # L3 writes finished
        engine.flush_cache("device")
        engine.flush_cache("host")
        runs["L3"] = engine.generate(prompts, params)
        tier_key = {"L1": "device", "L2": "host", "L3": "storage"}
        for tier, outs in runs.items():
            for prompt, out, ref in zip(prompts, outs, cold):
                assert out.cached_tokens[tier_key[tier]] == (len(prompt) - 1) // 8 * 8, (tier, out.cached_tokens)
                assert out.token_ids == ref.token_ids, tier
                # the same KV values; an extend and a prefill may sum in another order
                np.testing.assert_allclose(
                    [lp.logprob for lp in out.logprobs], [lp.logprob for lp in ref.logprobs], atol=1e-5
                )
    finally:
        engine.shutdown()


def test_engine_with_an_fp8_l1_and_an_int8_tier_loads_close_values(tmp_path):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (66, 90)]
    params = SamplingParams(max_tokens=4, logprobs=1)
    engine = _engine(tmp_path, kv_tier_format="int8", tiers="L1+L2")
    try:
        cold = engine.generate(prompts, params)
        engine.flush_cache("device")
        warm = engine.generate(prompts, params)
        for prompt, out, ref in zip(prompts, warm, cold):
            assert out.cached_tokens["host"] == (len(prompt) - 1) // 8 * 8
            assert out.token_ids[0] == ref.token_ids[0]
            assert abs(out.logprobs[0].logprob - ref.logprobs[0].logprob) < 0.05
        stats = engine.ctl.stats()
        assert stats["host_bytes_per_token"] < stats["device_bytes_per_token"] * 1.1  # int8 + scales vs fp8
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_compiled_attention_over_an_fp8_pool_matches_the_reference_on_a_gpu(q_dtype):
    rng = np.random.default_rng(5)
    args, host = make_batch(
        rng, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, pad_tokens=2, dtype=jnp.float32, **MIXED
    )
    q, k, v = args[0].astype(q_dtype), args[1].astype(FP8), args[2].astype(FP8)
    got = jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=0.125))(q, k, v, *args[3:])
    want = ragged_paged_attention_reference(q, k, v, *args[3:], sm_scale=0.125)
    real = int(host[5][-1])
    tol = 2e-3 if q_dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(
        np.asarray(got.astype(jnp.float32))[:real], np.asarray(want.astype(jnp.float32))[:real], atol=tol, rtol=tol
    )
