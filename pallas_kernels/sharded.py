"""Run a kernel per shard of a head-sharded mesh (tensor parallelism), under ``shard_map``.

Inside ``use_head_sharding(mesh, axis)`` the dispatch functions (``write_kv``,
``ragged_paged_attention_pool``, ``scatter_pages``, ``gather_pages``) run their
implementation once per device on that device's heads: every argument with a head
axis is split on it over ``axis`` and everything else (page tables, lengths, slot
ids, the layer index) is replicated.  Attention, the KV write and the page
transfers are independent per KV head, so a shard needs no communication and
the kernels (Pallas or reference) see ordinary, smaller shapes.  Without a scope
(or on a one-device axis) the implementation is called as is.

Like ``use_backend`` the scope is read when a function is traced, so a jitted
step traced inside it keeps the per-shard program.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

_SCOPE: contextvars.ContextVar[tuple[Mesh, str] | None] = contextvars.ContextVar("strata_head_sharding", default=None)


@contextlib.contextmanager
def use_head_sharding(mesh: Mesh | None, axis: str = "tp") -> Iterator[None]:
    """Kernels traced in this block run per shard of ``mesh``'s ``axis`` (None: no sharding)."""
    if mesh is not None and axis not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {axis!r} axis")
    token = _SCOPE.set((mesh, axis) if mesh is not None else None)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current() -> tuple[Mesh, str] | None:
    """The (mesh, axis) in scope, or None."""
    return _SCOPE.get()


def _spec(head_axis: int | None, ndim: int, axis: str) -> PartitionSpec:
    if head_axis is None:
        return PartitionSpec()
    parts: list[str | None] = [None] * ndim
    parts[head_axis] = axis
    return PartitionSpec(*parts)


def per_head_shard(
    fn: Callable,
    args: Sequence[Any],
    in_head_axes: Sequence[int | None],
    out_head_axes: int | None | tuple[int | None, ...],
):
    """``fn(*args)``, per shard of the heads when a scope is active.

    ``in_head_axes[i]``: the head axis of ``args[i]`` (None: replicated);
    ``out_head_axes``: the same for the output(s) (a tuple for a tuple output).
    """
    scope = _SCOPE.get()
    if scope is None or scope[0].shape[scope[1]] == 1:
        return fn(*args)
    mesh, axis = scope
    # Python scalars (a static layer index) stay static: closed over, not shard_map operands.
    dynamic = [i for i, x in enumerate(args) if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")]

    def body(*operands):
        full = list(args)
        for i, x in zip(dynamic, operands):
            full[i] = x
        return fn(*full)

    operands = [args[i] for i in dynamic]
    in_specs = tuple(_spec(in_head_axes[i], np.ndim(args[i]), axis) for i in dynamic)
    out_shapes = jax.eval_shape(body, *operands)
    out_specs: PartitionSpec | tuple[PartitionSpec, ...]
    if isinstance(out_head_axes, tuple):
        out_specs = tuple(_spec(a, len(s.shape), axis) for a, s in zip(out_head_axes, out_shapes))
    else:
        out_specs = _spec(out_head_axes, len(out_shapes.shape), axis)
    # check_vma=False: pallas_call has no varying-manual-axes rule; every output is
    # either head-sharded or computed identically on every shard, as declared above.
    return jax.shard_map(body, mesh=_mesh_for_shard_map(mesh), in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        *operands
    )


def _mesh_for_shard_map(mesh: Mesh):
    """``mesh``, or the abstract mesh in context when it has the same axes: lowering for a
    GPU from a CPU host (``pallas_kernels.aot.gpu_lowering_target(..., mesh=...)``) puts an
    abstract GPU mesh in scope, and shard_map must then use that one."""
    context = jax.sharding.get_abstract_mesh()
    if context is not None and not context.empty and context.shape_tuple == mesh.shape_tuple:
        return context
    return mesh
