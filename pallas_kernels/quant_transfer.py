"""Quantized KV page transfers: quantize after the backup gather, dequantize inside the load scatter.

A *tier format* says how L2 (host) pages and L3 objects hold KV:

* ``"full"``: the L1 dtype, unchanged (what the plain ``gather_pages`` /
  ``scatter_pages`` move);
* ``"fp8"``: float8 e4m3fn values with one float32 scale per (page, layer, K/V, KV head);
* ``"int8"``: int8 values (symmetric, -127..127) with the same scales.

Granularity (page, layer, K/V, KV head): a scale covers ``page_size * head_dim`` values
of one head of one layer's K (or V).  Per KV head because heads differ in magnitude
by an order of magnitude or more (K especially, after RoPE), so a shared scale would
waste most of the 8 bits on the small heads; per page because a page is the unit
that is backed up, stored and loaded (a scale never spans two objects, and a page is
quantized from its own values, so a page's bytes do not depend on its neighbours);
not per token because at page 16 and head_dim 64 a float32 scale then costs
4 / 64 = 6% of the fp8 bytes instead of 0.4%.  Scale bytes per page:
``4 * L * 2 * H``; relative to the 8-bit values: ``4 / (page_size * head_dim)``.

Semantics (the references below define them; ``qmax`` = 448 for fp8, 127 for int8)::

    amax  = max |x| over the (page, layer, kv, head)'s [page_size, head_dim] values
    scale = amax * float32(1 / qmax)   if amax > 0 else 1          (float32)
    y     = clip(x * (1 / scale), -qmax, qmax)   (the reciprocal in float32, once per scale:
                                                XLA rewrites x / scale that way anyway)
    fp8:  q = float8_e4m3fn(y)          (round to nearest even)
    int8: q = int8(floor(y + 0.5))      (round half up; Triton has no round-to-even op)
    dequantized x' = float32(q) * scale, cast to the pool's dtype

The clip matters for fp8: e4m3fn has no infinity, a value just past 448 after
rounding would become NaN.  NaN/inf in a page propagate (like full width).

Layouts (see ``layout.py``): ``pool[L, 2, P, S, H, D]``, quantized page-first
``q[n, L, 2, S, H, D]`` and ``scales[n, L, 2, H]`` (float32).

Entry points (``backend`` as in ``pallas_kernels.dispatch``; ``"pallas"`` and
``"interpret"`` run the Pallas kernels below (they need a power-of-two ``head_dim``;
other shapes use the references), ``"reference"`` the pure-JAX references, and ``"xla"``
(CPU's default) the gather reference and ``scatter_dequantize_xla``, which writes the
reference's result a page at a time)::

    q, scales = gather_quantize(pool, page_ids, fmt)            # backup: gather + quantize
    pool = scatter_dequantize(pool, q, scales, page_ids)        # load: dequantize + scatter (donate pool)

Page ids follow ``transfer.py``: the gather clips, the scatter wraps negatives like
NumPy and drops ids still outside ``[0, P)``.  Under
``pallas_kernels.sharded.use_head_sharding`` both run per shard of the KV heads
(pool / q axis 4, scales axis 3): quantization is per head, so shards never talk.

Imports only jax and numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dispatch, sharded
from pallas_kernels.reference import gather_pages_reference, scatter_pages_reference, to_kv_dtype
from pallas_kernels.transfer import TransferShapeError, _check_ids, _check_shapes

TIER_FORMATS = ("full", "fp8", "int8")
QUANTIZED_FORMATS = ("fp8", "int8")
_QMAX = {"fp8": 448.0, "int8": 127.0}
# scale = amax * (1 / qmax) with the reciprocal rounded to float32 once: a multiply gives the
# same bits everywhere (XLA may turn a division by a constant into this multiply anyway).
_INV_QMAX = {fmt: float(np.float32(1.0) / np.float32(q)) for fmt, q in _QMAX.items()}
_QDTYPE = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
SCALE_DTYPE = jnp.float32
# Largest [rows, head_dim] block one program moves (elements).
_MAX_BLOCK_ELEMS = 4096


class UnknownTierFormatError(ValueError):
    """A tier format name that is not one of ``TIER_FORMATS``."""


def check_format(fmt: str) -> str:
    if fmt not in TIER_FORMATS:
        raise UnknownTierFormatError(f"unknown KV tier format {fmt!r}; choose one of {', '.join(TIER_FORMATS)}")
    return fmt


def quantized_dtype(fmt: str):
    """The element dtype of quantized format ``fmt`` (``float8_e4m3fn`` or ``int8``)."""
    if check_format(fmt) == "full":
        raise UnknownTierFormatError("'full' has no quantized dtype (it keeps the L1 dtype)")
    return _QDTYPE[fmt]


def qmax(fmt: str) -> float:
    return _QMAX[fmt]


# ---------------------------------------------------------------------------
# References: they define the semantics.


def quantize_pages_reference(pages: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Page-first ``pages[n, L, 2, S, H, D]`` -> ``(q, scales[n, L, 2, H])`` (module docstring)."""
    limit = _QMAX[fmt]
    x = pages.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=(3, 5))  # [n, L, 2, H]
    scales = jnp.where(amax > 0, amax * jnp.float32(_INV_QMAX[fmt]), 1.0).astype(SCALE_DTYPE)
    inv = (jnp.float32(1.0) / scales)[:, :, :, None, :, None]
    y = jnp.clip(x * inv, -limit, limit)
    if fmt == "int8":
        y = jnp.floor(y + 0.5)
    return y.astype(_QDTYPE[fmt]), scales


