"""The mixture-of-experts MLP of ``qwen3_moe``, ``qwen2_moe``, ``mixtral`` and ``gpt_oss`` (``ModelConfig.moe``).

``MoEBlock`` replaces ``DecoderLayer``'s dense MLP on the config's sparse layers (every layer,
or those ``ModelConfig.sparse_layers`` marks: ``llama.mixed_mlp``).  Per token:

1. the router (``gate``, a linear layer; with a bias for GPT-OSS) scores the ``E`` experts, in the
   model's dtype as transformers computes it; softmax, top-k and the optional
   renormalization of the ``k`` picked probabilities run in float32 (``route``);
2. the ``T * k`` (token, expert) assignments are sorted by expert, so each expert's tokens
   are one contiguous group of rows (``group_sizes[e]`` rows for expert ``e``);
3. the experts run as grouped matmuls over those rows (row group ``e`` times expert ``e``'s
   kernels): ``down(silu(gate(x)) * up(x))`` (GPT-OSS: the clamped SwiGLU and each
   projection's per-expert bias, ``clamped_swiglu``), no token through an expert that did not pick
   it (``grouped_mlp``: ``jax.lax.ragged_dot`` on a GPU, where it lowers to a grouped GEMM;
   expert-pure row tiles in a loop on the CPU, where a ragged dot is a masked dense one);
4. each output row is weighted by its routing probability and put back in (token, pick)
   order by the inverse permutation, then a token's ``k`` rows are added in expert order
   (transformers adds them expert by expert): a gather and ``k - 1`` adds, deterministic,
   no scatter-add;
5. qwen2_moe adds a shared expert (a dense MLP) times ``sigmoid(shared_expert_gate(x))``.

Any number of rows works, the engine's padding rows included (they route somewhere and
their outputs are discarded; nothing in them is divided by zero).

Expert parallel (tensor parallel runner, ``runtime/sharding.py``): traced inside the tp
scope (``pallas_kernels.sharded.use_head_sharding``, which the runner sets) on a ``tp``
axis of ``n > 1`` devices, steps 3-5 run under ``jax.shard_map``: the expert kernels are
split on their expert axis (device ``s`` holds experts ``[s E/n, (s+1) E/n)``), the shared
expert by the dense MLP's columns/rows, everything else replicated.  Each device routes
every token itself (steps 1-2, identical on every device), takes the contiguous run of sorted rows
that belongs to its experts (``local_groups``: its ``E/n`` group sizes and their offset),
runs the grouped MLP over a ``T * k``-row buffer whose rows past that run lie in no group
(not multiplied), keeps its own picks (others add an exact zero) and its share of
the shared expert, and one ``psum`` adds the devices' partial outputs.

Parameters, named as transformers names them with the layer and expert numbers moved into
axes: ``mlp.gate.kernel [L, D, E]``, ``mlp.experts.{gate,up}_proj.kernel [L, E, D, F]``,
``mlp.experts.down_proj.kernel [L, E, F, D]``, ``mlp.shared_expert.{gate,up,down}_proj.kernel``,
``mlp.shared_expert_gate.kernel [L, D, 1]`` (``weights.py`` maps the checkpoint names,
per-expert or fused, onto them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels import sharded
from strata_jax.models.config import ModelConfig
from strata_jax.models.grouped_mlp import Kernel, grouped_mlp, silu_gated
from strata_jax.models.llama import MLP, LayerKernels, Linear, activation


class ExpertLinear(nnx.Module):
    """``num_experts`` bias-free linear kernels ``[E, in, out]``, multiplied by ``Experts``
    (``grouped_mlp``) row group by row group.

    Built like ``Linear``: one key drawn from ``rngs.params`` (``llama.stacked_layers``
    counts on it)."""

    def __init__(
        self,
        num_experts: int,
        d_in: int,
        d_out: int,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        std: float,
        bias: bool = False,
    ):
        shape = (num_experts, d_in, d_out)
        self.kernel = nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))
        # GPT-OSS: a bias per expert and output feature (``[E, out]``)
        self.bias = nnx.Param(jnp.zeros((num_experts, d_out), dtype)) if bias else None


def _dense_matmul(kernel: Kernel, x: jax.Array) -> jax.Array:
    return kernel.matmul(x) if isinstance(kernel, LayerKernels) else x @ kernel


class Experts(nnx.Module):
    """The routed experts: gated MLPs (SiLU, or GPT-OSS's clamped SwiGLU with biases), one
    ``ExpertLinear`` per projection."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        moe = config.moe
        assert moe is not None
        e, h, f = moe.num_experts, config.hidden_size, moe.expert_intermediate_size
        self.act_name = config.hidden_act
        self.swiglu = None if moe.swiglu_limit is None else (moe.swiglu_alpha, moe.swiglu_limit)
        bias = moe.expert_bias
        self.gate_proj = ExpertLinear(e, h, f, dtype=dtype, rngs=rngs, std=std, bias=bias)
        self.up_proj = ExpertLinear(e, h, f, dtype=dtype, rngs=rngs, std=std, bias=bias)
        self.down_proj = ExpertLinear(e, f, h, dtype=dtype, rngs=rngs, std=std, bias=bias)

    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``rows [N, D]`` sorted by expert, ``group_sizes [E]`` (summing to N) -> ``[N, D]``."""
        return self.run(self.kernels(), rows, group_sizes)

    def kernels(self) -> tuple[Kernel, ...]:
        """The gate, up and down kernels (``[E, in, out]`` or per layer), then their biases
        (``[E, out]``) when the experts have them."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        kernels = tuple(proj.kernel.get_value() for proj in projections)
        if self.gate_proj.bias is None:
            return kernels
        return kernels + tuple(proj.bias.get_value() for proj in projections)  # type: ignore[union-attr]

    def run(self, kernels: tuple[Kernel, ...], rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``kernels`` (``kernels()``, or a device's share of them) on ``rows`` grouped by ``group_sizes``."""
        glu = silu_gated(activation(self.act_name)) if self.swiglu is None else clamped_swiglu(*self.swiglu)
        biases = (kernels[3], kernels[4], kernels[5]) if len(kernels) == 6 else None
        return grouped_mlp(glu, kernels[0], kernels[1], kernels[2], rows, group_sizes, biases)


def clamped_swiglu(alpha: float, limit: float):
    """GPT-OSS's gated unit: ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` (transformers' ``GptOssExperts._apply_gate``)."""

    def glu(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return glu


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(float32 weights ``[T, k]``, int32 experts ``[T, k]``) of router ``logits [T, E]``: the
    ``k`` largest softmax probabilities (float32), divided by their sum when ``norm_topk_prob``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class MoEBlock(nnx.Module):
    """The sparse MLP of one layer (``ModelConfig.moe``): router, routed experts, optional shared expert."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        moe = config.moe
        assert moe is not None
        h = config.hidden_size
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.norm_topk_prob, self.float32_combine = moe.norm_topk_prob, moe.float32_combine
        self.gate = Linear(h, moe.num_experts, bias=moe.router_bias, dtype=dtype, rngs=rngs, std=std)
        self.experts = Experts(config, dtype, rngs, std)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = MLP(config, dtype, rngs, std, intermediate_size=shared) if shared else None
        self.shared_expert_gate = Linear(h, 1, bias=False, dtype=dtype, rngs=rngs, std=std) if shared else None

    def __call__(self, x: jax.Array) -> jax.Array:
        tokens, k = x.shape[0], self.top_k
        weights, experts = route(self.gate(x), k, self.norm_topk_prob)
        # each token's picks in expert order: its outputs are then added as transformers adds them
        by_expert = jnp.argsort(experts, axis=-1)
        experts = jnp.take_along_axis(experts, by_expert, axis=-1)
        weights = jnp.take_along_axis(weights, by_expert, axis=-1)
        flat = experts.reshape(-1)  # assignment a = token * k + pick
        order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order within a group
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        slot = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        # transformers: mixtral multiplies by the float32 weight, qwen by the weight cast to the model's dtype
        w = weights if self.float32_combine else weights.astype(x.dtype)
        shared_gate = None
        if self.shared_expert_gate is not None:
            shared_gate = jax.nn.sigmoid(self.shared_expert_gate(x))
        scope = sharded.current()
        if scope is not None and scope[0].shape[scope[1]] > 1:
            return self._expert_parallel(x, order, slot, group_sizes, w, shared_gate, *scope)
        out = self.experts(x[order // k], group_sizes)  # [T * k, D], row i is assignment order[i]
        out = out[slot].reshape(tokens, k, -1)  # back to (token, pick)
        y = _add_picks((out * w[..., None]).astype(x.dtype))
        if self.shared_expert is not None and shared_gate is not None:
            y = y + shared_gate * self.shared_expert(x)
        return y

    def _expert_parallel(
        self,
        x: jax.Array,
        order: jax.Array,
        slot: jax.Array,
        group_sizes: jax.Array,
        w: jax.Array,
        shared_gate: jax.Array | None,
        mesh: Mesh,
        axis: str,
    ) -> jax.Array:
        """Steps 3-5 per device of ``mesh``'s ``axis``: its ``E / n`` experts on the rows routed
        to them, its share of the shared expert, one ``psum`` of the partial outputs."""
        n = mesh.shape[axis]
        if self.num_experts % n:  # runtime.sharding.check_model refuses this before any tracing
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the {n} devices of axis {axis!r}")
        per_device = self.num_experts // n
        tokens, k = x.shape[0], self.top_k
        # whole experts per device: kernels [E, in, out], biases [E, out]
        expert_kernels = self.experts.kernels()
        operands = [
            _kernel_operand(kernel, PartitionSpec(axis, *([None] * (_kernel_ndim(kernel) - 1))))
            for kernel in expert_kernels
        ]
        shared = self.shared_expert
        if shared is not None:  # the dense MLP's tp layout: gate/up by columns, down by rows
            columns, rows = PartitionSpec(None, axis), PartitionSpec(axis, None)
            for proj, spec in ((shared.gate_proj, columns), (shared.up_proj, columns), (shared.down_proj, rows)):
                operands.append(_kernel_operand(proj.kernel.get_value(), spec))
        values = tuple(value for value, _ in operands)
        kernel_specs = tuple(spec for _, spec in operands)
        replicated = (x, order, slot, group_sizes, w, shared_gate)

        def body(replicated_values: tuple, local: tuple) -> jax.Array:
            x, order, slot, group_sizes, w, shared_gate = replicated_values
            kernels = [_local_kernel(value) for value in local]
            first = jax.lax.axis_index(axis) * per_device
            local_sizes, offset = local_groups(group_sizes, first, per_device)
            rows = order.shape[0]
            # this device's run of sorted rows first; rows past its sum(local_sizes) are in no group
            run = jnp.minimum(offset + jnp.arange(rows, dtype=order.dtype), rows - 1)
            out = self.experts.run(tuple(kernels[: len(expert_kernels)]), x[order[run] // k], local_sizes)
            position = slot - offset  # each assignment's row in ``out``, if it is this device's
            mine = (position >= 0) & (position < jnp.sum(local_sizes))
            out = out[jnp.clip(position, 0, rows - 1)].reshape(tokens, k, -1)
            contrib = (out * w[..., None]).astype(x.dtype)
            y = _add_picks(jnp.where(mine.reshape(tokens, k, 1), contrib, jnp.zeros((), x.dtype)))
            if shared is not None and shared_gate is not None:
                gate, up, down = kernels[len(expert_kernels) :]
                hidden = activation(shared.act_name)(_dense_matmul(gate, x)) * _dense_matmul(up, x)
                y = y + shared_gate * _dense_matmul(down, hidden)  # a partial sum: the gate is linear in it
            return jax.lax.psum(y, axis)

        replicated_specs = tuple(None if v is None else PartitionSpec() for v in replicated)
        return jax.shard_map(
            body,
            mesh=_mesh_for_shard_map(mesh),
            in_specs=(replicated_specs, kernel_specs),
            out_specs=PartitionSpec(),
        )(replicated, values)


def _add_picks(contrib: jax.Array) -> jax.Array:
    """A token's ``k`` weighted outputs ``[T, k, D]`` added left to right (expert order)."""
    y = contrib[:, 0]
    for pick in range(1, contrib.shape[1]):
        y = y + contrib[:, pick]
    return y


def local_groups(group_sizes: jax.Array, first: jax.Array | int, count: int) -> tuple[jax.Array, jax.Array]:
    """(the group sizes of experts ``[first, first + count)``, the number of sorted rows before
    them): a device's experts' rows are ``offset .. offset + sum(sizes)`` of the rows sorted by expert."""
    sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first, count)
    before = jnp.arange(group_sizes.shape[0]) < first
    return sizes, jnp.sum(jnp.where(before, group_sizes, 0)).astype(group_sizes.dtype)


def _kernel_operand(kernel: Kernel, spec: PartitionSpec) -> tuple[object, object]:
    """A kernel as a ``shard_map`` operand and its spec: per-layer kernels (``LayerKernels``)
    as ``(layer, (kernel_0, ...))`` with the layer index replicated."""
    if isinstance(kernel, LayerKernels):
        return (kernel.layer, kernel.per_layer), (PartitionSpec(), tuple(spec for _ in kernel.per_layer))
    return kernel, spec


def _kernel_ndim(kernel: Kernel) -> int:
    return kernel.per_layer[0].ndim if isinstance(kernel, LayerKernels) else kernel.ndim


def _local_kernel(value: object) -> Kernel:
    if isinstance(value, tuple):
        layer, per_layer = value
        return LayerKernels(layer, tuple(per_layer))
    assert isinstance(value, jax.Array)
    return value


def _mesh_for_shard_map(mesh: Mesh) -> Mesh | jax.sharding.AbstractMesh:
    """``mesh``, or the abstract mesh in context when it has the same axes (lowering for a GPU
    from a CPU host puts one in scope; as ``pallas_kernels.sharded`` does)."""
    context = jax.sharding.get_abstract_mesh()
    if context is not None and not context.empty and context.shape_tuple == mesh.shape_tuple:
        return context
    return mesh
