"""Ragged paged attention for one layer, as a Pallas kernel (Triton lowering).

Semantics are those of ``pallas_kernels.reference.ragged_paged_attention_reference``
(same arguments; read its docstring for shapes): a packed, ragged batch of new
tokens (prefill/extend chunks and one-token decodes mixed) attends causally to its
sequence's K/V, read through the page table, with GQA and optional soft-cap.

Kernel design (one program per ``(sequence b, row block r, kv head h)``):

* A *row* is one (new token, query head of the GQA group) pair.  Rows of sequence
  ``b`` are numbered ``t * group + g``; a program takes ``block_rows`` of them, so
  the K/V it reads serve every query head of the group at once (decode reads each
  KV byte once per sequence and KV head).
* KV is walked in blocks of ``block_kv`` token positions; each position's slot is
  ``page_table[b, pos // page_size] * page_size + pos % page_size`` and K/V rows are
  gathered from the pool viewed as ``[num_pages * page_size, kv_heads, head_dim]``,
  so any page size from 1 to 64 (or more) works with the same tiles.  The loop stops
  at the last position the block's last row may see (causal), so short sequences in
  a long batch cost nothing extra.
* A sliding window (``sliding_window``: a per-layer runtime scalar, like the layer
  index, so one compiled kernel serves local and global layers; <= 0 is full
  attention) also moves the loop's *start*: a program begins at the block holding
  the first position its first row may see, so a local layer reads only its window,
  whatever the context length.
* Online softmax in float32; masked scores are set to a large negative number and
  masked V rows to zero, so NaN-poisoned (never written) slots cannot leak.
* Learned attention sinks (``sinks``, GPT-OSS: float32 ``[num_q_heads]``) reach the
  kernel as one more operand, viewed as ``[num_kv_heads, group]``; a program reads the
  sinks of its rows' query heads (``sinks[h, row % group]``) once, after the KV loop,
  and folds them into the final normalisation only: ``m' = max(m, s)``,
  ``out = acc e^(m - m') / (l e^(m - m') + e^(s - m'))``
  (``reference.normalize_with_sinks``).  Without sinks the operand is absent and the
  kernel is the plain one, instruction for instruction.
* Rows past a sequence's end store into a trash row (``num_tokens``) that is sliced
  away; padding tokens (past ``query_start[B]``) come out as zeros.

Triton needs power-of-two tiles: ``head_dim`` must be a power of two >= 16 for the
compiled path (``attention_supported``); interpret mode accepts any shape.
Imports only jax and numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_NEG = -1e30


class AttentionShapeError(ValueError):
    """Inputs of ragged paged attention are inconsistent."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def attention_supported(head_dim: int) -> bool:
    """Whether the compiled (Triton) kernel handles this head_dim (power of two, >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _check_inputs(q, k_pages, v_pages, page_table, seq_lens, query_start) -> None:
    if q.ndim != 3:
        raise AttentionShapeError(f"q must be [T, num_q_heads, head_dim], got {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise AttentionShapeError(
            f"k_pages/v_pages must both be [P, S, H_kv, D], got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.shape[3] != q.shape[2]:
        raise AttentionShapeError(f"head_dim of q ({q.shape[2]}) != head_dim of K/V ({k_pages.shape[3]})")
    if q.shape[1] % k_pages.shape[2] != 0:
        raise AttentionShapeError(f"num_q_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k_pages.shape[2]})")
    if page_table.ndim != 2:
        raise AttentionShapeError(f"page_table must be [B, max_pages], got {page_table.shape}")
    batch = page_table.shape[0]
    if seq_lens.shape != (batch,):
        raise AttentionShapeError(f"seq_lens must be [B={batch}], got {seq_lens.shape}")
    if query_start.shape != (batch + 1,):
        raise AttentionShapeError(f"query_start must be [B+1={batch + 1}], got {query_start.shape}")


def _attention_kernel(
    layer_ref,
    window_ref,
    qstart_ref,
    seqlen_ref,
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    has_sinks: bool,
    group: int,
    block_rows: int,
    block_kv: int,
    page_size: int,
    num_pages: int,
    max_pages: int,
    num_tokens: int,
    sm_scale: float,
    soft_cap: float | None,
    k_kv: int,
    v_kv: int,
):
    # refs: (sinks_ref, o_ref) with sinks, (o_ref,) without: no sinks, no extra operand.
    sinks_ref, o_ref = refs if has_sinks else (None, *refs)
    b, rb, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]  # a runtime scalar: one compiled kernel serves every layer of a scan
    q_start = qstart_ref[b]
    q_len = qstart_ref[b + 1] - q_start
    n_rows = q_len * group
    row0 = rb * block_rows

    @pl.when(row0 < n_rows)
    def _compute():
        seq_len = seqlen_ref[b]
        rows = row0 + jnp.arange(block_rows, dtype=jnp.int32)
        row_ok = rows < n_rows
        tok_local = rows // group
        head_in_group = rows - tok_local * group
        tok = jnp.minimum(q_start + tok_local, num_tokens - 1)
        # Mixed q / KV dtypes (an f32 model over a bf16 pool, say) compute in the
        # promoted dtype, like the reference; Triton's dot needs equal operand types.  An fp8
        # pool (no implicit promotion) is upcast to the queries' dtype.
        dtype = q_ref.dtype if jnp.dtype(k_ref.dtype).itemsize == 1 else jnp.promote_types(q_ref.dtype, k_ref.dtype)
        # float32 means float32: Triton's default dot precision for f32 inputs is TF32
        # (10-bit mantissa), which would put ~1e-3 errors into an f32 pool's attention.
        precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
        q = q_ref[tok, h, head_in_group, :].astype(dtype)  # [BR, D]
        pos = seq_len - q_len + tok_local  # absolute position of each row's token
        last_tok = (jnp.minimum(row0 + block_rows, n_rows) - 1) // group
        kv_end = jnp.minimum(seq_len - q_len + last_tok + 1, seq_len)
        n_blocks = (kv_end + block_kv - 1) // block_kv
        # Sliding window (w <= 0: full attention): row r sees positions pos_r - w + 1 .. pos_r;
        # nothing before the first row's window start is read at all.
        window = window_ref[0]
        first_pos = seq_len - q_len + row0 // group
        kv_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
        first_block = kv_start // block_kv
        lo = jnp.where(window > 0, pos - window + 1, 0)  # [BR], may be negative
        head_dim = q.shape[-1]

        def body(kb, carry):
            acc, row_max, row_sum = carry
            kv_pos = kb * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            page_idx = jnp.minimum(kv_pos // page_size, max_pages - 1)
            page = jnp.clip(table_ref[b, page_idx], 0, num_pages - 1)
            slot = page * page_size + kv_pos % page_size
            k = k_ref[layer, k_kv, slot, h, :].astype(dtype)  # [BK, D]
            v = v_ref[layer, v_kv, slot, h, :].astype(dtype)
            scores = (
                jax.lax.dot_general(
                    q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
                )
                * sm_scale
            )
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (kv_pos[None, :] <= pos[:, None]) & (kv_pos[None, :] >= lo[:, None])
            scores = jnp.where(visible, scores, _NEG)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
            probs = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
            correction = jnp.exp(row_max - new_max)
            row_sum = row_sum * correction + jnp.sum(probs, axis=1)
            v = jnp.where(((kv_pos >= kv_start) & (kv_pos < kv_end))[:, None], v, jnp.zeros_like(v))
            pv = jax.lax.dot_general(
                probs.astype(dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            acc = acc * correction[:, None] + pv
            return acc, new_max, row_sum

        init = (
            jnp.zeros((block_rows, head_dim), jnp.float32),
            jnp.full((block_rows,), _NEG, jnp.float32),
            jnp.zeros((block_rows,), jnp.float32),
        )
        acc, row_max, row_sum = jax.lax.fori_loop(first_block, n_blocks, body, init)
        if sinks_ref is None:
            out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
        else:
            # The sink joins the denominator as one more score with no value, once, here:
            # m' = max(m, s); out = acc e^(m - m') / (l e^(m - m') + e^(s - m')).  A row that
            # saw no key has m = _NEG (so e^(m - m') = 0) and acc = 0: it gives 0.
            sink = sinks_ref[h, head_in_group]  # [BR] float32, this row's query head
            sink_max = jnp.maximum(row_max, sink)
            scale = jnp.exp(row_max - sink_max)
            denominator = row_sum * scale + jnp.exp(sink - sink_max)
            out = acc * jnp.where(denominator > 0, scale / denominator, 0.0)[:, None]
        dest = jnp.where(row_ok, q_start + tok_local, num_tokens)  # trash row for overhang
        o_ref[dest, h, head_in_group, :] = out.astype(o_ref.dtype)


def ragged_paged_attention_pallas(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    max_q_len: int | None = None,
    block_rows: int | None = None,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Pallas ragged paged attention; same contract as the reference (``sliding_window``
    included: None, an int or a traced int32 scalar, <= 0 = full attention; it reaches
    the kernel as a one-element operand, so windows never cause a recompile).

    ``sinks``: None, or ``[num_q_heads]`` learned attention sinks (GPT-OSS; cast to
    float32): query head h's softmax denominator gains ``exp(sinks[h])``, as in the
    reference.  They reach the kernel as an operand (concrete or traced: one compiled
    kernel serves every layer's sinks), read per query head and applied only in the
    final normalisation.  ``None`` passes no operand and compiles today's kernel.

    Extra static knobs: ``max_q_len`` bounds the new tokens of any one sequence
    (default: all T tokens; pass 1 for a decode-only batch to shrink the grid; a
    sequence with more new tokens than this is an error the kernel cannot see, its
    extra rows are not computed), ``block_rows`` rows (token x group head) per
    program (power of two, default from ``max_q_len``), ``block_kv`` KV positions per
    inner step (power of two >= 16).
    """
    _check_inputs(q, k_pages, v_pages, page_table, seq_lens, query_start)
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    k5 = k_pages.reshape(1, 1, num_pages * page_size, num_kv_heads, head_dim)
    v5 = v_pages.astype(k_pages.dtype).reshape(k5.shape)
    return _attention_call(
        q,
        k5,
        v5,
        0,
        0,
        0,
        page_size,
        page_table,
        seq_lens,
        query_start,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=sinks,
        max_q_len=max_q_len,
        block_rows=block_rows,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )


