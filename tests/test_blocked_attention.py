"""Block-causal CPU attention (``pallas_kernels.blocked``, the ``"xla"`` backend) against
a float64 brute force and the pure-JAX reference.

Batches come from ``test_pallas_attention.make_batch``: unwritten KV slots, page-table
entries past a sequence's pages and padding queries are NaN/garbage, so reading what it
should not turns the output into NaN.  Small block sizes make every path (several query
blocks per sequence, several KV blocks per query block, the small-query-block branch,
windows that start mid-block) run on small inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pallas_attention import MIXED, brute_force, make_batch

import pallas_kernels
from pallas_kernels import dispatch, native
from pallas_kernels.blocked import (
    DEFAULT_DECODE_KV_BLOCK_TOKENS,
    DEFAULT_Q_BLOCKS,
    blocked_paged_attention,
    blocked_paged_attention_pool,
)
from pallas_kernels.reference import ragged_paged_attention_reference

SMALL_BLOCKS = dict(q_blocks=(1, 3, 8), kv_block_tokens=8)


@pytest.mark.parametrize("page_size", (1, 4, 16))
@pytest.mark.parametrize("soft_cap", (None, 5.0))
@pytest.mark.parametrize("blocks", ("default", "small"))
def test_mixed_batch_equals_brute_force_and_reference(page_size, soft_cap, blocks):
    rng = np.random.default_rng(page_size + (soft_cap is None) * 7)
    args, host = make_batch(
        rng, page_size=page_size, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=3, dtype=jnp.float32, **MIXED
    )
    sizes = SMALL_BLOCKS if blocks == "small" else {}
    got = np.asarray(blocked_paged_attention(*args, sm_scale=0.25, soft_cap=soft_cap, **sizes))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, brute_force(*host, 0.25, soft_cap), atol=2e-5, rtol=2e-5)
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.25, soft_cap=soft_cap))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[int(host[5][-1]) :], 0.0)  # padding tokens


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    page_size=st.sampled_from([1, 2, 8, 16]),
    heads=st.sampled_from([(4, 4), (8, 2), (4, 1), (6, 3)]),
    batch=st.integers(1, 5),
    shape=st.sampled_from(["decode", "ragged", "tokens==rows"]),
    window=st.sampled_from([None, 0, 1, 3, 9, 40]),
)
def test_random_batches_and_windows(seed, page_size, heads, batch, shape, window):
    """Random ragged batches, decode batches and padded extends whose token count equals
    the row count (which must not be taken for a decode), with and without a window."""
    rng = np.random.default_rng(seed)
    if shape == "decode":
        q_lens = np.ones(batch, int)
    elif shape == "tokens==rows":
        q_lens = np.zeros(batch, int)
        q_lens[0] = batch  # one sequence owns every token, the other rows are padding
    else:
        q_lens = rng.integers(0, 13, size=batch)
    ctx_lens = rng.integers(0, 70, size=batch)
    pad = 0 if shape != "ragged" else int(rng.integers(0, 4))
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        pad_tokens=pad,
        dtype=jnp.float32,
    )
    if args[0].shape[0] == 0:
        return
    got = np.asarray(blocked_paged_attention(*args, sm_scale=0.3, sliding_window=window, **SMALL_BLOCKS))
    span = 1 << 30 if not window else window
    np.testing.assert_allclose(got, brute_force(*host, 0.3, None, span), atol=2e-5, rtol=2e-5)
    if window is None:
        default_blocks = np.asarray(blocked_paged_attention(*args, sm_scale=0.3))
        np.testing.assert_allclose(default_blocks, got, atol=2e-5, rtol=2e-5)


def test_window_as_a_traced_per_layer_value_under_scan():
    """One scanned program over layers whose windows differ (0 = full attention), the
    window arriving as a traced scalar, reads each layer's K/V with its own window."""
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
    windows = jnp.asarray([5, 0, 12], jnp.int32)
    scale = jnp.arange(1, 4, dtype=jnp.float32)[:, None, None, None, None, None]
    pool = jnp.stack([k, v])[None] * scale  # layer l holds the batch's K/V times (l + 1)

    @jax.jit
    def run(pool):
        def body(pool, layer_and_window):
            layer, window = layer_and_window
            out, pool = dispatch.ragged_paged_attention_pool(
                q, pool, layer, table, seq_lens, qs, sm_scale=0.25, sliding_window=window, backend="xla"
            )
            return pool, out

        return jax.lax.scan(body, pool, (jnp.arange(3, dtype=jnp.int32), windows))

    _, outs = run(pool)
    for layer, window in enumerate((5, 1 << 30, 12)):
        s = layer + 1
        want = brute_force(host[0], host[1] * s, host[2] * s, *host[3:], 0.25, None, window)
        np.testing.assert_allclose(np.asarray(outs[layer]), want, atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}")


