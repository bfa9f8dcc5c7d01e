"""LoRA inside the model's forward: every row's adapter in one step.

A step's adapters sit in ``S`` device slots of rank ``R`` (``runtime/lora_bank.py``); for
each targeted module the slots' A matrices are one ``[L, in, S*R]`` array and the B
matrices (scaling folded in) one ``[L, S*R, out]``.  A token of slot ``s`` adds

    ((x @ A) * mask) @ B,   mask[t, c] = 1 where column c belongs to slot s (c // R == s)

which is two dense matmuls of width ``S*R`` whatever the mix of adapters in the batch: no
sort, no gather of per-token weights, no shape that depends on the batch (nothing to
recompile when an adapter is loaded).  Its cost grows with ``S*R``, not with the number of
adapters the batch uses.  Two cases skip most of it, chosen per step on the device
(``mode``, a ``lax.switch`` in every targeted projection): a step with no adapter token
adds nothing, and a step whose tokens all belong to one adapter (a long prompt's chunk,
a batch of one tenant) multiplies by that slot's ``R`` columns only.  A segmented matmul
over rows sorted by adapter would also skip the zero columns of mixed steps, at the price
of a sort and a scatter back per projection, and loses to this form on XLA:CPU
(``strata-jax bench lora-forms``; numbers in docs/runtime.md, "LoRA in the step").

Token slots: ``>= 0`` an adapter's, ``-1`` a base-model token, ``-2`` padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraStep:
    """A step's LoRA inputs: ``mask [T, S*R]``, ``mode`` (``NONE``, ``SINGLE``: every
    non-padding token is on adapter ``slot``, ``MIXED``), and per targeted module
    ``a [L, in, S*R]`` and ``b [L, S*R, out]``."""

    mask: jax.Array
    mode: jax.Array
    slot: jax.Array
    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    rank: int = field(default=16, metadata={"static": True})

    def per_layer(self) -> dict[str, jax.Array]:
        """The stacked weights as ``run_stacked_layers`` per-layer values (sliced per layer)."""
        return {f"lora_a:{m}": v for m, v in self.a.items()} | {f"lora_b:{m}": v for m, v in self.b.items()}

    def for_layer(self, values: dict[str, Any]) -> LayerLora:
        """This step's LoRA for the layer whose per-layer ``values`` are given."""
        a = {m: values[f"lora_a:{m}"] for m in self.a}
        b = {m: values[f"lora_b:{m}"] for m in self.b}
        return LayerLora(self.mask, self.mode, self.slot, self.rank, a, b)


NONE, SINGLE, MIXED = 0, 1, 2


@dataclass(frozen=True)
class LayerLora:
    """One layer's LoRA weights (``a [in, S*R]``, ``b [S*R, out]`` per module), the step's
    mask, mode and single slot, and the slots' rank."""

    mask: jax.Array
    mode: jax.Array
    slot: jax.Array
    rank: int
    a: dict[str, jax.Array]
    b: dict[str, jax.Array]


def project(linear: Any, name: str, x: jax.Array, lora: LayerLora | None) -> jax.Array:
    """``linear(x)`` plus the low-rank update of each token's adapter when ``name`` is targeted."""
    y = linear(x)
    if lora is None or name not in lora.a:
        return y
    a, b, rank = lora.a[name].astype(x.dtype), lora.b[name].astype(x.dtype), lora.rank

    def single(y: jax.Array) -> jax.Array:  # one adapter's R columns
        start = lora.slot * rank
        a_slot = jax.lax.dynamic_slice_in_dim(a, start, rank, axis=1)
        b_slot = jax.lax.dynamic_slice_in_dim(b, start, rank, axis=0)
        return y + (x @ a_slot) @ b_slot

    def mixed(y: jax.Array) -> jax.Array:  # every slot's columns, each token's own kept by the mask
        # a select, not a product: another slot's columns can never leak in (0 * inf is NaN)
        return y + jnp.where(lora.mask > 0, x @ a, jnp.zeros((), x.dtype)) @ b

    return jax.lax.switch(lora.mode, [lambda y: y, single, mixed], y)


def token_mask(token_slot: jax.Array, slots: int, rank: int) -> jax.Array:
    """``[T, slots * rank]`` float32: 1 where a column belongs to the token's slot (< 0: none)."""
    column_slot = jnp.arange(slots * rank, dtype=jnp.int32) // rank
    return (token_slot[:, None] == column_slot[None, :]).astype(jnp.float32)


def step_mode(token_slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mode, the single slot) of a step's token slots (module doc)."""
    adapter = token_slot >= 0
    slot = jnp.max(token_slot).clip(0)
    others = (token_slot == -1) | (adapter & (token_slot != slot))
    mode = jnp.where(~jnp.any(adapter), NONE, jnp.where(jnp.any(others), MIXED, SINGLE))
    return mode.astype(jnp.int32), slot.astype(jnp.int32)