def _to_float32(q: jax.Array) -> jax.Array:
    """``float32(q)``, exactly.  fp8 e4m3fn is decoded from its bits (sign, 4-bit exponent
    with bias 7, 3-bit mantissa; exponent 0 = subnormals m * 2^-9; 0x7f/0xff = NaN): the
    same values as ``q.astype(float32)`` for all 256 codes, and about twice as fast as
    XLA:CPU's own fp8 conversion, which the CPU load path pays per loaded value."""
    if q.dtype != jnp.float8_e4m3fn:
        return q.astype(jnp.float32)
    return _fp8_bits_to_float32(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _fp8_bits_to_float32(bits: jax.Array) -> jax.Array:
    """``_to_float32`` of fp8 e4m3fn codes given as ``uint8`` (see there)."""
    b = bits.astype(jnp.uint32)
    mag = b & 0x7F
    # exponent field e >= 1: float32 bits (e + 120) << 23 | m << 20 = 2^(e - 7) * (1 + m / 8)
    normal = jax.lax.bitcast_convert_type((mag << 20) + jnp.uint32(120 << 23), jnp.float32)
    subnormal = (b & 7).astype(jnp.float32) * jnp.float32(2.0**-9)
    value = jnp.where(mag < 8, subnormal, jnp.where(mag == 0x7F, jnp.float32(jnp.nan), normal))
    return jnp.where(b >= 0x80, -value, value)


def dequantize_pages_reference(q: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """``float32(q) * scale`` per (page, layer, kv, head), cast to ``dtype``."""
    return to_kv_dtype(_to_float32(q) * scales[:, :, :, None, :, None], dtype)


def gather_quantize_reference(pool: jax.Array, page_ids: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Pages ``page_ids`` of ``pool[L, 2, P, S, H, D]`` quantized page-first (ids clipped)."""
    return quantize_pages_reference(gather_pages_reference(pool, page_ids), fmt)


def scatter_dequantize_reference(pool: jax.Array, q: jax.Array, scales: jax.Array, page_ids: jax.Array) -> jax.Array:
    """Dequantize ``(q, scales)`` to the pool's dtype and scatter into ``pool`` (ids as ``scatter_pages``).

    Under jit XLA fuses the dequantization into the scatter: one pass over the pages."""
    return scatter_pages_reference(pool, dequantize_pages_reference(q, scales, pool.dtype), page_ids)


# ---------------------------------------------------------------------------
# The XLA path (CPU): the reference's results, one in-place update per page.

# Chunks of up to this many pages unroll their updates; longer ones run a loop.
_UNROLL_MAX_PAGES = 64


def scatter_dequantize_xla(pool: jax.Array, q: jax.Array, scales: jax.Array, page_ids: jax.Array) -> jax.Array:
    """``scatter_dequantize_reference``'s result, written as one ``dynamic_update_slice``
    per page (donate ``pool``).

    XLA:CPU emits a scatter with a fused dequantization as a scalar loop over every
    element; a dynamic-update-slice of one page's dequantized values is a vectorized
    in-place write: 2.3-2.7x faster for int8 and 1.5-2.2x for fp8 at page size 1
    (`docs/cache.md`).  The full-width scatter gains nothing from it (no conversion to fuse),
    so ``scatter_pages`` keeps the scatter.  An id outside ``[0, P)`` after wrapping a
    negative one rewrites its clamped page with that page's own values (no write).
    """
    page_ids = jnp.asarray(page_ids)
    _check_ids(page_ids)
    _check_shapes(pool.shape, q.shape, page_ids.shape[0])
    num_pages, n = pool.shape[2], q.shape[0]
    wrapped = jnp.where(page_ids < 0, page_ids + num_pages, page_ids).astype(jnp.int32)
    valid = (wrapped >= 0) & (wrapped < num_pages)
    target = jnp.clip(wrapped, 0, num_pages - 1)

    def write(pool: jax.Array, i, values: jax.Array, page_scales: jax.Array) -> jax.Array:
        """Page ``i`` from its float32 codes ``values[1, L, 2, S, H, D]`` and ``page_scales[1, L, 2, H]``."""
        new = to_kv_dtype(values * page_scales[:, :, :, None, :, None], pool.dtype)
        new = jnp.transpose(new, (1, 2, 0, 3, 4, 5))
        old = jax.lax.dynamic_slice_in_dim(pool, target[i], 1, axis=2)
        return jax.lax.dynamic_update_slice_in_dim(pool, jnp.where(valid[i], new, old), target[i], axis=2)

    if n <= _UNROLL_MAX_PAGES:  # fp8 loads 15-25% faster unrolled than in a loop
        codes = _to_float32(q)
        for i in range(n):
            pool = write(pool, i, codes[i : i + 1], scales[i : i + 1])
        return pool
    # A loop (8 pages deep) past that: an unrolled chunk of 64 pages compiles in 2 s.  fp8
    # is sliced as uint8: XLA:CPU slices float8 arrays element by element (3x slower).
    fp8 = q.dtype == jnp.float8_e4m3fn
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8) if fp8 else q

    def body(i, pool):
        page = jax.lax.dynamic_slice_in_dim(bits, i, 1, axis=0)
        values = _fp8_bits_to_float32(page) if fp8 else page.astype(jnp.float32)
        return write(pool, i, values, jax.lax.dynamic_slice_in_dim(scales, i, 1, axis=0))

    return jax.lax.fori_loop(0, n, body, pool, unroll=min(n, 8))


# ---------------------------------------------------------------------------
# Pallas kernels (Triton lowering: CUDA and ROCm).


def pallas_supported(head_dim: int) -> bool:
    """The kernels tile ``[rows, head_dim]`` blocks; Triton blocks are powers of two."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def _rows_per_block(page_size: int, head_dim: int) -> int:
    """Token rows per block: the largest power of two dividing ``page_size`` with rows * D <= 4096."""
    cap = max(1, _MAX_BLOCK_ELEMS // head_dim)
    rows = page_size & -page_size
    while rows > cap:
        rows //= 2
    return rows


def _compiler_params(num_warps: int) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


def _scatter_dequant_kernel(ids_ref, q_ref, scales_ref, pool_in_ref, pool_out_ref, *, num_pages: int, rows: int):
    # Program (i, j, h, c): rows c*rows.. of head h of chunk (page i, layer/kv j).
    del pool_in_ref  # aliased to pool_out_ref: only the named pages are written
    i, j, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    page = ids_ref[i]
    page = jnp.where(page < 0, page + num_pages, page)

    @pl.when((page >= 0) & (page < num_pages))
    def _write():
        scale = scales_ref[i, j, h]
        x = q_ref[...].astype(jnp.float32) * scale  # [rows, D]
        pool_out_ref[j, page, pl.ds(c * rows, rows), h, :] = to_kv_dtype(x, pool_out_ref.dtype)


def scatter_dequantize_pallas(
    pool: jax.Array,
    q: jax.Array,
    scales: jax.Array,
    page_ids: jax.Array,
    *,
    interpret: bool = False,
    num_warps: int = 4,
) -> jax.Array:
    """Pallas: dequantize page-first ``q[n, L, 2, S, H, D]`` with ``scales[n, L, 2, H]`` into
    ``pool[L, 2, P, S, H, D]`` at ``page_ids`` (the pool is aliased to the output: donate it)."""
    page_ids = jnp.asarray(page_ids)
    _check_ids(page_ids)
    _check_shapes(pool.shape, q.shape, page_ids.shape[0])
    layers, _, num_pages, page_size, heads, dim = pool.shape
    n = q.shape[0]
    if scales.shape != (n, layers, 2, heads):
        raise TransferShapeError(f"scales shape {scales.shape} != {(n, layers, 2, heads)}")
    if not pallas_supported(dim):
        raise TransferShapeError(f"the Pallas dequantizing scatter needs a power-of-two head_dim, got {dim}")
    if n == 0:
        return pool
    rows = _rows_per_block(page_size, dim)
    pool5 = pool.reshape(layers * 2, num_pages, page_size, heads, dim)
    q5 = q.reshape(n, layers * 2, page_size, heads, dim)
    scales3 = scales.astype(SCALE_DTYPE).reshape(n, layers * 2, heads)
    kernel = functools.partial(_scatter_dequant_kernel, num_pages=num_pages, rows=rows)
    out = pl.pallas_call(
        kernel,
        grid=(n, layers * 2, heads, page_size // rows),
        in_specs=[
            pl.no_block_spec,
            pl.BlockSpec((None, None, rows, None, dim), lambda i, j, h, c: (i, j, c, h, 0)),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(pool5.shape, pool5.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
        compiler_params=_compiler_params(num_warps),
        name="strata_scatter_dequantize_pages",
    )(page_ids.astype(jnp.int32), q5, scales3, pool5)
    return out.reshape(pool.shape)


def _gather_quant_kernel(ids_ref, pool_ref, q_ref, scales_ref, *, num_pages: int, rows: int, blocks: int, fmt: str):
    # Program (i, j, h): head h of chunk (page i, layer/kv j); two passes over its rows.
    i, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = jnp.clip(ids_ref[i], 0, num_pages - 1)
    limit = _QMAX[fmt]

    def block(c):
        return pool_ref[j, page, pl.ds(c * rows, rows), h, :].astype(jnp.float32)

    amax = jax.lax.fori_loop(0, blocks, lambda c, m: jnp.maximum(m, jnp.max(jnp.abs(block(c)))), jnp.float32(0.0))
    scale = jnp.where(amax > 0, amax * jnp.float32(_INV_QMAX[fmt]), jnp.float32(1.0))

    inv = jnp.float32(1.0) / scale

    def store(c, carry):
        y = jnp.clip(block(c) * inv, -limit, limit)
        if fmt == "int8":
            y = jnp.floor(y + 0.5)
        q_ref[i, j, pl.ds(c * rows, rows), h, :] = y.astype(q_ref.dtype)
        return carry

    jax.lax.fori_loop(0, blocks, store, 0)
    scales_ref[i, j, h] = scale


def gather_quantize_pallas(
    pool: jax.Array,
    page_ids: jax.Array,
    fmt: str,
    *,
    interpret: bool = False,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
    """Pallas: pages ``page_ids[n]`` of ``pool[L, 2, P, S, H, D]`` as quantized page-first
    ``q[n, L, 2, S, H, D]`` and ``scales[n, L, 2, H]`` (ids clipped into ``[0, P)``)."""
    qdtype = quantized_dtype(fmt)
    page_ids = jnp.asarray(page_ids)
    _check_ids(page_ids)
    n = page_ids.shape[0]
    _check_shapes(pool.shape, (n, *pool.shape[:2], *pool.shape[3:]), n)
    layers, _, num_pages, page_size, heads, dim = pool.shape
    if not pallas_supported(dim):
        raise TransferShapeError(f"the Pallas quantizing gather needs a power-of-two head_dim, got {dim}")
    if n == 0:
        return jnp.zeros((0, layers, 2, page_size, heads, dim), qdtype), jnp.zeros((0, layers, 2, heads), SCALE_DTYPE)
    rows = _rows_per_block(page_size, dim)
    pool5 = pool.reshape(layers * 2, num_pages, page_size, heads, dim)
    kernel = functools.partial(_gather_quant_kernel, num_pages=num_pages, rows=rows, blocks=page_size // rows, fmt=fmt)
    q, scales = pl.pallas_call(
        kernel,
        grid=(n, layers * 2, heads),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=[pl.no_block_spec, pl.no_block_spec],
        out_shape=[
            jax.ShapeDtypeStruct((n, layers * 2, page_size, heads, dim), qdtype),
            jax.ShapeDtypeStruct((n, layers * 2, heads), SCALE_DTYPE),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(num_warps),
        name="strata_gather_quantize_pages",
    )(page_ids.astype(jnp.int32), pool5)
    return q.reshape(n, layers, 2, page_size, heads, dim), scales.reshape(n, layers, 2, heads)


# ---------------------------------------------------------------------------
# Dispatch (the backend is resolved by pallas_kernels.dispatch; this module owns its ops).


def _implementation(backend, head_dim: int) -> str:
    """``"pallas"``, ``"interpret"``, ``"reference"`` or ``"xla"`` (CPU's default).  A Pallas
    backend on a head_dim its kernels do not take falls back to the reference: on a GPU
    XLA's scatter is one parallel kernel, where page-at-a-time updates would be a loop."""
    name = dispatch.resolve_backend(backend)
    if name in ("pallas", "interpret"):
        return name if pallas_supported(head_dim) else "reference"
    return "reference" if name == "reference" else "xla"


def gather_quantize(
    pool: jax.Array,
    page_ids: jax.Array,
    fmt: str,
    *,
    backend=None,
) -> tuple[jax.Array, jax.Array]:
    """Backup side: gather ``page_ids`` of ``pool`` and quantize them to ``fmt`` (``"fp8"``/``"int8"``)."""
    quantized_dtype(fmt)
    name = _implementation(backend, pool.shape[-1])
    if name in ("reference", "xla"):
        impl = functools.partial(gather_quantize_reference, fmt=fmt)
    else:
        impl = functools.partial(gather_quantize_pallas, fmt=fmt, interpret=name == "interpret")
    return sharded.per_head_shard(impl, (pool, page_ids), (4, None), (4, 3))


def scatter_dequantize(
    pool: jax.Array,
    q: jax.Array,
    scales: jax.Array,
    page_ids: jax.Array,
    *,
    backend=None,
) -> jax.Array:
    """Load side: dequantize ``(q, scales)`` to the pool's dtype while scattering into ``page_ids``."""
    name = _implementation(backend, pool.shape[-1])
    if name == "reference":
        impl = scatter_dequantize_reference
    elif name == "xla":
        impl = scatter_dequantize_xla
    else:
        impl = functools.partial(scatter_dequantize_pallas, interpret=name == "interpret")
    return sharded.per_head_shard(impl, (pool, q, scales, page_ids), (4, 4, 3, None), 4)


__all__ = [
    "QUANTIZED_FORMATS",
    "SCALE_DTYPE",
    "TIER_FORMATS",
    "UnknownTierFormatError",
    "check_format",
    "dequantize_pages_reference",
    "gather_quantize",
    "gather_quantize_pallas",
    "gather_quantize_reference",
    "pallas_supported",
    "quantize_pages_reference",
    "quantized_dtype",
    "scatter_dequantize",
    "scatter_dequantize_pallas",
    "scatter_dequantize_reference",
    "scatter_dequantize_xla",
]
