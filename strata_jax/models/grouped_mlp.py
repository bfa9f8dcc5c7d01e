"""The routed experts' MLP over rows sorted by expert: ``down(glu(gate(x), up(x)))`` with
row group ``e`` (``group_sizes[e]`` consecutive rows) through expert ``e``'s kernels (and
biases, GPT-OSS); ``glu`` is ``act(gate) * up`` (``silu_gated``) or GPT-OSS's clamped SwiGLU.

Two ways to compute it, chosen per platform (``method``), both exact grouped work (no row
through an expert that did not pick it):

* ``"ragged_dot"``: three ``jax.lax.ragged_dot`` calls.  On a GPU they lower to grouped
  GEMMs; on XLA:CPU (jax 0.10) a ragged dot is expanded into a masked dense dot over every
  (row, expert) pair and its kernels are re-laid out per call: ``E`` times the routed work,
  about 0.01-0.04x a dense matmul chain of the same FLOPs (``strata-jax bench moe``).
* ``"tiles"``: the rows are spread into tiles of ``b`` rows that each belong to one expert
  (a group padded up to a multiple of ``b``), and a loop over the tiles that hold rows runs
  gate, up and down of that tile's expert, reading the kernels where they lie.  On this CPU
  0.4-0.7x the dense chain from 512 tokens on and 10-70x the ragged dot (docs/models.md).
  ``b`` grows with the rows per expert (half of them, a power of two, at most 128): small
  tiles waste little padding when each expert has few rows (decode: one row per tile, each
  picked expert's weights read once per row), larger ones keep the matmuls efficient.

Rows past ``sum(group_sizes)`` are in no group: their outputs are zero (expert parallelism
hands a device a buffer whose tail belongs to other devices' experts).

Kernels are ``[E, in, out]`` arrays (biases ``[E, out]``), or ``LayerKernels`` (per-layer
weights under the layer scan: the whole computation runs in the ``jax.lax.switch`` branch
of the layer, so each layer's kernels are read in place).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from functools import partial
from typing import Literal, get_args

import jax
import jax.numpy as jnp

import pallas_kernels
from strata_jax.models.llama import LayerKernels

Method = Literal["auto", "ragged_dot", "tiles"]
METHODS: tuple[Method, ...] = get_args(Method)
Kernel = jax.Array | LayerKernels  # a kernel as a layer sees it: one array, or picked per layer under the scan
Activation = Callable[[jax.Array], jax.Array]
GatedUnit = Callable[[jax.Array, jax.Array], jax.Array]  # (gate projection, up projection) -> hidden
MAX_TILE_ROWS = 128

_METHOD: contextvars.ContextVar[Method] = contextvars.ContextVar("strata_grouped_mlp", default="auto")


@contextlib.contextmanager
def use_method(method: Method) -> Iterator[None]:
    """Within this block (this thread), MoE layers traced use ``method`` ("auto": by platform)."""
    if method not in METHODS:
        raise ValueError(f"unknown grouped MLP method {method!r}; choose one of {', '.join(METHODS)}")
    token = _METHOD.set(method)
    try:
        yield
    finally:
        _METHOD.reset(token)


def resolve_method() -> Literal["ragged_dot", "tiles"]:
    """The method in effect: ``use_method``'s, else ``ragged_dot`` for an accelerator's kernels
    (the Pallas backend in scope, as when lowering for a GPU from a CPU host, or a non-CPU
    platform) and ``tiles`` on the CPU."""
    method = _METHOD.get()
    if method != "auto":
        return method
    if pallas_kernels.resolve_backend() == "pallas" or pallas_kernels.platform_name() != "cpu":
        return "ragged_dot"
    return "tiles"


def silu_gated(act: Activation) -> GatedUnit:
    """The gated unit ``act(gate) * up`` of Llama-style experts."""
    return lambda gate, up: act(gate) * up


def grouped_mlp(
    glu: GatedUnit,
    gate: Kernel,
    up: Kernel,
    down: Kernel,
    rows: jax.Array,
    group_sizes: jax.Array,
    biases: tuple[Kernel, Kernel, Kernel] | None = None,
) -> jax.Array:
    """``rows [N, D]`` sorted by expert, ``group_sizes [E]`` (summing to at most N) -> ``[N, D]``:
    ``down(glu(gate(x), up(x)))`` per row group, plus expert ``e``'s ``biases`` (gate ``[E, F]``,
    up ``[E, F]``, down ``[E, D]``; GPT-OSS) on its rows when given."""
    kernels = (gate, up, down) + (biases or ())
    per_layer = [isinstance(kernel, LayerKernels) for kernel in kernels]
    if all(per_layer):  # under the layer scan: the whole MLP in the layer's switch branch, kernels read in place
        layer = gate.layer  # type: ignore[union-attr]
        branches = [partial(_grouped_of_layer, glu, i) for i in range(len(gate.per_layer))]  # type: ignore[union-attr]
        tables = tuple(kernel.per_layer for kernel in kernels)  # type: ignore[union-attr]
        return jax.lax.switch(layer, branches, rows, group_sizes, tables)
    if any(per_layer):
        raise TypeError("the kernels and biases of one layer's experts must all be per layer or all arrays")
    return _grouped(glu, kernels, rows, group_sizes)  # type: ignore[arg-type]


def _grouped_of_layer(
    glu: GatedUnit, index: int, rows: jax.Array, group_sizes: jax.Array, tables: tuple[tuple[jax.Array, ...], ...]
) -> jax.Array:
    return _grouped(glu, tuple(table[index] for table in tables), rows, group_sizes)


def _grouped(glu: GatedUnit, kernels: tuple[jax.Array, ...], rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``grouped_mlp`` on arrays: ``kernels`` is (gate, up, down) or (gate, up, down, gate bias,
    up bias, down bias)."""
    gate, up, down = kernels[:3]
    biases = kernels[3:] if len(kernels) == 6 else None
    if resolve_method() == "tiles":
        return tiles(glu, gate, up, down, rows, group_sizes, biases)
    sizes = group_sizes.astype(jnp.int32)
    if biases is None:
        hidden = glu(jax.lax.ragged_dot(rows, gate, sizes), jax.lax.ragged_dot(rows, up, sizes))
        return jax.lax.ragged_dot(hidden, down, sizes)
    in_group, expert = row_groups(sizes, rows.shape[0])
    gate_bias, up_bias, down_bias = (bias[expert] for bias in biases)
    hidden = glu(jax.lax.ragged_dot(rows, gate, sizes) + gate_bias, jax.lax.ragged_dot(rows, up, sizes) + up_bias)
    out = jax.lax.ragged_dot(hidden, down, sizes) + down_bias
    return jnp.where(in_group[:, None], out, jnp.zeros((), out.dtype))  # rows in no group stay zero


