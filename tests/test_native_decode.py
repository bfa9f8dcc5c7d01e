"""The native paged-decode kernel (``pallas_kernels.native``, the ``"xla"`` backend's decode
attention on CPU) against the float64 brute force and the block-causal XLA decode.

Batches come from ``test_pallas_attention.make_batch``: unwritten KV slots and page-table
entries past a sequence's pages are NaN / garbage, so reading what it should not turns
the output into NaN.  The shapes reach both code paths of the kernel: the vector one
(head_dim and page size multiples of 8) and the plain loops (page size 4, head_dim 12).
Learned attention sinks (GPT-OSS) are checked against the pure-JAX reference and, where a
token sees a single key, against the closed form; the helpers here serve the extend's
tests too (tests/test_native_extend.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_attention import brute_force, make_batch, make_sinks

from pallas_kernels import dispatch, native
from pallas_kernels.blocked import blocked_paged_attention_pool
from pallas_kernels.reference import ragged_paged_attention_pool_reference

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def nan_pool(k, v, layers=3, layer=1):
    """A NaN-filled pool ``[layers, 2, P, S, H, D]`` with ``k``/``v`` as layer ``layer``."""
    return jnp.full((layers, 2, *k.shape), jnp.nan, k.dtype).at[layer, 0].set(k).at[layer, 1].set(v)


@pytest.mark.parametrize(
    "page_size,head_dim,heads",
    [(16, 64, (9, 3)), (16, 16, (8, 2)), (8, 32, (4, 4)), (4, 12, (6, 3)), (16, 12, (2, 1))],
)
@pytest.mark.parametrize("soft_cap", (None, 5.0))
@pytest.mark.parametrize("window", (None, 0, 1, 7, 40))
def test_decode_batch_equals_brute_force(page_size, head_dim, heads, soft_cap, window):
    rng = np.random.default_rng(page_size * 100 + head_dim + (window or 0))
    contexts = (0, 5, 16, 47, 130, 3)  # a first token, page edges, several pages, a short row
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=[1] * len(contexts),
        ctx_lens=contexts,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    got, pool_out = native.paged_decode_attention_pool(
        q, nan_pool(k, v), 1, table, seq_lens, qs, sm_scale=0.3, soft_cap=soft_cap, sliding_window=window
    )
    got = np.asarray(got)
    assert not np.isnan(got).any()
    want = brute_force(*host, 0.3, soft_cap, None if not window else window)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_padding_rows_give_zeros_and_a_padded_extend_with_as_many_tokens_as_rows():
    """Rows past ``query_start[-1]`` (the runner's padding) give zeros; a batch with as many
    tokens as rows that is really an extend (one row of 3 tokens, two empty rows) is
    attended token by token, as the XLA decode does."""
    rng = np.random.default_rng(5)
    args, host = make_batch(
        rng,
        page_size=16,
        q_lens=(1, 1, 0, 0),
        ctx_lens=(20, 33, 0, 0),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=2,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    q = jnp.where(jnp.isnan(q), 0.0, q)
    got = np.asarray(native.paged_decode_attention_pool(q, nan_pool(k, v), 1, table, seq_lens, qs, sm_scale=0.25)[0])
    np.testing.assert_allclose(got[:2], brute_force(*host, 0.25, None)[:2], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[2:], 0.0)
    args, host = make_batch(
        rng,
        page_size=16,
        q_lens=(3, 0, 0),
        ctx_lens=(21, 0, 0),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    got = np.asarray(native.paged_decode_attention_pool(q, nan_pool(k, v), 1, table, seq_lens, qs, sm_scale=0.25)[0])
    np.testing.assert_allclose(got, brute_force(*host, 0.25, None), atol=2e-5, rtol=2e-5)


def test_rows_sharing_a_prefix_and_long_rows_split_across_threads():
    """Rows whose pages start the same (grouped: each shared page read once for all) but
    end differently, beside a row of its own; few rows, so each is cut into parts and
    merged.  Against the XLA decode and the brute force."""
    rng = np.random.default_rng(9)
    page_size, prefix_pages = 16, 40
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=[1] * 4,
        ctx_lens=(700, 655, 641, 300),
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    k, v, table = np.asarray(k), np.asarray(v), np.asarray(table).copy()
    for row in (1, 2):  # rows 1 and 2 read row 0's first 40 pages (a shared document)
        table[row, :prefix_pages] = table[0, :prefix_pages]
    host = (host[0], k, v, table, *host[4:])
    table = jnp.asarray(table)
    pool = nan_pool(jnp.asarray(k), jnp.asarray(v))
    got = np.asarray(native.paged_decode_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.125)[0])
    np.testing.assert_allclose(got, brute_force(*host, 0.125, None), atol=2e-5, rtol=2e-5)
    xla = np.asarray(blocked_paged_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.125)[0])
    np.testing.assert_allclose(got, xla, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "page_size,head_dim,heads",
    [(16, 64, (9, 3)), (8, 48, (8, 1)), (4, 32, (4, 4)), (16, 256, (4, 1)), (16, 24, (6, 2))],
)
@pytest.mark.parametrize("soft_cap,window,with_sinks", [(None, None, False), (5.0, 37, True), (None, 100, False)])
def test_tokens_on_a_shared_page_are_scored_together(page_size, head_dim, heads, soft_cap, window, with_sinks):
    """Seven tokens over one document (the tiled path: their query heads in vector lanes,
    each shared page scored once for all), ending at different slots of the same last
    shared page (row 4 is row 0 cut short) and at pages of their own, beside a token of its
    own; windows cut each lane at a different slot.  head_dim 24 takes the per-token path
    (the tiles need a multiple of 16), head_dim 48 a 32- and a 16-dim values tile at 512
    bits.  Against the float64 brute force, sinks included."""
    rng = np.random.default_rng(page_size + head_dim)
    prefix = 23 * 16 // page_size  # the shared document's pages
    ctx = (400, 390, 377, 368, 371, 366, 390, 120)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=[1] * len(ctx),
        ctx_lens=ctx,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    k, v, table = np.asarray(k), np.asarray(v), np.asarray(table).copy()
    for row in range(1, 7):
        table[row, :prefix] = table[0, :prefix]
    table[4] = table[0]  # row 4: row 0's pages, 30 positions shorter (same last page, fewer slots)
    host = (host[0], k, v, table, *host[4:])
    table = jnp.asarray(table)
    pool = nan_pool(jnp.asarray(k), jnp.asarray(v))
    sinks = make_sinks(rng, heads[0]) if with_sinks else None
    options = dict(sm_scale=0.2, soft_cap=soft_cap, sliding_window=window, sinks=sinks)
    got = np.asarray(native.paged_decode_attention_pool(q, pool, 1, table, seq_lens, qs, **options)[0])
    assert not np.isnan(got).any()
    want = brute_force(*host, 0.2, soft_cap, window, sinks=None if sinks is None else np.asarray(sinks))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def check_traced_layer_and_window_under_a_scan(kernel, q_lens, ctx_lens, pad_tokens: int = 0) -> None:
    """Under ``jax.lax.scan`` (the model's layer loop) the layer index and window are
    traced values; each layer reads its own rows of the pool (K and V scaled by 1, 2, 3),
    and the pool comes back unchanged.  ``kernel``: a native ``*_attention_pool``."""
    rng = np.random.default_rng(3)
    args, host = make_batch(
        rng,
        page_size=16,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=pad_tokens,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    scales = (1.0, 2.0, 3.0)
    pool = jnp.stack([jnp.stack([k * s, v * s]) for s in scales])
    windows = jnp.asarray([5, 0, 12], jnp.int32)

    @jax.jit
    def run(pool):
        def body(pool, xs):
            layer, window = xs
            out, pool = kernel(q, pool, layer, table, seq_lens, qs, sm_scale=0.25, sliding_window=window)
            return pool, out

        return jax.lax.scan(body, pool, (jnp.arange(3), windows))

    pool_out, outs = run(pool)
    np.testing.assert_array_equal(np.asarray(pool_out), np.asarray(pool))
    n = int(qs[-1])
    for layer, (s, window) in enumerate(zip(scales, (5, None, 12))):
        want = brute_force(host[0], host[1] * s, host[2] * s, *host[3:], 0.25, None, window)
        np.testing.assert_allclose(
            np.asarray(outs[layer])[:n], want[:n], atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}"
        )


def test_traced_layer_and_window_under_a_scan_in_place():
    check_traced_layer_and_window_under_a_scan(native.paged_decode_attention_pool, [1] * 3, (30, 64, 9))


def test_the_cpu_backend_takes_the_decode_kernel_for_decodes(monkeypatch):
    """The ``"xla"`` backend's pool attention: a decode batch on a float32 pool is the
    native decode (a custom call in the program), an extend is not (the extend kernel,
    tests/test_native_extend.py), a bfloat16 pool the XLA attention, and
    ``$STRATA_NATIVE_KERNELS=0`` turns it off."""
    rng = np.random.default_rng(1)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=[1, 1],
        ctx_lens=(9, 20),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool = nan_pool(k, v)
    assert dispatch.get_implementation("ragged_paged_attention_pool", "xla") is native.cpu_paged_attention_pool

    def custom_calls(pool, q=q, qs=qs, seq_lens=seq_lens, table=table) -> int:
        fn = jax.jit(lambda p: native.cpu_paged_attention_pool(q, p, 1, table, seq_lens, qs, sm_scale=0.25)[0])
        return fn.lower(pool).as_text().count(native._TARGET)

    assert custom_calls(pool) == 1
    assert custom_calls(pool.astype(jnp.bfloat16)) == 0
    extend_q = jnp.concatenate([q, q])  # 4 tokens over 2 rows
    extend_qs = jnp.asarray([0, 3, 4], jnp.int32)
    assert custom_calls(pool, q=extend_q, qs=extend_qs, seq_lens=seq_lens + jnp.asarray([2, 0])) == 0
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load.cache_clear()
    try:
        assert not native.available() and "off" in native.status()
        assert custom_calls(pool) == 0
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._load.cache_clear()
    assert native.available()


def check_sinks_equal_the_reference(
    kernel, *, seed, page_size, head_dim, heads, soft_cap, window, q_lens, ctx_lens, pad_tokens
) -> None:
    """``kernel`` (a native ``*_attention_pool``) with sinks against the pure-JAX reference;
    padding tokens give zeros; head 0's +8 sink visibly changes its output; and a row's
    first token with no context (one visible key) against the closed form
    ``v * sigmoid(score - sink)`` in float64."""
    rng = np.random.default_rng(seed)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        pad_tokens=pad_tokens,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool, sinks = nan_pool(k, v), make_sinks(rng, heads[0])
    options = dict(sm_scale=0.3, soft_cap=soft_cap, sliding_window=window)
    got = np.asarray(kernel(q, pool, 1, table, seq_lens, qs, sinks=sinks, **options)[0])
    n = int(qs[-1])
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[n:], 0.0)  # padding: no key, whatever the sink
    want = ragged_paged_attention_pool_reference(q, pool, 1, table, seq_lens, qs, sinks=sinks, **options)[0]
    np.testing.assert_allclose(got[:n], np.asarray(want)[:n], atol=2e-5, rtol=2e-5)
    plain = np.asarray(kernel(q, pool, 1, table, seq_lens, qs, **options)[0])
    assert np.abs(got[:n, 0] - plain[:n, 0]).max() > 1e-2  # the sink is not ignored
    host_q, host_k, host_v, host_table, _, host_qs = host
    group, sink64 = heads[0] // heads[1], np.asarray(sinks, np.float64)
    for b in np.flatnonzero((np.asarray(ctx_lens) == 0) & (np.asarray(q_lens) > 0)):
        t, page = host_qs[b], host_table[b, 0]  # position 0: slot 0 of the row's first page
        for h in range(heads[0]):
            score = host_q[t, h].astype(np.float64) @ host_k[page, 0, h // group] * 0.3
            if soft_cap is not None:
                score = soft_cap * np.tanh(score / soft_cap)
            want_h = host_v[page, 0, h // group] / (1.0 + np.exp(sink64[h] - score))
            np.testing.assert_allclose(got[t, h], want_h, atol=2e-5, rtol=2e-5, err_msg=f"token {t} head {h}")


def check_no_sinks_equal_minus_inf_sinks(kernel, q_lens, ctx_lens, pad_tokens: int) -> None:
    """``sinks=None`` is the kernel with all -inf sinks, bit for bit, padding rows
    included (no -inf - -inf there); with -inf on every other head only, those heads still
    equal it exactly (the sinks index by query head)."""
    rng = np.random.default_rng(17)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=32,
        pad_tokens=pad_tokens,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool = nan_pool(k, v)
    n = int(qs[-1])
    for window, soft_cap in ((None, None), (7, 5.0)):
        options = dict(sm_scale=0.3, soft_cap=soft_cap, sliding_window=window)
        plain = np.asarray(kernel(q, pool, 1, table, seq_lens, qs, **options)[0])
        none = np.asarray(kernel(q, pool, 1, table, seq_lens, qs, sinks=jnp.full((9,), -jnp.inf), **options)[0])
        np.testing.assert_array_equal(none, plain)
        assert not np.isnan(plain).any()
        np.testing.assert_array_equal(plain[n:], 0.0)
        every_other = jnp.where(jnp.arange(9) % 2 == 0, -jnp.inf, 3.0)
        mixed = np.asarray(kernel(q, pool, 1, table, seq_lens, qs, sinks=every_other, **options)[0])
        assert not np.isnan(mixed).any()
        np.testing.assert_array_equal(mixed[:, 0::2], plain[:, 0::2])
        assert np.abs(mixed[:n, 1::2] - plain[:n, 1::2]).max() > 1e-2


def check_traced_sinks_under_a_scan(kernel, q_lens, ctx_lens, pad_tokens: int = 0) -> None:
    """Per-layer sinks (a ``[layers, num_q_heads]`` array the layer scan walks, as a model's
    weights are) are traced values; each layer normalizes with its own row."""
    rng = np.random.default_rng(23)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=pad_tokens,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool = jnp.stack([jnp.stack([k * s, v * s]) for s in (1.0, 2.0, 3.0)])
    sinks = jnp.stack([make_sinks(rng, 4) for _ in range(3)])

    @jax.jit
    def run(pool, sinks):
        def body(pool, xs):
            layer, layer_sinks = xs
            out, pool = kernel(q, pool, layer, table, seq_lens, qs, sm_scale=0.25, sliding_window=9, sinks=layer_sinks)
            return pool, out

        return jax.lax.scan(body, pool, (jnp.arange(3), sinks))

    _, outs = run(pool, sinks)
    n = int(qs[-1])
    for layer in range(3):
        want = ragged_paged_attention_pool_reference(
            q, pool, layer, table, seq_lens, qs, sm_scale=0.25, sliding_window=9, sinks=sinks[layer]
        )[0]
        np.testing.assert_allclose(
            np.asarray(outs[layer])[:n], np.asarray(want)[:n], atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}"
        )


@pytest.mark.parametrize(
    "page_size,head_dim,heads", [(16, 64, (9, 3)), (8, 32, (4, 4)), (4, 12, (6, 3)), (16, 16, (8, 2))]
)
@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, None), (None, 7), (5.0, 40)])
def test_decode_with_sinks_equals_the_reference(page_size, head_dim, heads, soft_cap, window):
    """GQA groups, the vector and plain paths, soft cap and window; two padding rows."""
    check_sinks_equal_the_reference(
        native.paged_decode_attention_pool,
        seed=page_size * 100 + head_dim + (window or 0),
        page_size=page_size,
        head_dim=head_dim,
        heads=heads,
        soft_cap=soft_cap,
        window=window,
        q_lens=[1] * 6 + [0, 0],
        ctx_lens=(0, 5, 16, 47, 130, 3, 0, 0),
        pad_tokens=2,
    )


def test_decode_with_sinks_split_across_threads():
    """Few long rows: each is cut into parts, merged before the sink joins the denominator."""
    check_sinks_equal_the_reference(
        native.paged_decode_attention_pool,
        seed=31,
        page_size=16,
        head_dim=64,
        heads=(9, 3),
        soft_cap=None,
        window=None,
        q_lens=[1, 1],
        ctx_lens=(700, 0),
        pad_tokens=0,
    )


def test_decode_without_sinks_equals_minus_inf_sinks():
    check_no_sinks_equal_minus_inf_sinks(native.paged_decode_attention_pool, [1] * 4 + [0, 0], (0, 9, 40, 130, 0, 0), 2)


def test_decode_traced_sinks_under_a_scan():
    check_traced_sinks_under_a_scan(native.paged_decode_attention_pool, [1] * 3, (30, 64, 9))


def test_decode_sinks_of_the_wrong_size_are_refused():
    q = jnp.zeros((2, 4, 16))
    pool = jnp.zeros((1, 2, 2, 4, 2, 16))
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\) \(one per query head\), got \(2,\)"):
        native.paged_decode_attention_pool(
            q,
            pool,
            0,
            jnp.zeros((2, 1), jnp.int32),
            jnp.asarray([3, 2]),
            jnp.asarray([0, 1, 2]),
            sm_scale=1.0,
            sinks=jnp.zeros(2),
        )[0].block_until_ready()


def test_the_cpu_backend_passes_sinks_to_the_decode_kernel_and_the_xla_attention(monkeypatch):
    """``cpu_paged_attention_pool`` with sinks: the native decode (a custom call) on a float32
    pool, the block-causal XLA attention with the kernels off; both equal the reference."""
    rng = np.random.default_rng(2)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=[1, 1, 0],
        ctx_lens=(9, 40, 0),
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=1,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool, sinks = nan_pool(k, v), make_sinks(rng, 8)
    options = dict(sm_scale=0.25, soft_cap=5.0, sliding_window=7)

    def attention(p, s):
        return native.cpu_paged_attention_pool(q, p, 1, table, seq_lens, qs, sinks=s, **options)[0]

    want = np.asarray(ragged_paged_attention_pool_reference(q, pool, 1, table, seq_lens, qs, sinks=sinks, **options)[0])
    fn = jax.jit(attention)
    assert fn.lower(pool, sinks).as_text().count(native._TARGET) == 1
    np.testing.assert_allclose(np.asarray(fn(pool, sinks))[:2], want[:2], atol=2e-5, rtol=2e-5)
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load.cache_clear()
    try:
        fallback = jax.jit(lambda p, s: attention(p, s))  # a new function, traced again: kernels off
        assert fallback.lower(pool, sinks).as_text().count(native._TARGET) == 0
        np.testing.assert_allclose(np.asarray(fallback(pool, sinks))[:2], want[:2], atol=2e-5, rtol=2e-5)
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._load.cache_clear()
    assert native.available()


def test_a_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler"):
        native.build()
