"""Block-causal paged attention in plain XLA: the implementation the engine runs on CPU.

Same contract as ``pallas_kernels.reference.ragged_paged_attention_reference`` (which
stays the correctness reference), computed the way a CPU wants it:

* **Extend** (``T != B``): every sequence's new tokens are cut into query blocks; a
  query block scores only the KV blocks up to its own causal edge (and, with a
  sliding window, from the first block its window reaches), so the work is the causal
  triangle plus half a block per diagonal, not the full square, and the score tile is
  ``q_block x kv_block`` whatever the chunk: memory and time linear in the chunk for a
  fixed context.  Each sequence uses the smallest query block that holds its new
  tokens (``q_blocks``), so decodes in a mixed batch and short questions do not pay
  for a big tile.
* **Decode** (``T == B``): one token per row; each token reads each KV block of its
  sequence once, from the first block its window reaches to the longest row's end, in
  blocks of at most ``decode_kv_block_tokens`` when there are several rows.

Heads are laid out for the matmuls: queries as ``[kv_head, q_block * group, head_dim]``
against keys ``[kv_block, kv_head, head_dim]``, so QK^T and PV are batched GEMMs over
the KV heads with the GQA group folded into the rows.  The online softmax is the
flash-attention recurrence in float32.

``sliding_window`` (``None``, a Python int or a traced int32 scalar; <= 0 means full
attention, so one scanned per-layer array can mix layer kinds): a token at position p
reads KV positions ``max(0, p - window + 1) .. p``; blocks wholly older than that are
never read.

``sinks`` (``None`` or float32 ``[num_q_heads]``, GPT-OSS): each query head's learned
sink logit joins its softmax denominator at the end of the flash loop
(``reference.normalize_with_sinks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import head_sinks, normalize_with_sinks

# Query block sizes, smallest first: a sequence uses the smallest that holds its new
# tokens (else the largest), so a decode row or a short question does not pay for a
# 256-row tile.  Sizes measured on a 2-core CPU (SmolLM2 shapes, docs/runtime.md): the
# 32-row tile takes a 17-32-token question over a 1,952-token prefix in 0.66x the time
# of the 64-row one.
DEFAULT_Q_BLOCKS = (16, 32, 64, 256)
DEFAULT_KV_BLOCK_TOKENS = 512
# A decode batch of two rows or more reads its KV in blocks this short: each step of the
# block loop gathers rows x block tokens, and on a 2-core CPU (SmolLM2 shapes, ~2K-token
# contexts) 64-token blocks took 0.42x (16 rows), 0.68x (8) and 0.54x (2) the time of
# 512-token ones; a single row is fastest in the long blocks (docs/runtime.md).
DEFAULT_DECODE_KV_BLOCK_TOKENS = 64
_NO_WINDOW = 1 << 30


def blocked_paged_attention(
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
    q_blocks: tuple[int, ...] = DEFAULT_Q_BLOCKS,
    kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS,
    decode_kv_block_tokens: int = DEFAULT_DECODE_KV_BLOCK_TOKENS,
) -> jax.Array:
    """Attention of a ragged batch over ``k_pages``/``v_pages`` ``[P, S, H, D]`` (see module doc)."""
    out, _ = _blocked_core(
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
        q_blocks=q_blocks,
        kv_block_tokens=kv_block_tokens,
        decode_kv_block_tokens=decode_kv_block_tokens,
    )
    return out


def blocked_paged_attention_pool(
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
    q_blocks: tuple[int, ...] = DEFAULT_Q_BLOCKS,
    kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS,
    decode_kv_block_tokens: int = DEFAULT_DECODE_KV_BLOCK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
    """``blocked_paged_attention`` reading layer ``layer`` of the whole pool ``[L, 2, P, S, H, D]``.

    Returns ``(out, kv_pool)``; the pool is threaded through the loops (as in the
    reference) so XLA keeps updating the donated pool in place.
    """
    _, _, num_pages, page_size, num_kv_heads, head_dim = kv_pool.shape
    return _blocked_core(
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
        q_blocks=q_blocks,
        kv_block_tokens=kv_block_tokens,
        decode_kv_block_tokens=decode_kv_block_tokens,
    )


def decode_token_rows(seq_lens: jax.Array, query_start: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """For a decode-shaped call (as many tokens as rows): each token's sequence (found by
    search, not assumed to be row t, since a padded extend can also have T == B) and how
    many KV positions it reads (its position + 1; 0 for a padding token)."""
    batch = query_start.shape[0] - 1
    token_idx = jnp.arange(num_tokens)
    seq_of_token = jnp.clip(jnp.searchsorted(query_start, token_idx, side="right") - 1, 0, batch - 1)
    q_lens = query_start[1:] - query_start[:-1]
    pos = seq_lens[seq_of_token] - q_lens[seq_of_token] + (token_idx - query_start[seq_of_token])
    return seq_of_token, jnp.where(token_idx < query_start[batch], pos + 1, 0)


def _window_span(sliding_window: int | jax.Array | None) -> jax.Array:
    """How many KV positions back (itself included) a token may read, as an int32 scalar."""
    if sliding_window is None:
        return jnp.int32(_NO_WINDOW)
    window = jnp.asarray(sliding_window, jnp.int32)
    return jnp.where(window > 0, window, _NO_WINDOW)


def _blocked_core(
    q: jax.Array,
    kv_source,
    read_block,
    kv_shape: tuple[int, ...],  # [P, S, H, D]
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | jax.Array | None,
    sinks: jax.Array | None,
    q_blocks: tuple[int, ...],
    kv_block_tokens: int,
    decode_kv_block_tokens: int,
):
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = kv_shape
    batch, max_pages = page_table.shape
    group = num_q_heads // num_kv_heads
    window = _window_span(sliding_window)
    sink = head_sinks(sinks, num_kv_heads, group)  # [H, G] or None
    if num_tokens == batch > 1:  # a decode batch of several rows: shorter KV blocks
        kv_block_tokens = min(kv_block_tokens, decode_kv_block_tokens)

    pages_per_block = max(1, min(max_pages, kv_block_tokens // page_size))
    max_blocks = -(-max_pages // pages_per_block)
    table = jnp.pad(page_table, ((0, 0), (0, max_blocks * pages_per_block - max_pages)))
    table = table.reshape(batch, max_blocks, pages_per_block)
    block_tokens = pages_per_block * page_size

    def read_kv(src, pages, lead_shape, guard: bool = True):
        k, v = read_block(src, pages)
        k = k.reshape(*lead_shape, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        v = v.reshape(*lead_shape, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        # Unwritten slots past a sequence's end may hold anything (NaN-poisoned in tests):
        # a masked probability of 0 times NaN would still leak.  A block wholly inside
        # every row's view holds only written slots.
        return k, (jnp.where(jnp.isfinite(v), v, 0.0) if guard else v)

    def fold(stats, scores, visible, value_product):
        """One online-softmax step; ``scores`` already scaled, ``visible`` broadcastable to
        it (None: every score counts)."""
        acc, row_max, row_sum = stats
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        if visible is not None:
            scores = jnp.where(visible, scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - safe_max[..., None])
        correction = jnp.exp(row_max - safe_max)
        row_sum = row_sum * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + value_product(probs)
        return acc, new_max, row_sum

    q_scaled = q.astype(jnp.float32) * sm_scale

    if num_tokens == batch:
        # Decode-shaped (one token per row): each token reads its own sequence's blocks.
        qd = q_scaled.reshape(batch, num_kv_heads, group, head_dim)
        seq_of_token, kv_len = decode_token_rows(seq_lens, query_start, num_tokens)
        first_pos = jnp.maximum(kv_len - window, 0)
        live = kv_len > 0
        start_block = jnp.min(jnp.where(live, first_pos // block_tokens, max_blocks))
        end_block = jnp.minimum(-(-jnp.max(kv_len) // block_tokens), max_blocks)
        token_table = table[seq_of_token]  # [T, blocks, ppb]

        def decode_body(block, carry):
            *stats, src = carry
            pages = jax.lax.dynamic_index_in_dim(token_table, block, axis=1, keepdims=False)  # [T, ppb]
            k, v = read_kv(src, pages, (batch,))
            kv_pos = block * block_tokens + jnp.arange(block_tokens)
            visible = (kv_pos[None, :] < kv_len[:, None]) & (kv_pos[None, :] >= first_pos[:, None])  # [B, K]
            scores = jnp.einsum("bhgd,bkhd->bhgk", qd, k)
            stats = fold(stats, scores, visible[:, None, None, :], lambda p: jnp.einsum("bhgk,bkhd->bhgd", p, v))
            return (*stats, src)

        init = (
            jnp.zeros((batch, num_kv_heads, group, head_dim), jnp.float32),
            jnp.full((batch, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((batch, num_kv_heads, group), jnp.float32),
        )
        acc, row_max, row_sum, kv_source = jax.lax.fori_loop(start_block, end_block, decode_body, (*init, kv_source))
        out = normalize_with_sinks(acc, row_max, row_sum, sink)
        return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype), kv_source

    # Extend.  Queries as [kv_head, token, group, dim], padded by a block so a block
    # starting at any real token can be sliced without XLA clamping its start.
    if not q_blocks or sorted(set(q_blocks)) != list(q_blocks) or q_blocks[0] <= 0:
        raise ValueError(f"q_blocks must be positive, increasing and unique, got {q_blocks}")
    pad = q_blocks[-1]
    qh = jnp.transpose(q_scaled.reshape(num_tokens, num_kv_heads, group, head_dim), (1, 0, 2, 3))
    qh = jnp.pad(qh, ((0, 0), (0, pad), (0, 0), (0, 0)))
    out0 = jnp.zeros_like(qh)
    q_lens = query_start[1:] - query_start[:-1]

    def sequence_pass(rows: int):
        """Attention of sequence b's new tokens in query blocks of ``rows`` tokens."""

        def run(b, carry):
            out, src = carry
            q_len = q_lens[b]
            context = seq_lens[b] - q_len  # tokens cached before this step's

            def q_block_body(i, carry):
                out, src = carry
                first = i * rows  # this block's first token, within the sequence
                tokens_here = jnp.minimum(rows, q_len - first)
                row_pos = context + first + jnp.arange(rows)  # absolute positions
                row_valid = jnp.arange(rows) < tokens_here
                row_first = jnp.maximum(row_pos - window + 1, 0)
                kv_start = jnp.maximum(context + first - window + 1, 0) // block_tokens
                kv_end = jnp.minimum(-(-(context + first + tokens_here) // block_tokens), max_blocks)
                start = query_start[b] + first
                qb = jax.lax.dynamic_slice_in_dim(qh, start, rows, axis=1)  # [H, rows, G, D]
                qb = qb.reshape(num_kv_heads, rows * group, head_dim)

                def kv_body(masked: bool):
                    def body(block, carry):
                        *stats, src = carry
                        pages = jax.lax.dynamic_index_in_dim(table[b], block, axis=0, keepdims=False)  # [ppb]
                        k, v = read_kv(src, pages, (), guard=masked)
                        scores = jnp.einsum("hmd,khd->hmk", qb, k)
                        if masked:
                            kv_pos = block * block_tokens + jnp.arange(block_tokens)
                            visible = (
                                (kv_pos[None, :] <= row_pos[:, None])
                                & (kv_pos[None, :] >= row_first[:, None])
                                & row_valid[:, None]
                            )  # [rows, K]
                            visible = jnp.broadcast_to(visible[:, None, :], (rows, group, block_tokens))
                            visible = visible.reshape(1, rows * group, block_tokens)
                        else:
                            visible = None
                        stats = fold(stats, scores, visible, lambda p: jnp.einsum("hmk,khd->hmd", p, v))
                        return (*stats, src)

                    return body

                # Blocks every valid row sees whole (between the window's edge and the
                # diagonal) skip the mask; the edges are masked.
                last_row_first = jnp.maximum(context + first + tokens_here - window, 0)
                interior_lo = jnp.clip(-(-last_row_first // block_tokens), kv_start, kv_end)
                interior_hi = jnp.clip((context + first + 1) // block_tokens, interior_lo, kv_end)
                carry = (
                    jnp.zeros((num_kv_heads, rows * group, head_dim), jnp.float32),
                    jnp.full((num_kv_heads, rows * group), -jnp.inf, jnp.float32),
                    jnp.zeros((num_kv_heads, rows * group), jnp.float32),
                    src,
                )
                carry = jax.lax.fori_loop(kv_start, interior_lo, kv_body(True), carry)
                carry = jax.lax.fori_loop(interior_lo, interior_hi, kv_body(False), carry)
                acc, row_max, row_sum, src = jax.lax.fori_loop(interior_hi, kv_end, kv_body(True), carry)
                row_sink = None if sink is None else jnp.tile(sink, (1, rows))  # [H, rows * G], group fastest
                result = normalize_with_sinks(acc, row_max, row_sum, row_sink).reshape(
                    num_kv_heads, rows, group, head_dim
                )
                old = jax.lax.dynamic_slice_in_dim(out, start, rows, axis=1)
                merged = jnp.where(row_valid[None, :, None, None], result, old)
                return jax.lax.dynamic_update_slice_in_dim(out, merged, start, axis=1), src

            return jax.lax.fori_loop(0, -(-q_len // rows), q_block_body, (out, src))

        return run

    passes = [sequence_pass(rows) for rows in q_blocks]

    def seq_body(b, carry):
        if len(passes) == 1:
            return passes[0](b, carry)
        size_index = sum((q_lens[b] > rows).astype(jnp.int32) for rows in q_blocks[:-1])
        return jax.lax.switch(size_index, passes, b, carry)

    out, kv_source = jax.lax.fori_loop(0, batch, seq_body, (out0, kv_source))
    out = jnp.transpose(out[:, :num_tokens], (1, 0, 2, 3)).reshape(num_tokens, num_q_heads, head_dim)
    return out.astype(q.dtype), kv_source
