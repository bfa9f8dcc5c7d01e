"""Pure-JAX references for every kernel in this package.

They define the semantics; the Pallas kernels must match them exactly (transfer)
or to float tolerance (attention).  Layouts are described in ``layout.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_kv_dtype(x: jax.Array, dtype) -> jax.Array:
    """``x`` cast to a KV pool's ``dtype``; for an 8-bit float pool, clipped to its finite
    range first (a plain cast turns anything past e4m3fn's +-448 into NaN)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating) and x.dtype != dtype:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def scatter_pages_reference(pool: jax.Array, staging: jax.Array, page_ids: jax.Array) -> jax.Array:
    """Write page-first ``staging[n, L, 2, S, H, D]`` into layer-first ``pool[L, 2, P, S, H, D]``.

    ``page_ids[n]`` are the destination pages; out-of-range ids are dropped (used for
    padding a batch of pages up to a bucket size).  Returns the updated pool; callers
    donate ``pool`` so XLA updates it in place.
    """
    layer_first = to_kv_dtype(jnp.transpose(staging, (1, 2, 0, 3, 4, 5)), pool.dtype)
    return pool.at[:, :, page_ids].set(layer_first, mode="drop")


def gather_pages_reference(pool: jax.Array, page_ids: jax.Array) -> jax.Array:
    """Read pages ``page_ids[n]`` of ``pool[L, 2, P, S, H, D]`` into page-first ``[n, L, 2, S, H, D]``."""
    picked = jnp.take(pool, page_ids, axis=2, mode="clip")
    return jnp.transpose(picked, (2, 0, 1, 3, 4, 5))


def write_kv_reference(
    kv_pool: jax.Array, layer: int | jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Write new tokens' K/V of one layer into the full pool ``[L, 2, P, S, H, D]``.

    ``k, v: [T, H, D]``; ``slot_mapping[T]`` is page_id * page_size + offset; a slot
    outside the pool (padding tokens use ``num_pages * page_size``) is dropped.
    ``layer`` is a Python int or a traced int32 scalar (the index of a layer scan):
    either way one scatter into the whole pool.  The scatter targets the whole (donated) pool
    rather than a sliced layer so XLA updates it in place instead of copying a layer.
    (Advanced indices separated by a slice put the token axis first: ``new`` is
    ``[T, 2, H, D]``.)
    """
    page_size = kv_pool.shape[3]
    new = to_kv_dtype(jnp.stack([k, v], axis=1), kv_pool.dtype)  # [T, 2, H, D]
    # Index the 6-D pool directly: a reshaped (flat-slot) view would give XLA two
    # shapes of one buffer and it would copy the pool to serve both.
    return kv_pool.at[layer, :, slot_mapping // page_size, slot_mapping % page_size].set(new, mode="drop")


def ragged_paged_attention_reference(
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
    kv_block_tokens: int = 256,
) -> jax.Array:
    """Attention of a ragged batch of new tokens over their paged K/V.

    Shapes (T = padded token count, B = padded batch size):
      q:           [T, num_q_heads, head_dim]     new tokens of all sequences, packed
      k_pages:     [num_pages, page_size, num_kv_heads, head_dim]  (this layer, already
                   holding the new tokens' K)
      v_pages:     same as k_pages
      page_table:  int32 [B, max_pages_per_seq]   page ids of each sequence, in order
      seq_lens:    int32 [B]   KV length of each sequence *including* its new tokens
                   (0 for padding sequences)
      query_start: int32 [B + 1]  sequence b owns tokens query_start[b]:query_start[b+1]
    Token i of sequence b (q_len_b new tokens) sits at absolute position
    seq_lens[b] - q_len_b + i and attends causally to KV positions 0..that position.
    Tokens past query_start[B] are padding; their output is 0.
    GQA: query head h reads KV head h // (num_q_heads // num_kv_heads).
    soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
    sliding_window: None (full attention), a Python int or a traced int32 scalar (one
    value of a per-layer array a layer scan walks).  With a window w > 0 a token at
    position p reads only KV positions max(0, p - w + 1)..p (Hugging Face's
    ``kv_idx > q_idx - w``); w <= 0 means full attention, so one scanned array can mix
    local and global layers.  KV blocks entirely older than every token's window are
    never read: the block loops start at the first block a token needs.
    sinks: None, or float32 ``[num_q_heads]`` learned attention sinks (GPT-OSS): head
    h's softmax denominator gains ``exp(sinks[h])``, a logit that attends to nothing
    (``normalize_with_sinks``).

    Flash-style online softmax over KV blocks of ``kv_block_tokens``; loops run only
    over the blocks that are needed (dynamic trip counts), so a short batch costs
    little even with a wide page table.  Two gather strategies, chosen statically:
    when T == B (a decode batch) each token gathers its own sequence's block;
    otherwise sequences are walked one by one, each of its blocks gathered once and
    scored by every token with a mask (matmul-friendly), so padding sequences of a
    large batch bucket (seq_lens 0) cost nothing.
    """
    out, _ = _ragged_attention_core(
        q,
        (k_pages, v_pages),
        lambda src, pages: (src[0][pages], src[1][pages]),
        k_pages.shape,
        page_table,
        seq_lens,
        query_start,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=sinks,
        kv_block_tokens=kv_block_tokens,
    )
    return out


def ragged_paged_attention_pool_reference(
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
    kv_block_tokens: int = 256,
) -> tuple[jax.Array, jax.Array]:
    """``ragged_paged_attention_reference`` reading layer ``layer`` (a Python int or a
    traced int32 scalar) of the whole pool.

    Returns ``(out, kv_pool)``: the caller must continue with the returned pool.
    Slicing ``kv_pool[layer, 0]`` outside the kernel would make XLA materialise the
    slice (or copy the whole donated pool) every step; reading through the pool
    threaded as a loop carry keeps the step in place.
    """
    num_layers, _, num_pages, page_size, num_kv_heads, head_dim = kv_pool.shape
    return _ragged_attention_core(
        q,
        kv_pool,
        lambda pool, pages: (pool[layer, 0, pages], pool[layer, 1, pages]),
        (num_pages, page_size, num_kv_heads, head_dim),
        page_table,
        seq_lens,
        query_start,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=sinks,
        kv_block_tokens=kv_block_tokens,
    )


def _ragged_attention_core(
    q: jax.Array,
    kv_source,
    read_block,
    kv_shape: tuple[int, ...],  # [P, S, H, D]
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    kv_block_tokens: int = 256,
):
    """Shared implementation; ``read_block(kv_source, pages[B_or_T, ppb]) -> (k, v)``.

    ``kv_source`` is carried through the block loop and returned, so when it is the
    whole (donated) pool XLA keeps updating it in place instead of copying it.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = kv_shape
    batch, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    per_token = num_tokens == batch

    token_idx = jnp.arange(num_tokens)
    # Sequence of each token (padding tokens map to the last sequence, masked below).
    seq_of_token = jnp.clip(jnp.searchsorted(query_start, token_idx, side="right") - 1, 0, batch - 1)
    is_real = token_idx < query_start[batch]
    q_lens = query_start[1:] - query_start[:-1]
    pos = seq_lens[seq_of_token] - q_lens[seq_of_token] + (token_idx - query_start[seq_of_token])
    kv_len = jnp.where(is_real, pos + 1, 0)  # KV positions this token may read
    # First KV position each token may read: 0, or the start of its window (a window <= 0 is
    # full attention).  Static None keeps the plain causal program.
    kv_lo = jnp.zeros_like(kv_len) if sliding_window is None else _window_start(pos, sliding_window, kv_len)

    pages_per_block = max(1, min(max_pages, kv_block_tokens // page_size))
    max_blocks = -(-max_pages // pages_per_block)
    table = jnp.pad(page_table, ((0, 0), (0, max_blocks * pages_per_block - max_pages)))
    table = table.reshape(batch, max_blocks, pages_per_block)
    block_tokens = pages_per_block * page_size

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)

    def online_softmax(carry, scores, visible, value_product):
        """One flash step: fold this block's scores into (acc, row_max, row_sum);
        ``value_product(probs)`` is probs @ V for the block."""
        acc, row_max, row_sum = carry
        scores = scores * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.where(visible[:, None, None, :], jnp.exp(scores - safe_max[..., None]), 0.0)
        correction = jnp.where(jnp.isfinite(row_max), jnp.exp(row_max - safe_max), 0.0)
        row_sum = row_sum * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + value_product(probs)
        return acc, new_max, row_sum

    init = (
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
        jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
    )

    if per_token:
        # Decode: each token gathers its own sequence's blocks, from the first its window
        # needs (block index first_block[t] + j), so a local layer's loop length is its
        # window, not the context.
        first_block = kv_lo // block_tokens
        end_block = -(-kv_len // block_tokens)
        num_blocks = jnp.minimum(jnp.max(end_block - first_block), max_blocks)
        tok_tables = table[seq_of_token]  # [T, max_blocks, ppb]

        def block_body(j, carry):
            *stats, src = carry
            block = jnp.minimum(first_block + j, max_blocks - 1)  # [T]
            pages = jnp.take_along_axis(tok_tables, block[:, None, None], axis=1)[:, 0]  # [T, ppb]
            kv_pos = (first_block + j)[:, None] * block_tokens + jnp.arange(block_tokens)[None, :]  # [T, K]
            visible = (kv_pos >= kv_lo[:, None]) & (kv_pos < kv_len[:, None])
            k, v = read_block(src, pages)
            k = k.reshape(num_tokens, block_tokens, num_kv_heads, head_dim)
            v = v.reshape(num_tokens, block_tokens, num_kv_heads, head_dim)
            scores = jnp.einsum("thgd,tkhd->thgk", qf, k.astype(jnp.float32))
            v_safe = jnp.where(visible[:, :, None, None], v.astype(jnp.float32), 0.0)
            stats = online_softmax(stats, scores, visible, lambda p: jnp.einsum("thgk,tkhd->thgd", p, v_safe))
            return (*stats, src)

        acc, row_max, row_sum, kv_source = jax.lax.fori_loop(0, num_blocks, block_body, (*init, kv_source))
    else:
        # Extend: sequence by sequence, each block of sequence b is gathered once and
        # scored by every token, masked to b's tokens.  Each sequence walks only its own
        # blocks, so padding rows of the batch (seq_lens 0) cost nothing: the cost follows
        # the real sequences, not the batch bucket.
        seq_blocks = jnp.minimum(-(-seq_lens // block_tokens), max_blocks)
        if sliding_window is None:
            seq_first_blocks = jnp.zeros_like(seq_blocks)
        else:  # the window of the sequence's first new token starts its loop
            first_pos = seq_lens - q_lens
            seq_first_blocks = _window_start(first_pos, sliding_window, seq_lens) // block_tokens

        def seq_body(b, carry):
            def block_body(block, carry):
                *stats, src = carry
                pages = jax.lax.dynamic_index_in_dim(table[b], block, axis=0, keepdims=False)  # [ppb]
                kv_pos = block * block_tokens + jnp.arange(block_tokens)
                in_range = (kv_pos[None, :] >= kv_lo[:, None]) & (kv_pos[None, :] < kv_len[:, None])
                visible = (seq_of_token == b)[:, None] & in_range  # [T, K]
                k, v = read_block(src, pages)
                k = k.reshape(block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
                v = v.reshape(block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
                v = jnp.where(
                    jnp.isfinite(v), v, 0.0
                )  # unwritten (e.g. NaN-poisoned) slots must not leak through 0 * NaN
                scores = jnp.einsum("thgd,khd->thgk", qf, k)
                stats = online_softmax(stats, scores, visible, lambda p: jnp.einsum("thgk,khd->thgd", p, v))
                return (*stats, src)

            return jax.lax.fori_loop(seq_first_blocks[b], seq_blocks[b], block_body, carry)

        acc, row_max, row_sum, kv_source = jax.lax.fori_loop(0, batch, seq_body, (*init, kv_source))
    out = normalize_with_sinks(acc, row_max, row_sum, head_sinks(sinks, num_kv_heads, group))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype), kv_source


def normalize_with_sinks(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array, sink: jax.Array | None) -> jax.Array:
    """The flash loop's last step: ``acc / row_sum`` (rows that saw nothing give 0).

    ``acc [..., D]``, ``row_max`` and ``row_sum [...]``; ``sink`` (None, or float32
    broadcastable to ``row_max``: each row's query head's sink logit) joins the
    denominator as one more score with no value: the running max becomes
    ``m' = max(row_max, sink)`` and ``out = acc e^(row_max - m') / (row_sum e^(row_max - m')
    + e^(sink - m'))``, so a row that saw no key (padding) still gives 0 and nothing
    overflows.  The blocked and Pallas kernels finish the same way.
    """
    if sink is None:
        return acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
    new_max = jnp.maximum(row_max, sink)
    scale = jnp.where(jnp.isfinite(row_max), jnp.exp(row_max - new_max), 0.0)
    denominator = row_sum * scale + jnp.exp(sink - new_max)
    return acc * jnp.where(row_sum > 0, scale / denominator, 0.0)[..., None]


def head_sinks(sinks: jax.Array | None, num_kv_heads: int, group: int) -> jax.Array | None:
    """Sinks ``[num_q_heads]`` as float32 ``[num_kv_heads, group]`` (query head
    ``kv_head * group + g``), the layout the flash loops hold their statistics in."""
    if sinks is None:
        return None
    if sinks.shape != (num_kv_heads * group,):
        raise ValueError(f"sinks must have shape ({num_kv_heads * group},) (one per query head), got {sinks.shape}")
    return jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)


def _window_start(pos: jax.Array, sliding_window: int | jax.Array, limit: jax.Array) -> jax.Array:
    """First KV position a token at ``pos`` reads under ``sliding_window`` (<= 0: full
    attention, 0), clipped to ``[0, limit]`` so padding (``limit`` 0) reads nothing."""
    window = jnp.asarray(sliding_window, jnp.int32)
    start = jnp.where(window > 0, pos - window + 1, 0)
    return jnp.clip(start, 0, limit)
