"""The device slots that hold LoRA adapters' weights (``models/lora.py`` has the layout).

``max_loras`` slots of rank ``max_lora_rank``, allocated at start: loading an adapter writes
its columns into the slot's arrays (a jitted in-place update whose slot offset is traced),
so no step program is retraced or recompiled.  An adapter of a smaller rank is zero-padded;
the scaling is folded into B.  Under tensor parallel the weights are split like the layers
they modify: B with the columns of q/k/v/gate/up, A with the rows of o/down; the rest is
replicated (``[in, S*R]`` is small).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strata_jax.lora.peft_adapter import ATTENTION_MODULES, MODULES, AdapterError, LoraAdapter, module_shape
from strata_jax.models.config import ModelConfig
from strata_jax.models.lora import LoraStep, step_mode, token_mask
from strata_jax.runtime.sharding import TP_AXIS

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@partial(jax.jit, donate_argnums=(0,))
def _write_columns(stacked: jax.Array, block: jax.Array, start: jax.Array) -> jax.Array:
    """``stacked [L, in, S*R]`` with columns ``start:start+R`` replaced by ``block [L, in, R]``."""
    return jax.lax.dynamic_update_slice(stacked, block, (jnp.int32(0), jnp.int32(0), start))


@partial(jax.jit, donate_argnums=(0,))
def _write_rows(stacked: jax.Array, block: jax.Array, start: jax.Array) -> jax.Array:
    """``stacked [L, S*R, out]`` with rows ``start:start+R`` replaced by ``block [L, R, out]``."""
    return jax.lax.dynamic_update_slice(stacked, block, (jnp.int32(0), start, jnp.int32(0)))


class LoraBank:
    """``slots`` adapters of rank at most ``rank`` on the device, for the layers of ``config``."""

    def __init__(self, config: ModelConfig, *, slots: int, rank: int, dtype: jnp.dtype, mesh: Mesh | None = None):
        if slots <= 0 or rank <= 0:
            raise ValueError(f"LoRA slots ({slots}) and rank ({rank}) must be positive")
        self.config, self.slots, self.rank, self.dtype = config, slots, rank, jnp.dtype(dtype)
        # adapters on a mixture of experts' MLP are refused at load (peft_adapter), so no MLP slots
        self.modules = MODULES if config.moe is None else ATTENTION_MODULES
        self.a: dict[str, jax.Array] = {}
        self.b: dict[str, jax.Array] = {}
        layers, width = config.num_layers, slots * rank
        for m in self.modules:
            d_in, d_out = module_shape(config, m)
            a = jnp.zeros((layers, d_in, width), self.dtype)
            b = jnp.zeros((layers, width, d_out), self.dtype)
            if mesh is not None:
                a_spec, b_spec = self.specs(m)
                a = jax.device_put(a, NamedSharding(mesh, a_spec))
                b = jax.device_put(b, NamedSharding(mesh, b_spec))
            self.a[m], self.b[m] = a, b
        self.holds: list[str | None] = [None] * slots  # each slot's adapter identity

    @staticmethod
    def specs(module: str) -> tuple[PartitionSpec, PartitionSpec]:
        """(A, B) partition specs of ``module`` under tensor parallel (module doc)."""
        if module in COLUMN_PARALLEL:
            return PartitionSpec(), PartitionSpec(None, None, TP_AXIS)
        return PartitionSpec(None, TP_AXIS, None), PartitionSpec()

    def install(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` (its untargeted modules zero)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"LoRA slot {slot} out of range [0, {self.slots})")
        if adapter.rank > self.rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds the slots' rank {self.rank}")
        layers, r, start = self.config.num_layers, adapter.rank, jnp.int32(slot * self.rank)
        blocks: dict[str, tuple[jax.Array, jax.Array]] = {}
        for m in self.modules:
            d_in, d_out = module_shape(self.config, m)
            a = np.zeros((layers, d_in, self.rank), np.float32)
            b = np.zeros((layers, self.rank, d_out), np.float32)
            if m in adapter.weights:
                a_peft, b_peft = adapter.weights[m]  # [L, r, in], [L, out, r]
                a[:, :, :r] = a_peft.transpose(0, 2, 1)
                b[:, :r, :] = b_peft.transpose(0, 2, 1) * adapter.scaling
            blocks[m] = (_finite(a, self.dtype, adapter, m, "A"), _finite(b, self.dtype, adapter, m, "B"))
        # written only once every module passed: a refused adapter leaves the slot as it was
        for m, (a_block, b_block) in blocks.items():
            self.a[m] = _write_columns(self.a[m], a_block, start)
            self.b[m] = _write_rows(self.b[m], b_block, start)
        self.holds[slot] = adapter.identity

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (an unloaded adapter's weights must not linger where a bug could read them)."""
        start = jnp.int32(slot * self.rank)
        for m in self.modules:
            a, b = self.a[m], self.b[m]
            self.a[m] = _write_columns(a, jnp.zeros((a.shape[0], a.shape[1], self.rank), a.dtype), start)
            self.b[m] = _write_rows(b, jnp.zeros((b.shape[0], self.rank, b.shape[2]), b.dtype), start)
        self.holds[slot] = None

    def weights(self) -> dict[str, dict[str, jax.Array]]:
        """The arrays a step takes (``step_lora``)."""
        return {"a": dict(self.a), "b": dict(self.b)}

    def shardings(self, mesh: Mesh) -> dict[str, dict[str, NamedSharding]]:
        """``weights()``' shardings on ``mesh``."""
        return {
            "a": {m: NamedSharding(mesh, self.specs(m)[0]) for m in self.modules},
            "b": {m: NamedSharding(mesh, self.specs(m)[1]) for m in self.modules},
        }


def _finite(block: np.ndarray, dtype: jnp.dtype, adapter: LoraAdapter, module: str, which: str) -> jax.Array:
    """``block`` in the slots' dtype, refused when it is not finite there: a mixed step reads
    every slot's columns, so one slot's NaN or overflow would reach every row of the step."""
    cast = jnp.asarray(block, dtype)
    if not bool(jnp.isfinite(cast).all()):
        raise AdapterError(
            f"{adapter.path}: {module} lora_{which} (times its scaling {adapter.scaling:g}) is not finite in {dtype}"
        )
    return cast


def step_lora(weights: dict[str, dict[str, jax.Array]], token_slot: jax.Array, rank: int) -> LoraStep:
    """Inside the step: the ``LoraStep`` of tokens whose adapter slots are ``token_slot``
    (-1: the base model, -2: padding)."""
    any_a = next(iter(weights["a"].values()))
    slots = any_a.shape[2] // rank
    mode, slot = step_mode(token_slot)
    return LoraStep(token_mask(token_slot, slots, rank), mode, slot, weights["a"], weights["b"], rank)
