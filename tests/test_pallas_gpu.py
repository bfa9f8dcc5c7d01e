"""Compiled Pallas kernels on a real GPU (CUDA or ROCm) against the references.

Skipped without a GPU; ``scripts/gpu_check.sh`` runs them with STRATA_TEST_GPU=1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_attention import make_batch

from pallas_kernels import dispatch
from pallas_kernels.attention import ragged_paged_attention_pallas
from pallas_kernels.reference import gather_pages_reference, ragged_paged_attention_reference, scatter_pages_reference
from pallas_kernels.transfer import gather_pages_pallas, scatter_pages_pallas

pytestmark = pytest.mark.gpu


def test_gpu_platform_dispatches_to_pallas(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.platform_name() in ("cuda", "rocm")
    assert dispatch.resolve_backend() == "pallas"


@pytest.mark.parametrize("page_size", (1, 8, 16, 64))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_transfer_compiled_equals_reference(page_size, dtype):
    rng = np.random.default_rng(page_size)
    layers, pages, n = 8, 97, 31
    pool = jnp.full((layers, 2, pages, page_size, 8, 128), jnp.nan, dtype)
    staging = jnp.asarray(rng.standard_normal((n, layers, 2, page_size, 8, 128)), dtype)
    ids = jnp.asarray(rng.choice(pages, n, replace=False).astype(np.int32))
    want = scatter_pages_reference(pool, staging, ids)
    got = jax.jit(scatter_pages_pallas)(pool, staging, ids)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    back = jax.jit(gather_pages_pallas)(want, ids)
    np.testing.assert_array_equal(
        np.asarray(back, np.float32), np.asarray(gather_pages_reference(want, ids), np.float32)
    )


def test_compiled_scatter_is_in_place():
    pool = jnp.zeros((32, 2, 512, 16, 8, 128), jnp.bfloat16)
    before = pool.unsafe_buffer_pointer()
    staging = jnp.ones((4, 32, 2, 16, 8, 128), jnp.bfloat16)
    out = jax.jit(scatter_pages_pallas, donate_argnums=0)(pool, staging, jnp.arange(4, dtype=jnp.int32))
    assert out.unsafe_buffer_pointer() == before


@pytest.mark.parametrize("page_size", (1, 8, 16, 64))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("soft_cap", (None, 30.0))
def test_attention_compiled_equals_reference(page_size, dtype, soft_cap):
    rng = np.random.default_rng(page_size + 1)
    args, _ = make_batch(
        rng,
        page_size=page_size,
        q_lens=(37, 1, 1, 12, 0, 1),
        ctx_lens=(100, 300, 5, 0, 0, 1000),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        pad_tokens=5,
        dtype=dtype,
    )
    got = ragged_paged_attention_pallas(*args, sm_scale=128**-0.5, soft_cap=soft_cap)
    with jax.default_matmul_precision("highest"):  # XLA's default f32 dot on a GPU is TF32
        want = ragged_paged_attention_reference(*args, sm_scale=128**-0.5, soft_cap=soft_cap)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-4
    got32 = np.asarray(got, np.float32)
    assert not np.isnan(got32).any()
    np.testing.assert_allclose(got32, np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("window", (None, 128))
def test_attention_with_sinks_compiled_equals_reference(dtype, window):
    """GPT-OSS's shapes (64 query heads over 8 KV heads, head_dim 64, alternating 128-token
    windows): the compiled kernel with learned sinks against the reference."""
    rng = np.random.default_rng(7)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=(37, 1, 1, 12, 0, 1),
        ctx_lens=(100, 300, 5, 0, 0, 1000),
        num_q_heads=64,
        num_kv_heads=8,
        head_dim=64,
        pad_tokens=5,
        dtype=dtype,
    )
    sinks = jnp.asarray(rng.normal(size=64) * 2, jnp.float32).at[0].set(8.0)
    options = dict(sm_scale=64**-0.5, sliding_window=window, sinks=sinks)
    got = ragged_paged_attention_pallas(*args, **options)
    with jax.default_matmul_precision("highest"):
        want = ragged_paged_attention_reference(*args, **options)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-4
    got32 = np.asarray(got, np.float32)
    assert not np.isnan(got32).any()
    np.testing.assert_allclose(got32, np.asarray(want, np.float32), atol=tol, rtol=tol)


def test_pool_attention_compiled_equals_reference():
    rng = np.random.default_rng(5)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=(9, 1, 1),
        ctx_lens=(50, 200, 3),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        pad_tokens=3,
        dtype=jnp.bfloat16,
    )
    q, k, v, table, seq_lens, qs = args
    pool = jnp.stack([jnp.stack([k, v])] * 3).at[0].set(jnp.nan)  # [3, 2, P, S, H, D]
    step = jax.jit(
        lambda q, pool: dispatch.ragged_paged_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=128**-0.5)[0]
    )
    with jax.default_matmul_precision("highest"):
        want = ragged_paged_attention_reference(q, k, v, table, seq_lens, qs, sm_scale=128**-0.5)
    np.testing.assert_allclose(
        np.asarray(step(q, pool), np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )


def test_engine_on_compiled_kernels_gives_the_reference_tokens(tmp_path):
    """The whole engine (attention, L2->L1 scatter, L1->L2 gather) on the compiled kernels.

    float32 with HIGHEST matmul precision everywhere, so the only difference between
    the two engines is the attention kernel (~1e-6).  L1, L2 and L3 hits run the same
    shapes on the same bits and must agree exactly; a cold run batches differently,
    and on a GPU the dense matmuls may round differently for another batch shape, so
    cold is compared across backends only (CPU runs require cold == cached too).
    """
    from test_engine_kernels import KERNELS, tier_tokens

    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")  # the engine traces in its own thread
    try:
        common = {"dtype": "float32", "kv_dtype": "float32"}
        reference = tier_tokens("reference", str(tmp_path / "ref"), **common)
        compiled = tier_tokens("pallas", str(tmp_path / "pallas"), **common)
    finally:
        jax.config.update("jax_default_matmul_precision", previous)
    assert reference["kernels"] == set() and compiled["kernels"] == KERNELS, (reference["kernels"], compiled["kernels"])
    for result in (reference, compiled):
        tiers = result["tiers"]
        assert tiers["L1"][1]["device"] == tiers["L2"][1]["host"] == tiers["L3"][1]["storage"] == 144
        assert tiers["L1"][0] == tiers["L2"][0] == tiers["L3"][0]
    for tier in ("cold", "L1", "L2", "L3"):
        assert compiled["tiers"][tier][0] == reference["tiers"][tier][0], tier


def grouped_runner_logits(backend: str, groups: bool) -> np.ndarray:
    """Logits of a windowed Gemma 3 (random weights) over an extend crossing the window and
    decodes, on the layer-first pool or the grouped one with local page ids reversed."""
    from pallas_kernels.layout import KVLayout
    from strata_jax.cache.pools import DevicePool
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput, grouped_pool_layout

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
    pages = 24
    pool = None
    if groups:
        layout = KVLayout(6, 1, 32, 4)
        pool = DevicePool(layout, pages, grouped=grouped_pool_layout(config, layout, pages))
        pool.local.hand_out_in(list(range(pages))[::-1])
        pool.local.attach(list(range(pages)))
    runner = ModelRunner(
        random_model(config),
        RunnerConfig(
            page_size=4,
            num_device_pages=pages,
            max_batch_tokens=32,
            max_batch_size=2,
            max_context_tokens=96,
            kernel_backend=backend,
        ),
        pool=pool,
    )
    ids = np.random.default_rng(7).integers(0, 64, size=30).tolist()
    table = np.random.default_rng(8).permutation(pages)[:8].tolist()
    out = [runner.step([SeqInput(ids[:24], 0, table)], all_logits=True).logits]
    for pos in range(24, len(ids)):
        out.append(runner.step([SeqInput([ids[pos]], pos, table)], all_logits=True).logits)
    return np.concatenate(out)


def test_grouped_pool_steps_on_compiled_kernels_equal_the_layer_first_reference():
    """Layer groups on the GPU: the compiled attention reads the one-layer pool at per-layer
    offsets and local layers through the page map; the transfers are XLA."""
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        want = grouped_runner_logits("reference", False)
        got = grouped_runner_logits("pallas", True)
    finally:
        jax.config.update("jax_default_matmul_precision", previous)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