def ragged_paged_attention_pool_pallas(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    max_q_len: int | None = None,
    block_rows: int | None = None,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Same as ``ragged_paged_attention_pallas(q, kv_pool[layer, 0], kv_pool[layer, 1], ...)``
    but reads layer ``layer`` straight out of the whole layer-first pool
    ``[L, 2, P, S, H, D]``: passing ``kv_pool[layer, 0]`` to a custom call would make XLA
    materialise a copy of that layer's K and V on every call.  ``layer`` is a Python
    int or a traced int32 scalar (the layer index of a ``jax.lax.scan``); it reaches
    the kernel as a one-element operand it reads at run time (Triton has no scalar
    prefetch; with the whole pool as the operand this is the same thing), so one
    compiled kernel serves every layer.  A traced index outside ``[0, L)`` is clipped.
    ``sinks`` (None or ``[num_q_heads]``): as in ``ragged_paged_attention_pallas``.
    """
    if kv_pool.ndim != 6 or kv_pool.shape[1] != 2:
        raise AttentionShapeError(f"kv_pool must be [L, 2, P, S, H, D], got {kv_pool.shape}")
    layers, _, num_pages, page_size, num_kv_heads, head_dim = kv_pool.shape
    if isinstance(layer, int):
        if not 0 <= layer < layers:
            raise AttentionShapeError(f"layer must be in [0, {layers}), got {layer}")
    elif jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise AttentionShapeError(f"layer must be an int or an integer scalar array, got {layer!r}")
    else:
        layer = jnp.clip(layer, 0, layers - 1)
    page_view = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), kv_pool.dtype)
    _check_inputs(q, page_view, page_view, page_table, seq_lens, query_start)
    kv5 = kv_pool.reshape(layers, 2, num_pages * page_size, num_kv_heads, head_dim)
    return _attention_call(
        q,
        kv5,
        kv5,
        layer,
        0,
        1,
        page_size,
        page_table,
        seq_lens,
        query_start,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=sinks,
        max_q_len=max_q_len,
        block_rows=block_rows,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )


def _attention_call(
    q,
    k5,
    v5,
    layer,
    k_kv,
    v_kv,
    page_size,
    page_table,
    seq_lens,
    query_start,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    sinks,
    max_q_len,
    block_rows,
    block_kv,
    num_warps,
    num_stages,
    interpret,
) -> jax.Array:
    """Launch the kernel on K/V sources ``[L', 2, P*S, H, D]`` read at ``[layer, k_kv]`` /
    ``[layer, v_kv]`` (``layer``: int or int32 scalar array, read by the kernel at run time)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_slots, num_kv_heads = k5.shape[2], k5.shape[3]
    num_pages = num_slots // page_size
    batch, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    max_q = num_tokens if max_q_len is None else int(max_q_len)
    if not 1 <= max_q <= max(1, num_tokens):
        raise AttentionShapeError(f"max_q_len must be in [1, {num_tokens}], got {max_q_len}")
    if block_rows is None:
        block_rows = min(64, max(16, _next_pow2(max_q * group)))
    for name, value in (("block_rows", block_rows), ("block_kv", block_kv)):
        if value < 1 or value & (value - 1):
            raise AttentionShapeError(f"{name} must be a power of two, got {value}")
    if not interpret and not attention_supported(head_dim):
        raise AttentionShapeError(
            f"the compiled kernel needs a power-of-two head_dim >= 16, got {head_dim}; use the reference"
        )
    sink_operand = _sinks_operand(sinks, num_kv_heads, group)
    if num_tokens == 0 or batch == 0:
        return jnp.zeros_like(q)
    window = _window_operand(sliding_window)

    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    row_blocks = -(-(max_q * group) // block_rows)
    kernel = functools.partial(
        _attention_kernel,
        has_sinks=sink_operand is not None,
        group=group,
        block_rows=block_rows,
        block_kv=block_kv,
        page_size=page_size,
        num_pages=num_pages,
        max_pages=max_pages,
        num_tokens=num_tokens,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        k_kv=int(k_kv),
        v_kv=int(v_kv),
    )
    operands = [
        jnp.asarray(layer, jnp.int32).reshape(1),
        window,
        query_start.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        q4,
        k5,
        v5,
    ]
    if sink_operand is not None:
        operands.append(sink_operand)
    out = pl.pallas_call(
        kernel,
        grid=(batch, row_blocks, num_kv_heads),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((num_tokens + 1, num_kv_heads, group, head_dim), q.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="strata_ragged_paged_attention",
    )(*operands)
    out = out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
    is_real = jnp.arange(num_tokens) < query_start[batch]
    return jnp.where(is_real[:, None, None], out, jnp.zeros((), out.dtype))


def _window_operand(sliding_window: int | jax.Array | None) -> jax.Array:
    """The window as the kernel's one-element int32 operand (0: full attention)."""
    if sliding_window is None:
        return jnp.zeros((1,), jnp.int32)
    if jnp.ndim(sliding_window) != 0 or not jnp.issubdtype(jnp.result_type(sliding_window), jnp.integer):
        raise AttentionShapeError(
            f"sliding_window must be None, an int or an integer scalar array, got {sliding_window!r}"
        )
    return jnp.asarray(sliding_window, jnp.int32).reshape(1)


def _sinks_operand(sinks: jax.Array | None, num_kv_heads: int, group: int) -> jax.Array | None:
    """Sinks ``[num_q_heads]`` as the kernel's float32 ``[num_kv_heads, group]`` operand
    (query head ``kv_head * group + g``, the kernel's row layout); None stays None."""
    if sinks is None:
        return None
    num_q_heads = num_kv_heads * group
    shape = jnp.shape(sinks)
    if shape != (num_q_heads,):
        raise AttentionShapeError(
            f"sinks must be None or [num_q_heads={num_q_heads}] (one per query head), got shape {shape}"
        )
    dtype = jnp.result_type(sinks)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise AttentionShapeError(f"sinks must be real numbers (cast to float32), got dtype {dtype}")
    return jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)


__all__ = [
    "AttentionShapeError",
    "attention_supported",
    "ragged_paged_attention_pallas",
    "ragged_paged_attention_pool_pallas",
]