def test_pool_variant_threads_the_pool_and_reads_its_layer():
    rng = np.random.default_rng(11)
    args, host = make_batch(
        rng,
        page_size=8,
        q_lens=(4, 1, 2),
        ctx_lens=(11, 30, 0),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=2,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool = jnp.full((3, 2, *k.shape), jnp.nan, k.dtype).at[1, 0].set(k).at[1, 1].set(v)
    got, pool_out = blocked_paged_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.25, **SMALL_BLOCKS)
    np.testing.assert_allclose(np.asarray(got), brute_force(*host, 0.25, None), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(pool_out), np.asarray(pool))


def test_bfloat16_pool_and_queries():
    rng = np.random.default_rng(2)
    args, host = make_batch(
        rng, page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=1, dtype=jnp.bfloat16, **MIXED
    )
    got = blocked_paged_attention(*args, sm_scale=0.25)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), brute_force(*host, 0.25, None), atol=2e-2, rtol=2e-2)


def test_cpu_default_backend_is_the_blocked_one():
    assert dispatch.default_backend_for("cpu") == "xla"
    assert dispatch.get_implementation("ragged_paged_attention", "xla") is blocked_paged_attention
    # the pool variant: the native decode kernel for decodes when built (test_native_decode), else this one
    assert dispatch.get_implementation("ragged_paged_attention_pool", "xla") is native.cpu_paged_attention_pool
    assert pallas_kernels.resolve_backend("reference") == "reference"  # the reference stays selectable


@pytest.mark.parametrize("page_size", (1, 16))
def test_every_default_query_tile_and_multi_block_decode_equal_brute_force(page_size):
    """Default block sizes on sequences whose new tokens fill each query tile exactly and
    one past it (16 | 17 | 32 | 33 | 64 | 65 tokens), and a decode batch whose contexts span
    several of the decode KV blocks (``DEFAULT_DECODE_KV_BLOCK_TOKENS``)."""
    rng = np.random.default_rng(page_size)
    edges = sorted({n for t in DEFAULT_Q_BLOCKS[:-1] for n in (t, t + 1)})
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=edges,
        ctx_lens=[37] * len(edges),
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=5,
        dtype=jnp.float32,
    )
    real = int(host[5][-1])  # the padding tokens after them are checked elsewhere
    got = np.asarray(blocked_paged_attention(*args, sm_scale=0.3))
    np.testing.assert_allclose(got[:real], brute_force(*host, 0.3, None)[:real], atol=2e-5, rtol=2e-5)
    contexts = [
        3 * DEFAULT_DECODE_KV_BLOCK_TOKENS + 5,
        DEFAULT_DECODE_KV_BLOCK_TOKENS,
        1,
        2 * DEFAULT_DECODE_KV_BLOCK_TOKENS - 1,
    ]
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=[1] * 4,
        ctx_lens=contexts,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    np.testing.assert_allclose(
        np.asarray(blocked_paged_attention(*args, sm_scale=0.3)), brute_force(*host, 0.3, None), atol=2e-5, rtol=2e-5
    )
