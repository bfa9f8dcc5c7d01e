"""Learned attention sinks (GPT-OSS) in the pure-JAX reference and the blocked CPU attention,
against the float64 brute force of ``test_pallas_attention`` (as transformers' eager GPT-OSS
attention: the sink logit joins each head's scores in the softmax and attends to nothing).

The native CPU kernels and the Pallas kernel have their own sink tests
(``test_native_*.py``, ``test_pallas_attention.py``); this file also runs the dispatch
entry point on a two-device mesh, where the sinks are split with the query heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_attention import MIXED, brute_force, make_batch, make_sinks

import pallas_kernels
from pallas_kernels.blocked import blocked_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference

SCALE = 0.25


@pytest.mark.parametrize(
    ("page_size", "window", "soft_cap"), [(1, None, None), (4, 6, 5.0), (4, None, 5.0), (1, 6, None)]
)
def test_reference_and_blocked_with_sinks_equal_brute_force(page_size, window, soft_cap):
    rng = np.random.default_rng(page_size * 7 + (window or 0) + (soft_cap is None))
    args, host = make_batch(
        rng, page_size=page_size, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=3, dtype=jnp.float32, **MIXED
    )
    sinks = np.asarray(make_sinks(rng, 8))
    expected = brute_force(*host, SCALE, soft_cap, window, sinks)
    options = dict(sm_scale=SCALE, soft_cap=soft_cap, sliding_window=window, sinks=jnp.asarray(sinks))
    for name, got in (
        ("reference", ragged_paged_attention_reference(*args, **options)),
        ("blocked", blocked_paged_attention(*args, **options)),
        ("blocked small blocks", blocked_paged_attention(*args, q_blocks=(1, 3, 8), kv_block_tokens=8, **options)),
    ):
        got = np.asarray(got)
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5, err_msg=name)
        np.testing.assert_array_equal(got[int(host[5][-1]) :], 0.0, err_msg=f"{name}: padding tokens")
    without = np.asarray(ragged_paged_attention_reference(*args, sm_scale=SCALE, soft_cap=soft_cap))
    assert np.abs(without - expected).max() > 1e-2, "the sinks made no difference: the test would not catch them"


def test_decode_batch_with_sinks_equals_brute_force():
    rng = np.random.default_rng(3)
    args, host = make_batch(
        rng,
        page_size=4,
        q_lens=(1, 1, 1, 1),
        ctx_lens=(5, 40, 0, 17),
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    sinks = np.asarray(make_sinks(rng, 4))
    expected = brute_force(*host, SCALE, None, sinks=sinks)
    for impl in (ragged_paged_attention_reference, blocked_paged_attention):
        got = np.asarray(impl(*args, sm_scale=SCALE, sinks=jnp.asarray(sinks)))
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5, err_msg=impl.__name__)


def test_sinks_of_the_wrong_shape_are_refused():
    rng = np.random.default_rng(0)
    args, _ = make_batch(
        rng, page_size=4, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=0, dtype=jnp.float32, **MIXED
    )
    for impl in (ragged_paged_attention_reference, blocked_paged_attention):
        with pytest.raises(ValueError, match="one per query head"):
            impl(*args, sm_scale=SCALE, sinks=jnp.zeros((2,), jnp.float32))


@pytest.mark.parametrize("backend", ("xla", "reference"))
def test_pool_dispatch_splits_sinks_with_the_heads_on_a_mesh(backend):
    """``ragged_paged_attention_pool`` under a two-device head sharding: each shard gets its
    query heads' sinks (a shard reading the other's would change its heads' outputs)."""
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    from jax.sharding import Mesh

    rng = np.random.default_rng(11)
    args, host = make_batch(
        rng, page_size=4, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=2, dtype=jnp.float32, **MIXED
    )
    q, k_pages, v_pages, table, seq_lens, query_start = args
    pool = jnp.stack([k_pages, v_pages])[None]  # [L=1, 2, P, S, H, D]
    sinks = np.array(make_sinks(rng, 8))
    sinks[4] = 6.0  # the second shard's first head: a different value from the first shard's
    expected = brute_force(*host, SCALE, None, 9, sinks)
    mesh = Mesh(np.array(devices[:2]), ("tp",))
    with pallas_kernels.sharded.use_head_sharding(mesh), pallas_kernels.use_backend(backend):
        out, _ = jax.jit(
            lambda q, pool, sinks: pallas_kernels.ragged_paged_attention_pool(
                q, pool, 0, table, seq_lens, query_start, sm_scale=SCALE, sliding_window=9, sinks=sinks
            )
        )(q, pool, jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)
