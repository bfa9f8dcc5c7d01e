"""KV page transfer between the page-first staging layout and the layer-first pool.

Layouts (see ``pallas_kernels.layout``)::

    staging[n, L, 2, S, H, D]      page-first: one page is one contiguous block
    pool[L, 2, P, S, H, D]         layer-first device pool (L1)

Three implementations of each direction, all with the semantics of
``pallas_kernels.reference``:

* ``scatter_pages_pallas`` / ``gather_pages_pallas``: one Pallas kernel each.  Both
  views are flattened for free (``staging -> [n, L*2, C]``, ``pool -> [L*2, P, C]``
  with ``C = S*H*D`` elements, one *page-layer chunk*), and program ``(i, j, c)``
  copies block ``c`` of chunk ``(page i, layer/kv j)``: the layout conversion is
  nothing but the destination offset.  The scatter aliases the pool to its output
  (``input_output_aliases``), so under ``jax.jit(..., donate_argnums=0)`` pages
  nobody names are never touched or copied.  GPU lowering uses
  ``pltriton.CompilerParams``, which lowers for CUDA and ROCm alike.
* references (``pallas_kernels.reference``): one XLA scatter / gather.
* ``scatter_pages_naive`` / ``gather_pages_naive``: the fragmented path Strata
  measures against: one host->device copy plus one in-place update per page per
  layer (``n * L`` small transfers and dispatches).

Page ids: the scatter normalises negative ids like NumPy (``-1`` is the last page)
and drops ids still outside ``[0, P)`` (callers pad a bucket of pages with ``P``);
the gather clips ids into ``[0, P)``.  Both match the references exactly.

Imports only jax and numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.reference import to_kv_dtype

# Largest block (elements) one program copies; 4096 f32 = 16 KB.
_MAX_BLOCK_ELEMS = 4096


class TransferShapeError(ValueError):
    """Pool, staging buffer and page ids do not describe the same KV layout."""


def _check_shapes(pool_shape: tuple[int, ...], staging_shape: tuple[int, ...], n_ids: int) -> None:
    if len(pool_shape) != 6:
        raise TransferShapeError(f"pool must be [L, 2, P, S, H, D], got shape {pool_shape}")
    if len(staging_shape) != 6:
        raise TransferShapeError(f"staging must be [n, L, 2, S, H, D], got shape {staging_shape}")
    layers, two, _, page_size, heads, dim = pool_shape
    if two != 2:
        raise TransferShapeError(f"pool axis 1 must hold K and V (size 2), got {two}")
    if tuple(staging_shape[1:]) != (layers, 2, page_size, heads, dim):
        raise TransferShapeError(
            f"staging page shape {tuple(staging_shape[1:])} does not match pool "
            f"(L, 2, S, H, D) = {(layers, 2, page_size, heads, dim)}"
        )
    if staging_shape[0] != n_ids:
        raise TransferShapeError(f"{staging_shape[0]} staged pages but {n_ids} page ids")


def _check_ids(page_ids: jax.Array) -> None:
    if page_ids.ndim != 1 or not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise TransferShapeError(f"page_ids must be a 1-D integer array, got {page_ids.dtype}{page_ids.shape}")


def chunk_block(chunk_elems: int, max_block: int = _MAX_BLOCK_ELEMS) -> int:
    """Elements one program copies: the largest power of two dividing the chunk, capped.

    Triton blocks must be powers of two; a divisor needs no masking.
    """
    if chunk_elems <= 0:
        raise TransferShapeError(f"empty page-layer chunk ({chunk_elems} elements)")
    lowest_bit = chunk_elems & -chunk_elems
    return min(lowest_bit, max_block)


def _compiler_params(num_warps: int) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def _scatter_kernel(ids_ref, staging_ref, pool_in_ref, pool_out_ref, *, num_pages: int, block: int):
    del pool_in_ref  # aliased to pool_out_ref; only the named pages are written
    i, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = ids_ref[i]
    page = jnp.where(page < 0, page + num_pages, page)

    @pl.when((page >= 0) & (page < num_pages))
    def _copy():
        pool_out_ref[j, page, pl.ds(c * block, block)] = staging_ref[...]


def scatter_pages_pallas(
    pool: jax.Array,
    staging: jax.Array,
    page_ids: jax.Array,
    *,
    interpret: bool = False,
    max_block: int = _MAX_BLOCK_ELEMS,
    num_warps: int = 4,
) -> jax.Array:
    """Pallas: write page-first ``staging[n, L, 2, S, H, D]`` into ``pool[L, 2, P, S, H, D]``.

    Returns the updated pool.  The pool is aliased to the output: jit the caller with
    ``donate_argnums`` on the pool and the update is in place (cost independent of P).
    ``staging`` is cast to the pool's dtype.
    """
    page_ids = jnp.asarray(page_ids)
    _check_ids(page_ids)
    _check_shapes(pool.shape, staging.shape, page_ids.shape[0])
    layers, _, num_pages, page_size, heads, dim = pool.shape
    n = staging.shape[0]
    if n == 0:
        return pool
    chunk = page_size * heads * dim
    block = chunk_block(chunk, max_block)
    pool2 = pool.reshape(layers * 2, num_pages, chunk)
    staging2 = to_kv_dtype(staging, pool.dtype).reshape(n, layers * 2, chunk)
    kernel = functools.partial(_scatter_kernel, num_pages=num_pages, block=block)
    out = pl.pallas_call(
        kernel,
        grid=(n, layers * 2, chunk // block),
        in_specs=[
            pl.no_block_spec,
            pl.BlockSpec((None, None, block), lambda i, j, c: (i, j, c)),
            pl.no_block_spec,
        ],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(pool2.shape, pool2.dtype),
        input_output_aliases={2: 0},
        interpret=interpret,
        compiler_params=_compiler_params(num_warps),
        name="strata_scatter_pages",
    )(page_ids.astype(jnp.int32), staging2, pool2)
    return out.reshape(pool.shape)


def _gather_kernel(ids_ref, pool_ref, staging_ref, *, num_pages: int, block: int):
    i, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = jnp.clip(ids_ref[i], 0, num_pages - 1)
    staging_ref[...] = pool_ref[j, page, pl.ds(c * block, block)]


def gather_pages_pallas(
    pool: jax.Array,
    page_ids: jax.Array,
    *,
    interpret: bool = False,
    max_block: int = _MAX_BLOCK_ELEMS,
    num_warps: int = 4,
) -> jax.Array:
    """Pallas: read pages ``page_ids[n]`` of ``pool[L, 2, P, S, H, D]`` into ``[n, L, 2, S, H, D]``.

    Ids are clipped into ``[0, P)``, like the reference.
    """
    page_ids = jnp.asarray(page_ids)
    _check_ids(page_ids)
    n = page_ids.shape[0]
    _check_shapes(pool.shape, (n, *pool.shape[:2], *pool.shape[3:]), n)
    layers, _, num_pages, page_size, heads, dim = pool.shape
    if n == 0:
        return jnp.zeros((0, layers, 2, page_size, heads, dim), pool.dtype)
    chunk = page_size * heads * dim
    block = chunk_block(chunk, max_block)
    pool2 = pool.reshape(layers * 2, num_pages, chunk)
    kernel = functools.partial(_gather_kernel, num_pages=num_pages, block=block)
    out = pl.pallas_call(
        kernel,
        grid=(n, layers * 2, chunk // block),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.BlockSpec((None, None, block), lambda i, j, c: (i, j, c)),
        out_shape=jax.ShapeDtypeStruct((n, layers * 2, chunk), pool.dtype),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps),
        name="strata_gather_pages",
    )(page_ids.astype(jnp.int32), pool2)
    return out.reshape(n, layers, 2, page_size, heads, dim)


# ---------------------------------------------------------------------------
# Naive baseline: one small copy per page per layer.


@functools.partial(jax.jit, donate_argnums=0)
def _update_page_layer(pool: jax.Array, chunk: jax.Array, layer: jax.Array, page: jax.Array) -> jax.Array:
    """``pool[layer, :, page] = chunk`` (chunk ``[2, S, H, D]``), in place on the donated pool."""
    zero = jnp.zeros((), jnp.int32)
    start = (layer, zero, page, zero, zero, zero)
    return jax.lax.dynamic_update_slice(pool, chunk[None, :, None].astype(pool.dtype), start)


def scatter_pages_naive(
    pool: jax.Array, host_pages: np.ndarray, page_ids: np.ndarray, host_ids: np.ndarray | None = None
) -> jax.Array:
    """Fragmented baseline: for every page and layer, ``device_put`` one ``[2, S, H, D]`` chunk
    of the host page and update the (donated) pool with it (``n * L`` transfers + dispatches).

    ``host_pages[N, L, 2, S, H, D]`` is page-first NumPy (a staging buffer, or the whole
    host pool when ``host_ids[n]`` names which of its pages to move); ``page_ids[n]``
    are destination pages.  ``pool`` is consumed; use the returned array.  Ids
    outside the pool are dropped, like the kernels.
    """
    n = len(page_ids)
    src = np.arange(n) if host_ids is None else np.asarray(host_ids)
    if len(src) != n:
        raise TransferShapeError(f"{len(src)} host page ids but {n} destination page ids")
    _check_shapes(pool.shape, (n, *host_pages.shape[1:]), n)
    layers, num_pages = pool.shape[0], pool.shape[2]
    device = next(iter(pool.devices()))
    for src_page, page in zip(src.tolist(), np.asarray(page_ids).tolist()):
        if not 0 <= page < num_pages:
            continue
        for layer in range(layers):
            chunk = jax.device_put(host_pages[src_page, layer], device)
            pool = _update_page_layer(pool, chunk, np.int32(layer), np.int32(page))
    return pool


def gather_pages_naive(pool: jax.Array, page_ids: np.ndarray) -> np.ndarray:
    """Fragmented baseline for backups: one device->host copy per page per layer."""
    layers, _, num_pages, page_size, heads, dim = pool.shape
    ids = np.clip(np.asarray(page_ids), 0, num_pages - 1)
    out = np.empty((len(ids), layers, 2, page_size, heads, dim), dtype=pool.dtype)
    for i, page in enumerate(ids.tolist()):
        for layer in range(layers):
            out[i, layer] = np.asarray(pool[layer, :, page])
    return out


def gather_host_pages(host_pool: np.ndarray, host_ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Host side of a coalesced load: copy pages ``host_ids`` of a page-first NumPy pool into
    one contiguous staging buffer ``out[n, ...]`` (allocated if not given).

    Runs of consecutive ids are copied as one slice; every page is one contiguous block
    in page-first layout, so even scattered pages are large copies (``np.take`` is ~4x
    slower here, it copies item by item).
    """
    ids = np.asarray(host_ids, dtype=np.int64)
    if out is None:
        out = np.empty((len(ids), *host_pool.shape[1:]), host_pool.dtype)
    if out.shape != (len(ids), *host_pool.shape[1:]):
        raise TransferShapeError(f"staging buffer shape {out.shape} != {(len(ids), *host_pool.shape[1:])}")
    if len(ids) and (ids.min() < 0 or ids.max() >= host_pool.shape[0]):
        raise TransferShapeError(f"host page ids must be in [0, {host_pool.shape[0]})")
    run_start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            first = int(ids[run_start])
            np.copyto(out[run_start:i], host_pool[first : first + i - run_start])
            run_start = i
    return out


def transfer_bytes(pool_shape: tuple[int, ...], n_pages: int, itemsize: int) -> int:
    """Bytes moved by transferring ``n_pages`` pages of a pool of ``pool_shape``."""
    layers, two, _, page_size, heads, dim = pool_shape
    return n_pages * layers * two * page_size * heads * dim * itemsize


__all__ = [
    "TransferShapeError",
    "chunk_block",
    "gather_host_pages",
    "gather_pages_naive",
    "gather_pages_pallas",
    "scatter_pages_naive",
    "scatter_pages_pallas",
    "transfer_bytes",
]
