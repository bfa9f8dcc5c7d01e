"""LoRA inside the model's forward: every row's adapter in one step.

A step's adapters sit in ``S`` device slots of rank ``R`` (``runtime/lora_bank.py``); for
each targeted module the slots' A matrices are one ``[L, in, S*R]`` array and the B
matrices (scaling folded in) one ``[L, S*R, out]``.  A token of slot ``s`` adds

    ((x @ A) * mask) @ B,   mask[t, c] = 1 where column c belongs to slot s (c // R == s)

which is two dense matmuls of width ``S*R`` whatever the mix of adapters in the batch: no
sort, no gather of per-token weights, no shape that depends on the batch (nothing to
recompile when an adapter is loaded).  Its cost grows with ``S*R``, not with the number of
adapters the batch uses; the base model's tokens (slot -1) have an all-zero mask.  A
segmented matmul over rows sorted by adapter would skip the zero columns, at the price
of a sort and a scatter back per projection: with ``S*R`` small next to the layer widths
the dense form is the cheaper one on these machines (``strata-jax bench lora``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraStep:
    """A step's LoRA inputs: ``mask [T, S*R]`` and, per targeted module, ``a [L, in, S*R]``
    and ``b [L, S*R, out]``."""

    mask: jax.Array
    a: dict[str, jax.Array]
    b: dict[str, jax.Array]

    def per_layer(self) -> dict[str, jax.Array]:
        """The stacked weights as ``run_stacked_layers`` per-layer values (sliced per layer)."""
        return {f"lora_a:{m}": v for m, v in self.a.items()} | {f"lora_b:{m}": v for m, v in self.b.items()}

    def for_layer(self, values: dict[str, Any]) -> LayerLora:
        """This step's LoRA for the layer whose per-layer ``values`` are given."""
        a = {m: values[f"lora_a:{m}"] for m in self.a}
        return LayerLora(self.mask, a, {m: values[f"lora_b:{m}"] for m in self.b})


@dataclass(frozen=True)
class LayerLora:
    """One layer's LoRA weights (``a [in, S*R]``, ``b [S*R, out]`` per module) and the step's mask."""

    mask: jax.Array
    a: dict[str, jax.Array]
    b: dict[str, jax.Array]


def project(linear: Any, name: str, x: jax.Array, lora: LayerLora | None) -> jax.Array:
    """``linear(x)`` plus the low-rank update of each token's adapter when ``name`` is targeted."""
    y = linear(x)
    if lora is None or name not in lora.a:
        return y
    low = (x @ lora.a[name].astype(x.dtype)) * lora.mask.astype(x.dtype)
    return y + low @ lora.b[name].astype(x.dtype)


def token_mask(token_slot: jax.Array, slots: int, rank: int) -> jax.Array:
    """``[T, slots * rank]`` float32: 1 where a column belongs to the token's slot (-1: none)."""
    column_slot = jnp.arange(slots * rank, dtype=jnp.int32) // rank
    return (token_slot[:, None] == column_slot[None, :]).astype(jnp.float32)
