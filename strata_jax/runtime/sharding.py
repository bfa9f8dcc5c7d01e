"""Tensor parallelism: one ``jax.sharding.Mesh`` with a ``tp`` axis and the rules that
place the model's parameters and the KV pool on it.

No model code changes for tp: the rules below map each parameter (by its path in
the NNX state; stacked per-layer parameters carry a leading layer axis the rules
leave whole) to a ``PartitionSpec``, the runner jits its step with those shardings,
XLA (GSPMD) inserts the all-reduces after the row-parallel projections, and the
attention / KV-write / page-transfer kernels run per shard under ``shard_map``
(``pallas_kernels.sharded``).  Megatron layout:

=====================================  ==========================  ============================
parameter                              split                       why
=====================================  ==========================  ============================
``q_proj``/``k_proj``/``v_proj``       columns (heads)             each device owns whole heads
``o_proj``                             rows (heads)                partial sums, one all-reduce
``gate_proj``/``up_proj``              columns                     elementwise SiLU·up per shard
``down_proj``                          rows                        partial sums, one all-reduce
q/k/v biases                           with their columns
``o_proj`` bias (GPT-OSS)              replicated                  added once, after the all-reduce
attention ``sinks`` (GPT-OSS)          heads                       one per query head
norms, q_norm/k_norm                   replicated                  tiny
``embed_tokens`` / ``lm_head``         replicated (default)        see ``VOCAB_PARALLEL``
MoE ``mlp.experts.*`` ``[E, in, out]``  the expert axis             expert parallel, see below
(their biases ``[E, out]``, GPT-OSS)
MoE ``mlp.shared_expert.*``            as ``gate/up/down_proj``    a dense MLP (qwen2_moe)
MoE router ``mlp.gate``,               replicated                  ``[D, E]`` / ``[D, 1]``: tiny;
``mlp.shared_expert_gate``                                         every device routes itself
=====================================  ==========================  ============================

Mixture of experts (``models/moe.py``): the routed experts are split over the same
``tp`` axis, ``E / tp`` whole experts per device, whenever the model has experts (no
separate switch: expert parallel size = tp).  The activations are replicated after
attention's all-reduce, so every device routes every token (identically), runs only the
assignments routed to its own experts and adds the shared expert's column/row share;
one ``psum`` per layer sums the partial outputs, the all-reduce a dense layer's
``down_proj`` makes.  ``num_experts`` not divisible by tp is refused (``check_model``):
no replicated fallback.  docs/models.md, "Mixture of experts", says why (vs. an
all-to-all dispatch).

KV pool ``[L, 2, P, S, H_kv, D]``: split on ``H_kv`` (axis 4); the page-first staging
of tier transfers ``[n, L, 2, S, H_kv, D]`` too, so a load's ``device_put`` sends each
device only its heads' bytes, while the host pool and L3 keep whole pages (and stay
valid across tp sizes).  Fewer KV heads than ``tp`` is refused (no KV-head
replication): a replicated head would change the bytes of a page and break that.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strata_jax.api import InvalidRequestError
from strata_jax.models.config import ModelConfig

TP_AXIS = "tp"
POOL_HEAD_AXIS = 4  # [L, 2, P, S, H, D] and page-first [n, L, 2, S, H, D]


class TensorParallelError(InvalidRequestError):
    """A tp size this machine or model cannot serve."""


def _rules(vocab_parallel: bool) -> tuple[tuple[re.Pattern[str], tuple[str | None, ...]], ...]:
    """(path pattern, spec of the parameter's trailing axes); first match wins, else replicated.

    Linear kernels are stored ``[in, out]``."""
    t = TP_AXIS
    rules = [
        (r"self_attn\.(q|k|v)_proj\.kernel$", (None, t)),
        (r"self_attn\.(q|k|v)_proj\.bias$", (t,)),
        (r"self_attn\.o_proj\.kernel$", (t, None)),
        (r"self_attn\.sinks$", (t,)),  # GPT-OSS: one per query head, with its head
        (r"mlp\.(gate|up)_proj\.kernel$", (None, t)),
        (r"mlp\.down_proj\.kernel$", (t, None)),
        # mixture of experts: whole experts per device; the shared expert as a dense MLP
        (r"mlp\.experts\.(gate|up|down)_proj\.kernel$", (t, None, None)),
        (r"mlp\.experts\.(gate|up|down)_proj\.bias$", (t, None)),  # GPT-OSS: [E, out], with the experts
        (r"mlp\.shared_expert\.(gate|up)_proj\.kernel$", (None, t)),
        (r"mlp\.shared_expert\.down_proj\.kernel$", (t, None)),
    ]
    if vocab_parallel:
        rules += [(r"embed_tokens\.weight$", (t, None)), (r"lm_head\.kernel$", (None, t))]
    return tuple((re.compile(p), spec) for p, spec in rules)


# Embedding and LM head: replicated by default.  `strata-jax bench tp --vocab-parallel`
# on 4 CPU devices: vocab-parallel decode steps cost 2.3x (tp 2) / 1.2x (tp 4) the
# replicated ones (the logits are gathered for sampling); replication costs memory
# instead (3 % of Llama-3-70B's weights, 13 % of 8B's).  Numbers in docs/runtime.md.
VOCAB_PARALLEL = False


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh of the first ``tp`` devices (default: ``jax.devices()``) on axis ``tp``."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tp must be a positive integer, got {tp!r}")
    if tp > len(devices):
        platform = devices[0].platform if devices else "none"
        raise TensorParallelError(
            f"tp={tp} needs {tp} devices but {len(devices)} {platform} device(s) are visible"
            + (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)" if platform == "cpu" else "")
        )
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def check_model(config: ModelConfig, tp: int, *, vocab_parallel: bool = VOCAB_PARALLEL) -> None:
    """Raise ``TensorParallelError`` naming the counts if ``config`` cannot be split ``tp`` ways."""
    if tp == 1:
        return
    if config.num_kv_heads < tp:
        raise TensorParallelError(
            f"tp={tp} exceeds the model's {config.num_kv_heads} KV heads; KV heads are not replicated "
            f"(it would change the cached page layout), use tp <= {config.num_kv_heads}"
        )
    counts = [("attention heads", config.num_heads), ("KV heads", config.num_kv_heads)]
    if config.moe is None or config.mixed_mlp_layers:  # the dense MLPs split by columns / rows
        counts.append(("intermediate size", config.intermediate_size))
    if config.moe is not None:
        if config.moe.num_experts % tp:
            divisors = [n for n in range(2, config.moe.num_experts + 1) if config.moe.num_experts % n == 0]
            raise TensorParallelError(
                f"tp={tp} does not divide the model's num_experts={config.moe.num_experts}: the experts are "
                f"split over the tp devices (expert parallel, E/tp whole experts each) and are not replicated; "
                f"use a tp that divides num_experts ({', '.join(map(str, divisors[:8]))}"
                f"{', ...' if len(divisors) > 8 else ''})"
            )
        if config.moe.shared_expert_intermediate_size:
            counts.append(("shared_expert_intermediate_size", config.moe.shared_expert_intermediate_size))
    for name, count in counts:
        if count % tp:
            raise TensorParallelError(f"tp={tp} does not divide the model's {count} {name}")
    if vocab_parallel and config.vocab_size % tp:
        raise TensorParallelError(f"tp={tp} does not divide the vocabulary of {config.vocab_size} (vocab-parallel)")


def param_spec(path: str, ndim: int, *, vocab_parallel: bool = VOCAB_PARALLEL) -> PartitionSpec:
    """The spec of the parameter at dotted ``path`` with ``ndim`` axes (leading axes, e.g.
    the stacked layer axis, are not split)."""
    for pattern, trailing in _rules(vocab_parallel):
        if pattern.search(path):
            if ndim < len(trailing):
                raise TensorParallelError(f"parameter {path} has {ndim} axes, the tp rule expects >= {len(trailing)}")
            return PartitionSpec(*([None] * (ndim - len(trailing)) + list(trailing)))
    return PartitionSpec()


def state_shardings(state: nnx.State, mesh: Mesh, *, vocab_parallel: bool = VOCAB_PARALLEL) -> nnx.State:
    """A pytree like ``state`` with a ``NamedSharding`` per parameter."""

    def one(path: tuple, leaf: jax.Array) -> NamedSharding:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        dotted = ".".join(names[:-1] if names[-1:] == ["value"] else names)  # nnx.Variable's own .value
        return NamedSharding(mesh, param_spec(dotted, len(np.shape(leaf)), vocab_parallel=vocab_parallel))

    return jax.tree_util.tree_map_with_path(one, state)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """The KV pool's (and page-first staging's) sharding: split on the KV heads."""
    spec: list[str | None] = [None] * 6
    spec[POOL_HEAD_AXIS] = TP_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
