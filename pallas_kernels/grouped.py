"""Page moves in and out of a pool with layer groups (``layout.GroupedPoolLayout``).

The pool is ``[1, 2, num_rows, S, H, D]``; a page-first block of pages
``[n, L, 2, S, H, D]`` (the staging, host and storage layout) goes to / comes from rows
``rows[n, L]`` (``GroupedPoolLayout.rows``: each layer's base plus the page's id in its
layer's group).  Indexing ``pool[0, :, rows]`` gives exactly the page-first block (the
advanced indices come first), so each move is one XLA gather or scatter; rows out of the
pool are dropped by a scatter and clipped by a gather (padding rows: junk).

These are the XLA implementations on every platform: one indexed copy per page and
layer, the same traffic as the layer-first pool's scatter.  A Pallas kernel for GPUs is
future work (docs/models.md, "Layer groups").
"""

from __future__ import annotations

import jax

from pallas_kernels import sharded
from pallas_kernels.quant_transfer import dequantize_pages_reference, quantize_pages_reference
from pallas_kernels.reference import to_kv_dtype


def _check(pool: jax.Array, rows: jax.Array) -> None:
    if pool.ndim != 6 or pool.shape[:2] != (1, 2):
        raise ValueError(f"a grouped pool is [1, 2, rows, S, H, D], got {pool.shape}")
    if rows.ndim != 2:
        raise ValueError(f"rows must be [pages, layers], got {rows.shape}")


def scatter_pages_grouped_reference(pool: jax.Array, staging: jax.Array, rows: jax.Array) -> jax.Array:
    """Write page-first ``staging[n, L, 2, S, H, D]`` into ``pool`` at ``rows[n, L]``."""
    _check(pool, rows)
    return pool.at[0, :, rows].set(to_kv_dtype(staging, pool.dtype), mode="drop")


def gather_pages_grouped_reference(pool: jax.Array, rows: jax.Array) -> jax.Array:
    """Rows ``rows[n, L]`` of ``pool`` as page-first ``[n, L, 2, S, H, D]``."""
    _check(pool, rows)
    return pool.at[0, :, rows].get(mode="clip")


def scatter_pages_grouped(pool: jax.Array, staging: jax.Array, rows: jax.Array) -> jax.Array:
    """``scatter_pages_grouped_reference``, per shard of the KV heads under tensor parallelism."""
    return sharded.per_head_shard(scatter_pages_grouped_reference, (pool, staging, rows), (4, 4, None), 4)


def gather_pages_grouped(pool: jax.Array, rows: jax.Array) -> jax.Array:
    return sharded.per_head_shard(gather_pages_grouped_reference, (pool, rows), (4, None), 4)


def scatter_dequantize_grouped(pool: jax.Array, q: jax.Array, scales: jax.Array, rows: jax.Array) -> jax.Array:
    """Load side in a quantized tier format: dequantize ``(q, scales[n, L, 2, H])`` while scattering."""

    def impl(pool, q, scales, rows):
        return scatter_pages_grouped_reference(pool, dequantize_pages_reference(q, scales, pool.dtype), rows)

    return sharded.per_head_shard(impl, (pool, q, scales, rows), (4, 4, 3, None), 4)


def gather_quantize_grouped(pool: jax.Array, rows: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Backup side: gather ``rows`` and quantize them to ``fmt`` (``"fp8"`` / ``"int8"``)."""

    def impl(pool, rows):
        return quantize_pages_reference(gather_pages_grouped_reference(pool, rows), fmt)

    return sharded.per_head_shard(impl, (pool, rows), (4, None), (4, 3))


__all__ = [
    "gather_pages_grouped",
    "gather_pages_grouped_reference",
    "gather_quantize_grouped",
    "scatter_dequantize_grouped",
    "scatter_pages_grouped",
    "scatter_pages_grouped_reference",
]
