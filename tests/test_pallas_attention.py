"""Ragged paged attention: Pallas (interpret mode) == pure-JAX reference == brute force.

Inputs are fresh random ragged batches: sequences extending by several tokens on
a cached prefix, one-token decodes, pure prefills, padding sequences and padding
tokens, shuffled page tables.  Every KV slot nobody wrote, every page-table entry
past a sequence's pages and every padding query is NaN/garbage-poisoned, so a
kernel that reads memory it should not turns the output into NaN and fails.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import dispatch
from pallas_kernels.attention import (
    AttentionShapeError,
    ragged_paged_attention_pallas,
    ragged_paged_attention_pool_pallas,
)
from pallas_kernels.reference import ragged_paged_attention_pool_reference, ragged_paged_attention_reference


def make_batch(rng, *, page_size, q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, pad_tokens, dtype):
    """Random ragged batch; returns (args tuple, NumPy copies for the brute force)."""
    q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
    seq_lens = ctx_lens + q_lens
    batch = len(q_lens)
    pages_needed = -(-seq_lens // page_size)
    num_pages = int(pages_needed.sum()) + 3
    max_pages = int(pages_needed.max(initial=0)) + 2
    perm = rng.permutation(num_pages)
    table = rng.integers(-(10**6), 10**6, size=(batch, max_pages)).astype(np.int32)  # garbage past the end
    k_pages = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pages = k_pages.copy()
    used = 0
    for b in range(batch):
        table[b, : pages_needed[b]] = perm[used : used + pages_needed[b]]
        used += pages_needed[b]
        for t in range(seq_lens[b]):
            page, off = table[b, t // page_size], t % page_size
            k_pages[page, off] = rng.standard_normal((num_kv_heads, head_dim))
            v_pages[page, off] = rng.standard_normal((num_kv_heads, head_dim))
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(query_start[-1]) + pad_tokens
    q = np.full((num_tokens, num_q_heads, head_dim), np.nan, np.float32)
    q[: query_start[-1]] = rng.standard_normal((int(query_start[-1]), num_q_heads, head_dim))

    def cast(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, dtype)

    args = (
        cast(q),
        cast(k_pages),
        cast(v_pages),
        jnp.asarray(table),
        jnp.asarray(seq_lens, jnp.int32),
        jnp.asarray(query_start),
    )
    # Brute force reads the *cast* values so bf16 rounding of inputs is shared.
    host = tuple(np.asarray(a, np.float32) for a in args[:3]) + (table, seq_lens, query_start)
    return args, host


def brute_force(q, k_pages, v_pages, table, seq_lens, query_start, sm_scale, soft_cap, window=None, sinks=None):
    """Dense per-token softmax attention in float64 NumPy; with ``window`` a token at
    position p reads positions max(0, p - window + 1)..p only; with ``sinks[num_q_heads]``
    head h's denominator gains exp(sinks[h]) (a score with no value)."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    for b in range(len(seq_lens)):
        q_len = query_start[b + 1] - query_start[b]
        for i in range(q_len):
            t = query_start[b] + i
            pos = seq_lens[b] - q_len + i
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [(table[b, p // page_size], p % page_size) for p in range(first, pos + 1)]
            k = np.stack([k_pages[pg, off] for pg, off in slots]).astype(np.float64)  # [K, Hkv, D]
            v = np.stack([v_pages[pg, off] for pg, off in slots]).astype(np.float64)
            for h in range(num_q_heads):
                s = k[:, h // group] @ q[t, h].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
                p = np.exp(s - top)
                denominator = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
                out[t, h] = (p / denominator) @ v[:, h // group]
    return out


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=2e-5, rtol=2e-5)


MIXED = dict(q_lens=(5, 1, 3, 1, 0, 17), ctx_lens=(7, 20, 0, 33, 0, 40))  # extend, decode, prefill, pad seq


@pytest.mark.parametrize("page_size", (1, 8, 16, 64))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("soft_cap", (None, 5.0))
def test_interpret_equals_reference_and_brute_force(page_size, dtype, soft_cap):
    rng = np.random.default_rng(page_size * 31 + (soft_cap is None))
    args, host = make_batch(
        rng, page_size=page_size, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=3, dtype=dtype, **MIXED
    )
    scale = 1 / math.sqrt(16)
    got = ragged_paged_attention_pallas(*args, sm_scale=scale, soft_cap=soft_cap, interpret=True)
    ref = ragged_paged_attention_reference(*args, sm_scale=scale, soft_cap=soft_cap)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    got32, ref32 = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(got32).any()
    np.testing.assert_allclose(got32, ref32, **_tol(dtype))
    n_real = int(host[5][-1])
    np.testing.assert_array_equal(got32[n_real:], 0.0)  # padding tokens
    want = brute_force(*host, scale, soft_cap)
    np.testing.assert_allclose(got32, want, **_tol(dtype))
    np.testing.assert_allclose(ref32, want, **_tol(dtype))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    page_size=st.sampled_from([1, 2, 8, 16, 64]),
    heads=st.sampled_from([(4, 4), (8, 2), (4, 1), (6, 3)]),
    batch=st.integers(1, 5),
    decode_only=st.booleans(),
    with_sinks=st.booleans(),
)
def test_random_ragged_batches(seed, page_size, heads, batch, decode_only, with_sinks):
    rng = np.random.default_rng(seed)
    q_lens = np.ones(batch, int) if decode_only else rng.integers(0, 9, size=batch)
    ctx_lens = rng.integers(0, 70, size=batch)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        pad_tokens=int(rng.integers(0, 4)),
        dtype=jnp.float32,
    )
    if args[0].shape[0] == 0:
        return
    max_q = 1 if decode_only else None
    sinks = make_sinks(rng, heads[0]) if with_sinks else None
    got = ragged_paged_attention_pallas(*args, sm_scale=0.3, sinks=sinks, max_q_len=max_q, block_kv=16, interpret=True)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.3, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)
    want = brute_force(*host, 0.3, None, sinks=None if sinks is None else np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_dispatch_interpret_and_reference_agree():
    rng = np.random.default_rng(9)
    args, _ = make_batch(
        rng,
        page_size=4,
        q_lens=(3, 1),
        ctx_lens=(9, 4),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=1,
        dtype=jnp.float32,
    )
    a = dispatch.ragged_paged_attention(*args, sm_scale=0.2, backend="interpret")
    b = dispatch.ragged_paged_attention(*args, sm_scale=0.2, backend="reference")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_bad_inputs_raise_typed_errors():
    rng = np.random.default_rng(1)
    args, _ = make_batch(
        rng,
        page_size=4,
        q_lens=(2,),
        ctx_lens=(3,),
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    with pytest.raises(AttentionShapeError):  # 6 q heads over 4 kv heads
        ragged_paged_attention_pallas(
            q, jnp.concatenate([k, k], 2), jnp.concatenate([v, v], 2), table, seq_lens, qs, sm_scale=1.0, interpret=True
        )
    with pytest.raises(AttentionShapeError):
        ragged_paged_attention_pallas(q, k, v, table, seq_lens[:0], qs, sm_scale=1.0, interpret=True)
    with pytest.raises(AttentionShapeError):  # compiled path needs a power-of-two head_dim
        ragged_paged_attention_pallas(q[..., :12], k[..., :12], v[..., :12], table, seq_lens, qs, sm_scale=1.0)


@pytest.mark.parametrize("layer", (0, 2))
def test_pool_variant_reads_the_layer_in_place(layer):
    """``*_pool`` on the whole [L, 2, P, S, H, D] pool == the per-layer call on that layer's K/V."""
    rng = np.random.default_rng(layer)
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
    other = jnp.full((3, 2, *k.shape), jnp.nan, k.dtype)  # NaN layers: reading the wrong layer fails
    pool = other.at[layer, 0].set(k).at[layer, 1].set(v)
    want = brute_force(*host, 0.25, None)
    for backend in ("interpret", "reference"):
        got, _ = dispatch.ragged_paged_attention_pool(
            q, pool, layer, table, seq_lens, qs, sm_scale=0.25, backend=backend
        )
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    with pytest.raises(AttentionShapeError):
        dispatch.ragged_paged_attention_pool(q, pool, 3, table, seq_lens, qs, sm_scale=0.25, backend="interpret")


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
    ids=("f32q-bf16kv", "bf16q-f32kv"),
)
def test_mixed_query_and_kv_dtypes(q_dtype, kv_dtype):
    """An f32 model over a bf16 KV pool (and the reverse) computes in the promoted dtype.

    Triton's dot needs equal operand dtypes; the kernel once passed them through
    unpromoted and failed to lower for the engine's f32-model/bf16-pool step.
    """
    rng = np.random.default_rng(5)
    args, host = make_batch(
        rng, page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=16, pad_tokens=2, dtype=jnp.bfloat16, **MIXED
    )
    q, k, v, table, seq_lens, qs = args
    q, k, v = q.astype(q_dtype), k.astype(kv_dtype), v.astype(kv_dtype)  # bf16-exact values either way
    got = ragged_paged_attention_pallas(q, k, v, table, seq_lens, qs, sm_scale=0.25, interpret=True)
    ref = ragged_paged_attention_reference(q, k, v, table, seq_lens, qs, sm_scale=0.25)
    assert got.dtype == ref.dtype == q_dtype
    want = brute_force(*host, 0.25, None)
    tol = dict(atol=2e-2, rtol=2e-2) if q_dtype == jnp.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)
    np.testing.assert_allclose(np.asarray(ref, np.float32), want, **tol)


def test_traced_layer_index_under_scan_reads_and_writes_each_layer():
    """Inside ``jax.lax.scan`` the layer is a traced scalar: ``write_kv`` writes row l and
    pool attention (interpret and reference) reads row l, for every l, like the model's step."""
    import jax

    import pallas_kernels

    rng = np.random.default_rng(7)
    layers = 3
    args, host = make_batch(
        rng,
        page_size=8,
        q_lens=(3, 1),
        ctx_lens=(9, 17),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=1,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    # Layer l's K/V = the batch's K/V scaled by (l + 1); NaN elsewhere. The new tokens' K/V
    # are written by write_kv inside the scan (their slots start out NaN).
    scale = jnp.arange(1, layers + 1, dtype=jnp.float32)[:, None, None, None, None, None]
    pool = jnp.stack([k, v])[None] * scale  # [L, 2, P, S, H, D]
    page_size = k.shape[1]
    slots, new_k, new_v = [], [], []
    for b in range(len(seq_lens)):
        n = int(qs[b + 1] - qs[b])
        for pos in range(int(seq_lens[b]) - n, int(seq_lens[b])):
            page = int(table[b, pos // page_size])
            slots.append(page * page_size + pos % page_size)
            new_k.append(np.asarray(k[page, pos % page_size]))
            new_v.append(np.asarray(v[page, pos % page_size]))
    slots += [pool.shape[2] * page_size] * (q.shape[0] - len(slots))  # padding tokens: dropped
    pad = q.shape[0] - len(new_k)
    new_k = jnp.asarray(np.stack(new_k + [np.zeros_like(new_k[0])] * pad))
    new_v = jnp.asarray(np.stack(new_v + [np.zeros_like(new_v[0])] * pad))
    slot_mapping = jnp.asarray(slots, jnp.int32)
    flat = pool.reshape(layers, 2, -1, *k.shape[2:])
    pool = flat.at[:, :, slot_mapping[: q.shape[0] - pad]].set(jnp.nan).reshape(pool.shape)

    for backend in ("interpret", "reference"):

        @jax.jit
        def run(pool, backend=backend):
            def body(pool, layer_idx):
                s = (layer_idx + 1).astype(jnp.float32)
                pool = pallas_kernels.write_kv(pool, layer_idx, new_k * s, new_v * s, slot_mapping)
                out, pool = dispatch.ragged_paged_attention_pool(
                    q, pool, layer_idx, table, seq_lens, qs, sm_scale=0.25, backend=backend
                )
                return pool, out

            return jax.lax.scan(body, pool, jnp.arange(layers, dtype=jnp.int32))

        _, outs = run(pool)
        for layer in range(layers):
            s = layer + 1
            want = brute_force(host[0], host[1] * s, host[2] * s, *host[3:], 0.25, None)
            np.testing.assert_allclose(
                np.asarray(outs[layer]), want, atol=2e-5, rtol=2e-5, err_msg=f"{backend} layer {layer}"
            )


# --- learned attention sinks (GPT-OSS) ---------------------------------------------


def make_sinks(rng, num_q_heads):
    """Random float32 sinks [num_q_heads] with a dominating one (+8: most of the head's mass
    goes to the sink) and vanishing ones (-30, -1e4: the head is plain softmax)."""
    sinks = rng.normal(0.0, 2.0, size=num_q_heads).astype(np.float32)
    sinks[0] = 8.0
    sinks[-1] = -1e4
    if num_q_heads > 2:
        sinks[1] = -30.0
    return jnp.asarray(sinks)


def _check_sinks(got, ref, want, host, dtype):
    got32, ref32 = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert not np.isnan(got32).any()
    np.testing.assert_allclose(got32, ref32, **_tol(dtype))
    np.testing.assert_allclose(got32, want, **_tol(dtype))
    np.testing.assert_array_equal(got32[int(host[5][-1]) :], 0.0)  # padding tokens


@pytest.mark.parametrize(
    ("heads", "page_size", "soft_cap", "window", "dtype"),
    [
        ((8, 2), 8, None, None, jnp.float32),  # GQA, full attention
        ((4, 1), 4, 5.0, 6, jnp.float32),  # MQA, soft cap, sliding window
        ((4, 2), 16, None, 9, jnp.bfloat16),  # GQA, window, bf16
    ],
    ids=("gqa", "mqa-softcap-window", "gqa-window-bf16"),
)
def test_sinks_extend_batch_equals_reference_and_brute_force(heads, page_size, soft_cap, window, dtype):
    """A mixed batch (extend, decode, prefill, padding sequence, padding tokens) with sinks."""
    rng = np.random.default_rng(page_size * 7 + heads[0])
    args, host = make_batch(
        rng,
        page_size=page_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        pad_tokens=3,
        dtype=dtype,
        q_lens=(5, 1, 3, 0, 9),
        ctx_lens=(7, 20, 0, 0, 14),
    )
    sinks = make_sinks(rng, heads[0])
    kw = dict(sm_scale=0.25, soft_cap=soft_cap, sliding_window=window, sinks=sinks)
    got = ragged_paged_attention_pallas(*args, **kw, block_kv=16, interpret=True)
    ref = ragged_paged_attention_reference(*args, **kw)
    want = brute_force(*host, 0.25, soft_cap, window=window, sinks=np.asarray(sinks))
    _check_sinks(got, ref, want, host, dtype)


@pytest.mark.parametrize("window", (None, 5))
def test_sinks_decode_batch(window):
    """Decode-shaped batch (max_q_len=1, one token per sequence) with GQA, sinks and padding."""
    rng = np.random.default_rng(11 + (window or 0))
    args, host = make_batch(
        rng,
        page_size=4,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=1,  # with the padding sequence: T == B, like the engine's decode bucket
        dtype=jnp.float32,
        q_lens=(1, 1, 0, 1, 1),
        ctx_lens=(0, 12, 0, 30, 6),
    )
    sinks = make_sinks(rng, 8)
    got = ragged_paged_attention_pallas(
        *args, sm_scale=0.3, sliding_window=window, sinks=sinks, max_q_len=1, block_kv=16, interpret=True
    )
    ref = ragged_paged_attention_reference(*args, sm_scale=0.3, sliding_window=window, sinks=sinks)
    want = brute_force(*host, 0.3, None, window=window, sinks=np.asarray(sinks))
    _check_sinks(got, ref, want, host, jnp.float32)


def test_sinks_limits_and_no_sinks_program():
    """Sinks of -1e4 leave plain softmax; +60 sends (almost) all mass to the sink; and
    ``sinks=None`` is today's kernel: no extra operand reaches the pallas_call."""
    rng = np.random.default_rng(3)
    args, _ = make_batch(
        rng,
        page_size=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=1,
        dtype=jnp.float32,
        q_lens=(3, 1),
        ctx_lens=(5, 9),
    )
    run = functools.partial(ragged_paged_attention_pallas, sm_scale=0.25, block_kv=16, interpret=True)
    plain = np.asarray(run(*args))
    np.testing.assert_allclose(np.asarray(run(*args, sinks=jnp.full((4,), -1e4))), plain, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(run(*args, sinks=jnp.full((4,), 60.0))), 0.0, atol=1e-20)

    def pallas_operands(**kw):
        jaxpr = jax.make_jaxpr(lambda *a: run(*a, **kw))(*args)
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        return len(eqn.invars)

    assert pallas_operands() == 8
    assert pallas_operands(sinks=jnp.zeros((4,))) == 9


def test_sinks_pool_entry_point_with_traced_sinks_and_window():
    """The whole-pool variant with sinks and window as traced jit arguments (one program
    serves every layer's sinks) == the pool reference == brute force."""
    rng = np.random.default_rng(21)
    layer = 1
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
    pool = jnp.full((2, 2, *k.shape), jnp.nan, k.dtype).at[layer, 0].set(k).at[layer, 1].set(v)
    sinks = make_sinks(rng, 4)

    @jax.jit
    def both(sinks, window):
        kw = dict(sm_scale=0.25, sliding_window=window, sinks=sinks)
        got = ragged_paged_attention_pool_pallas(q, pool, layer, table, seq_lens, qs, **kw, interpret=True)
        ref, _ = ragged_paged_attention_pool_reference(q, pool, layer, table, seq_lens, qs, **kw)
        return got, ref

    for window in (0, 7):  # 0: full attention
        got, ref = both(sinks, jnp.int32(window))
        want = brute_force(*host, 0.25, None, window=window or None, sinks=np.asarray(sinks))
        _check_sinks(got, ref, want, host, jnp.float32)


def test_bad_sinks_raise_typed_errors():
    rng = np.random.default_rng(2)
    args, _ = make_batch(
        rng,
        page_size=4,
        q_lens=(2,),
        ctx_lens=(3,),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    for bad in (jnp.zeros((2,)), jnp.zeros((2, 2)), jnp.zeros(()), jnp.zeros((5,))):
        with pytest.raises(AttentionShapeError, match="sinks"):
            ragged_paged_attention_pallas(*args, sm_scale=1.0, sinks=bad, interpret=True)
    q, k, v, table, seq_lens, qs = args
    pool = jnp.stack([k, v])[None]
    with pytest.raises(AttentionShapeError, match="sinks"):
        ragged_paged_attention_pool_pallas(
            q, pool, 0, table, seq_lens, qs, sm_scale=1.0, sinks=jnp.zeros((8,)), interpret=True
        )
    with pytest.raises(AttentionShapeError, match="sinks"):
        ragged_paged_attention_pallas(*args, sm_scale=1.0, sinks=jnp.zeros((4,), jnp.bool_), interpret=True)
