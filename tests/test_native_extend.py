"""The native paged-extend kernel (``pallas_kernels.native``, the ``"xla"`` backend's
prefill attention on CPU) against the float64 brute force and the block-causal XLA attention.

Batches come from ``test_pallas_attention.make_batch``: unwritten KV slots, padding
queries and page-table entries past a sequence's pages are NaN / garbage, so reading what
it should not turns the output into NaN.  Row lengths cross the kernel's query blocks (96
rows of tokens x GQA group) and its 64-key blocks, with one-token rows (a decode in a
mixed batch) and empty rows between them.  Learned attention sinks (GPT-OSS) are checked
with the decode tests' helpers (tests/test_native_decode.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_native_decode import (
    check_no_sinks_equal_minus_inf_sinks,
    check_sinks_equal_the_reference,
    check_traced_layer_and_window_under_a_scan,
    check_traced_sinks_under_a_scan,
    nan_pool,
)
from test_pallas_attention import brute_force, make_batch, make_sinks

from pallas_kernels import dispatch, native
from pallas_kernels.blocked import blocked_paged_attention_pool
from pallas_kernels.reference import ragged_paged_attention_pool_reference, ragged_paged_attention_reference

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@pytest.mark.parametrize(
    "page_size,head_dim,heads",
    [(16, 64, (9, 3)), (16, 16, (8, 2)), (8, 32, (4, 4)), (16, 16, (2, 1)), (4, 48, (12, 1))],
)
@pytest.mark.parametrize("soft_cap", (None, 5.0))
@pytest.mark.parametrize("window", (None, 0, 1, 7, 40))
def test_ragged_extend_equals_brute_force(page_size, head_dim, heads, soft_cap, window):
    rng = np.random.default_rng(page_size * 100 + head_dim + (window or 0))
    # a decode row, a fresh prompt, a chunk over cached context longer than a query block,
    # an empty row, a short question over a long context
    q_lens, contexts = (1, 37, 130, 0, 5), (40, 0, 70, 0, 200)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=contexts,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        pad_tokens=3,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    got, _ = native.paged_extend_attention_pool(
        q, nan_pool(k, v), 1, table, seq_lens, qs, sm_scale=0.3, soft_cap=soft_cap, sliding_window=window
    )
    got = np.asarray(got)
    n = int(qs[-1])
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[n:], 0.0)  # padding tokens
    want = brute_force(*host, 0.3, soft_cap, None if not window else window)
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)


def test_a_long_chunk_equals_the_reference_and_the_xla_attention():
    """A 512-token chunk over 1,000 cached tokens and a 300-token prompt beside it (the
    engine's shapes: many query and key blocks, the diagonal inside a block), with
    SmolLM2's heads; against the pure-JAX reference, the block-causal XLA attention and
    the brute force."""
    rng = np.random.default_rng(11)
    args, host = make_batch(
        rng,
        page_size=16,
        q_lens=(512, 300),
        ctx_lens=(1000, 0),
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool = nan_pool(k, v)
    got = np.asarray(native.paged_extend_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.125)[0])
    np.testing.assert_allclose(got, brute_force(*host, 0.125, None), atol=2e-5, rtol=2e-5)
    xla = np.asarray(blocked_paged_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.125)[0])
    np.testing.assert_allclose(got, xla, atol=2e-5, rtol=2e-5)
    ref = np.asarray(ragged_paged_attention_reference(q, k, v, table, seq_lens, qs, sm_scale=0.125))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_traced_layer_and_window_under_a_scan_in_place():
    check_traced_layer_and_window_under_a_scan(
        native.paged_extend_attention_pool, (20, 3, 1), (30, 64, 9), pad_tokens=2
    )


def test_the_cpu_backend_takes_the_extend_kernel_for_float32_and_whole_tiles(monkeypatch):
    """The ``"xla"`` backend's pool attention on an extend: the native extend on a float32
    pool with head_dim a multiple of 16; the XLA attention for bfloat16, head_dim 12, or
    with ``$STRATA_NATIVE_KERNELS=0``."""
    assert dispatch.get_implementation("ragged_paged_attention_pool", "xla") is native.cpu_paged_attention_pool

    def custom_calls(head_dim: int, dtype=jnp.float32) -> int:
        rng = np.random.default_rng(head_dim)
        args, _ = make_batch(
            rng,
            page_size=16,
            q_lens=(3, 1),
            ctx_lens=(9, 20),
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=head_dim,
            pad_tokens=0,
            dtype=jnp.float32,
        )
        q, k, v, table, seq_lens, qs = args
        pool = nan_pool(k, v).astype(dtype)
        fn = jax.jit(lambda p: native.cpu_paged_attention_pool(q, p, 1, table, seq_lens, qs, sm_scale=0.25)[0])
        return fn.lower(pool).as_text().count(native._EXTEND_TARGET)

    assert custom_calls(16) == 1
    assert custom_calls(16, jnp.bfloat16) == 0
    assert custom_calls(12) == 0
    with pytest.raises(ValueError, match="head_dim % 16"):
        native.paged_extend_attention_pool(
            jnp.zeros((3, 2, 12)),
            jnp.zeros((1, 2, 2, 4, 1, 12)),
            0,
            jnp.zeros((1, 2), jnp.int32),
            jnp.asarray([3]),
            jnp.asarray([0, 3]),
            sm_scale=1.0,
        )
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load.cache_clear()
    try:
        assert custom_calls(16) == 0
        with pytest.raises(native.NativeBuildError, match="off"):
            native.paged_extend_attention_pool(
                jnp.zeros((3, 2, 16)),
                jnp.zeros((1, 2, 2, 4, 1, 16)),
                0,
                jnp.zeros((1, 2), jnp.int32),
                jnp.asarray([3]),
                jnp.asarray([0, 3]),
                sm_scale=1.0,
            )
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._load.cache_clear()
    assert native.available()


@pytest.mark.parametrize(
    "page_size,head_dim,heads", [(16, 64, (9, 3)), (8, 32, (4, 4)), (4, 48, (12, 1)), (16, 16, (8, 2))]
)
@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, None), (None, 7), (5.0, 40)])
def test_extend_with_sinks_equals_the_reference(page_size, head_dim, heads, soft_cap, window):
    """GQA groups (up to 12 heads on one KV head), soft cap and window over a mixed batch:
    a decode row, a fresh prompt, a chunk longer than a query block, an empty row, padding."""
    check_sinks_equal_the_reference(
        native.paged_extend_attention_pool,
        seed=page_size * 100 + head_dim + (window or 0),
        page_size=page_size,
        head_dim=head_dim,
        heads=heads,
        soft_cap=soft_cap,
        window=window,
        q_lens=(1, 37, 130, 0, 5),
        ctx_lens=(40, 0, 70, 0, 200),
        pad_tokens=3,
    )


def test_extend_without_sinks_equals_minus_inf_sinks():
    check_no_sinks_equal_minus_inf_sinks(native.paged_extend_attention_pool, (20, 1, 0, 70), (0, 30, 0, 50), 3)


def test_extend_traced_sinks_under_a_scan():
    check_traced_sinks_under_a_scan(native.paged_extend_attention_pool, (20, 3, 1), (30, 64, 9), pad_tokens=2)


def test_extend_sinks_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\) \(one per query head\), got \(3,\)"):
        native.paged_extend_attention_pool(
            jnp.zeros((3, 2, 16)),
            jnp.zeros((1, 2, 2, 4, 1, 16)),
            0,
            jnp.zeros((1, 2), jnp.int32),
            jnp.asarray([3]),
            jnp.asarray([0, 3]),
            sm_scale=1.0,
            sinks=jnp.zeros(3),
        )[0].block_until_ready()


def test_the_cpu_backend_passes_sinks_to_the_extend_kernel_and_the_xla_attention(monkeypatch):
    """``cpu_paged_attention_pool`` on an extend with sinks: the native extend (a custom
    call) on a float32 pool, the block-causal XLA attention with the kernels off; both
    equal the reference."""
    rng = np.random.default_rng(4)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=(3, 1, 0),
        ctx_lens=(9, 20, 0),
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=2,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool, sinks = nan_pool(k, v), make_sinks(rng, 8)
    options = dict(sm_scale=0.25, soft_cap=5.0, sliding_window=7)
    n = int(qs[-1])

    def attention(p, s):
        return native.cpu_paged_attention_pool(q, p, 1, table, seq_lens, qs, sinks=s, **options)[0]

    want = np.asarray(ragged_paged_attention_pool_reference(q, pool, 1, table, seq_lens, qs, sinks=sinks, **options)[0])
    fn = jax.jit(attention)
    assert fn.lower(pool, sinks).as_text().count(native._EXTEND_TARGET) == 1
    np.testing.assert_allclose(np.asarray(fn(pool, sinks))[:n], want[:n], atol=2e-5, rtol=2e-5)
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load.cache_clear()
    try:
        fallback = jax.jit(lambda p, s: attention(p, s))  # a new function, traced again: kernels off
        assert fallback.lower(pool, sinks).as_text().count(native._EXTEND_TARGET) == 0
        np.testing.assert_allclose(np.asarray(fallback(pool, sinks))[:n], want[:n], atol=2e-5, rtol=2e-5)
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._load.cache_clear()
    assert native.available()
