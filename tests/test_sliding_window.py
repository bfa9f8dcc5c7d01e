"""Sliding-window paged attention: the pure-JAX reference and the Pallas kernel (interpret mode)
against a float64 brute force that reads only each token's window.

Contract (``pallas_kernels.reference.ragged_paged_attention_reference``): with ``sliding_window``
w > 0 a token at position p reads KV positions max(0, p - w + 1)..p; None or w <= 0 is full
attention; w may be a traced int32 (one value of a per-layer array a layer scan walks).  Inputs
come from ``test_pallas_attention.make_batch``: unwritten slots, page-table tails and padding
queries are NaN/garbage, so reading what the window excludes *and was never written* shows up.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pallas_attention import MIXED, brute_force, make_batch

from pallas_kernels import reference
from pallas_kernels.attention import (
    AttentionShapeError,
    ragged_paged_attention_pallas,
    ragged_paged_attention_pool_pallas,
)
from pallas_kernels.reference import ragged_paged_attention_pool_reference, ragged_paged_attention_reference

FULL = 1 << 30


def windowed_brute_force(q, k_pages, v_pages, table, seq_lens, query_start, sm_scale, window, soft_cap=None):
    """Dense attention in float64 where a token at position p reads positions max(0, p - window + 1)..p."""
    return brute_force(q, k_pages, v_pages, table, seq_lens, query_start, sm_scale, soft_cap, window)


def _span(window) -> int:
    return FULL if window is None or window <= 0 else window


def _poison_outside_windows(args, host, window):
    """NaN every KV position no token of its sequence may read (older than the first token's
    window): a kernel that reads them (instead of skipping them) turns its output into NaN
    unless it masks them perfectly, and the skipped blocks of a local layer are never touched."""
    q, k, v, table, seq_lens, qs = args
    k, v = np.array(k), np.array(v)
    page_size = k.shape[1]
    for b in range(len(seq_lens)):
        first = int(seq_lens[b]) - int(qs[b + 1] - qs[b])
        for p in range(max(0, first - _span(window) + 1)):
            k[host[3][b, p // page_size], p % page_size] = np.nan
            v[host[3][b, p // page_size], p % page_size] = np.nan
    return (q, jnp.asarray(k), jnp.asarray(v), table, seq_lens, qs)


@pytest.mark.parametrize(
    ("page_size", "window", "soft_cap"),
    [(1, None, None), (4, 0, 3.0), (1, 1, None), (4, 5, None), (16, 5, 3.0), (4, 24, None), (16, 24, None)],
)
def test_reference_and_interpret_equal_the_windowed_brute_force(page_size, window, soft_cap):
    rng = np.random.default_rng(page_size * 7 + (window or 0))
    args, host = make_batch(
        rng, page_size=page_size, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=3, dtype=jnp.float32, **MIXED
    )
    args = _poison_outside_windows(args, host, window)
    want = windowed_brute_force(*host, 0.25, _span(window), soft_cap)
    for blocks in (8, 256):  # several KV blocks per sequence (window starts mid-block), and one
        got = np.asarray(
            ragged_paged_attention_reference(
                *args, sm_scale=0.25, soft_cap=soft_cap, sliding_window=window, kv_block_tokens=blocks
            )
        )
        assert not np.isnan(got).any(), blocks
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=f"reference, blocks of {blocks}")
    got = np.asarray(
        ragged_paged_attention_pallas(
            *args, sm_scale=0.25, soft_cap=soft_cap, sliding_window=window, interpret=True, block_kv=16, block_rows=16
        )
    )
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg="pallas interpret")
    np.testing.assert_array_equal(got[int(host[5][-1]) :], 0.0)  # padding tokens


@pytest.mark.slow  # ~30 s: a compile per example
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    page_size=st.sampled_from([1, 2, 8]),
    heads=st.sampled_from([(4, 4), (8, 2), (4, 1)]),
    batch=st.integers(1, 4),
    decode=st.booleans(),
    window=st.sampled_from([None, -3, 0, 1, 2, 7, 30]),
)
def test_random_batches(seed, page_size, heads, batch, decode, window):
    """Random ragged and decode-only batches (the reference's per-token path: T == B)."""
    rng = np.random.default_rng(seed)
    q_lens = np.ones(batch, int) if decode else rng.integers(0, 11, size=batch)
    ctx_lens = rng.integers(0, 60, size=batch)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        pad_tokens=0 if decode else int(rng.integers(0, 3)),
        dtype=jnp.float32,
    )
    if args[0].shape[0] == 0:
        return
    args = _poison_outside_windows(args, host, window)
    want = windowed_brute_force(*host, 0.3, _span(window))
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.3, sliding_window=window, kv_block_tokens=8))
    np.testing.assert_allclose(ref, want, atol=2e-5, rtol=2e-5)
    got = ragged_paged_attention_pallas(
        *args, sm_scale=0.3, sliding_window=window, max_q_len=1 if decode else None, interpret=True, block_kv=16
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ("reference", "interpret"))
def test_window_as_a_traced_per_layer_value_under_scan(impl):
    """One scanned program over layers whose windows differ (0 and -1 = full attention) reads
    each layer's K/V with that layer's window."""
    rng = np.random.default_rng(3)
    args, host = make_batch(
        rng,
        page_size=4,
        q_lens=(6, 1, 9),
        ctx_lens=(20, 31, 0),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=2,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    windows = jnp.asarray([5, 0, 12, -1], jnp.int32)
    scale = jnp.arange(1, 5, dtype=jnp.float32)[:, None, None, None, None, None]
    pool = jnp.stack([k, v])[None] * scale  # layer l holds the batch's K/V times (l + 1)

    def attend(pool, layer, window):
        if impl == "reference":
            return ragged_paged_attention_pool_reference(
                q, pool, layer, table, seq_lens, qs, sm_scale=0.25, sliding_window=window
            )
        out = ragged_paged_attention_pool_pallas(
            q, pool, layer, table, seq_lens, qs, sm_scale=0.25, sliding_window=window, interpret=True
        )
        return out, pool

    @jax.jit
    def run(pool):
        def body(pool, layer_and_window):
            out, pool = attend(pool, *layer_and_window)
            return pool, out

        return jax.lax.scan(body, pool, (jnp.arange(4, dtype=jnp.int32), windows))

    _, outs = run(pool)
    for layer, window in enumerate((5, FULL, 12, FULL)):
        s = layer + 1
        want = windowed_brute_force(host[0], host[1] * s, host[2] * s, *host[3:], 0.25, window)
        np.testing.assert_allclose(np.asarray(outs[layer]), want, atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}")


@pytest.mark.parametrize("decode", (True, False), ids=("decode", "extend"))
def test_reference_never_reads_blocks_older_than_the_window(decode):
    """The block loops start at the first block a token's window needs: record every page the
    reference gathers and check none lies entirely before the window of every token of its sequence."""
    page_size, window, block_tokens = 4, 10, 8
    rng = np.random.default_rng(5)
    q_lens = (1, 1, 1) if decode else (3, 5, 1)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=(60, 23, 41),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    read: list[np.ndarray] = []

    def read_block(src, pages):
        jax.debug.callback(lambda p: read.append(np.asarray(p).ravel()), pages)
        return src[0][pages], src[1][pages]

    out, _ = reference._ragged_attention_core(  # noqa: SLF001 - the block reader is the observable here
        q,
        (k, v),
        read_block,
        k.shape,
        table,
        seq_lens,
        qs,
        sm_scale=0.25,
        sliding_window=window,
        kv_block_tokens=block_tokens,
    )
    jax.block_until_ready(out)
    np.testing.assert_allclose(np.asarray(out), windowed_brute_force(*host, 0.25, window), atol=2e-5, rtol=2e-5)
    touched = set(np.concatenate(read).tolist())
    for b in range(3):
        first = int(seq_lens[b]) - q_lens[b]
        oldest_needed = max(0, first - window + 1)
        needed_block = oldest_needed // block_tokens * block_tokens
        too_old = {int(host[3][b, p // page_size]) for p in range(needed_block)}
        assert not too_old & touched, f"sequence {b} read pages older than its window: {sorted(too_old & touched)}"
        assert {int(host[3][b, p // page_size]) for p in range(oldest_needed, int(seq_lens[b]))} <= touched


def test_pallas_local_layer_cost_does_not_grow_with_context():
    """Decode over a 16K-token context: a 64-token window runs a small fraction of the full
    layer's KV blocks (interpret mode executes every loop iteration, so time follows blocks)."""
    rng = np.random.default_rng(0)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=(1,),
        ctx_lens=(16383,),
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    run = jax.jit(
        lambda w, *a: ragged_paged_attention_pallas(
            *a, sm_scale=0.25, sliding_window=w, max_q_len=1, interpret=True, block_kv=16
        )
    )

    def seconds(window: int) -> float:
        jax.block_until_ready(run(jnp.int32(window), *args))  # compile (one program for both windows)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(run(jnp.int32(window), *args))
            best = min(best, time.perf_counter() - start)
        return best

    full, local = seconds(0), seconds(64)
    assert local < 0.25 * full, (local, full)


def test_bad_window_is_a_typed_error():
    rng = np.random.default_rng(1)
    args, _ = make_batch(
        rng,
        page_size=4,
        q_lens=(2,),
        ctx_lens=(3,),
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    with pytest.raises(AttentionShapeError, match="sliding_window"):
        ragged_paged_attention_pallas(*args, sm_scale=0.3, sliding_window=jnp.ones(2, jnp.int32), interpret=True)
    with pytest.raises(AttentionShapeError, match="sliding_window"):
        ragged_paged_attention_pallas(*args, sm_scale=0.3, sliding_window=2.5, interpret=True)


# ---- one program for local and global layers, on the GPU too ------------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("platform", ("cuda", "rocm"))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32), ids=lambda d: jnp.dtype(d).name)
def test_windowed_kernel_lowers_for_gpu_with_a_traced_window(platform, dtype):
    """Gemma 3's shapes (head_dim 256, one KV head, 4 query heads), the window a traced scalar."""
    from pallas_kernels.aot import lower_for_gpu

    pool = jax.ShapeDtypeStruct((18, 2, 64, 16, 1, 256), dtype)
    args = (
        jax.ShapeDtypeStruct((32, 4, 256), dtype),
        pool,
        jax.ShapeDtypeStruct((4, 16), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((5,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )

    def step(q, kv_pool, table, seq_lens, query_start, window):
        return ragged_paged_attention_pool_pallas(
            q, kv_pool, 5, table, seq_lens, query_start, sm_scale=256**-0.5, soft_cap=50.0, sliding_window=window
        )

    assert TRITON_CALL in lower_for_gpu(step, *args, platform=platform).as_text()


# (the grouped pool's offsets and page map are the same for both GPU targets: one is enough)
@pytest.mark.parametrize(("platform", "groups"), [("cuda", False), ("rocm", False), ("cuda", True)])
def test_gemma_engine_step_is_one_program_for_local_and_global_layers(platform, groups, monkeypatch):
    """The engine's whole jitted step of a Gemma 3 model (local and global layers, two rope bases)
    on the Pallas backend: one Triton attention call in the layer scan's body, no per-kind program;
    with layer groups (``kv_layer_groups``) too, local layers reading through the page map."""
    from pallas_kernels.aot import gpu_lowering_target
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig

    monkeypatch.setenv("STRATA_KERNEL_BACKEND", "pallas")
    config = ModelConfig(
        model_type="gemma3_text",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        qk_norm=True,
        tie_word_embeddings=True,
        layer_windows=(8, 8, 0, 8, 8, 0),
        rope_local_theta=10000.0,
        rope_theta=1e6,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=32.0,
    )
    runner_config = RunnerConfig(
        page_size=16,
        num_device_pages=33,
        max_batch_tokens=32,
        max_batch_size=2,
        max_context_tokens=128,
        kv_dtype="bfloat16",
    )
    pool = None
    if groups:
        from pallas_kernels.layout import KVLayout
        from strata_jax.cache.pools import DevicePool
        from strata_jax.runtime.model_runner import grouped_pool_layout

        layout = KVLayout(6, 1, 32, 16, "bfloat16")
        pool = DevicePool(layout, 33, grouped=grouped_pool_layout(config, layout, 33))
    runner = ModelRunner(random_model(config), runner_config, pool=pool)
    args = runner.program_arguments(5, 1, decode=False)
    assert ("local_map" in args[5]) == groups
    with gpu_lowering_target(platform):
        text = runner.lower_step(5, 1, decode=False, platforms=(platform,)).as_text()
    assert text.count(TRITON_CALL) == 1 and "stablehlo.while" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("window", (None, 7, 300))
def test_compiled_windowed_kernel_equals_reference(dtype, window):
    """On a GPU (``STRATA_TEST_GPU=1``): the compiled kernel with windows == the reference, Gemma 3 shapes."""
    rng = np.random.default_rng(window or 0)
    args, host = make_batch(
        rng,
        page_size=16,
        q_lens=(37, 1, 5, 1),
        ctx_lens=(600, 900, 0, 40),
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=256,
        pad_tokens=3,
        dtype=dtype,
    )
    args = _poison_outside_windows(args, host, window)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.0625, sliding_window=window), np.float32)
    got = np.asarray(
        jax.jit(lambda *a: ragged_paged_attention_pallas(*a, sm_scale=0.0625, sliding_window=window))(*args), np.float32
    )
    assert not np.isnan(got).any()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got, want, **tol)