def row_groups(sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(whether each of ``num_rows`` sorted rows lies in a group, the group (expert) it lies in;
    rows past ``sum(sizes)`` get the last expert) for int32 group ``sizes [E]``."""
    index = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), index, side="right"), sizes.shape[0] - 1)
    return index < jnp.sum(sizes), expert


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile: half the mean rows per expert, a power of two in ``[1, MAX_TILE_ROWS]``."""
    b = 1
    while b * 2 <= num_rows // (2 * num_experts) and b < MAX_TILE_ROWS:
        b *= 2
    return b


def tiles(
    glu: GatedUnit,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    rows: jax.Array,
    group_sizes: jax.Array,
    biases: tuple[jax.Array, ...] | None = None,
) -> jax.Array:
    """The ``"tiles"`` method on ``[E, in, out]`` kernels (module docstring), with expert
    ``biases`` (gate, up, down) when given."""
    n, d = rows.shape
    e = group_sizes.shape[0]
    b = tile_rows(n, e)
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    start = jnp.cumsum(sizes) - sizes
    index = jnp.arange(n, dtype=jnp.int32)
    in_group, expert = row_groups(sizes, n)
    capacity = -(-(n + e * (b - 1)) // b) * b  # every group padded: the most rows the tiles can hold
    # each row's place in the tiles; rows in no group go nowhere (dropped, read back as zeros)
    place = jnp.where(in_group, padded_end[expert] - padded[expert] + index - start[expert], capacity)
    spread = jnp.zeros((capacity, d), rows.dtype).at[place].set(rows, mode="drop")
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(capacity // b) * b, side="right"), e - 1)

    def tile(t: jax.Array, out: jax.Array) -> jax.Array:
        x = jax.lax.dynamic_slice_in_dim(spread, t * b, b)
        k = tile_expert[t]
        if biases is None:
            hidden = glu(x @ gate[k], x @ up[k])
            return jax.lax.dynamic_update_slice_in_dim(out, hidden @ down[k], t * b, 0)
        gate_bias, up_bias, down_bias = biases
        hidden = glu(x @ gate[k] + gate_bias[k], x @ up[k] + up_bias[k])
        return jax.lax.dynamic_update_slice_in_dim(out, hidden @ down[k] + down_bias[k], t * b, 0)

    init = _varying_as(jnp.zeros((capacity, down.shape[-1]), rows.dtype), gate, up, down, spread)
    out = jax.lax.fori_loop(0, padded_end[-1] // b, tile, init)
    return jnp.where(in_group[:, None], out[jnp.minimum(place, capacity - 1)], jnp.zeros((), rows.dtype))


def _varying_as(value: jax.Array, *inputs: jax.Array) -> jax.Array:
    """``value`` marked as varying over the ``shard_map`` axes its ``inputs`` vary over (a
    loop's carry must have the type of what the loop body makes of those inputs: under expert
    parallelism the kernels are a device's own)."""
    axes: set[str] = set()
    for x in inputs:
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; older and newer: ``vma``
        axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()))
    return jax.lax.pcast(value, tuple(sorted(axes)), to="varying") if axes else value
