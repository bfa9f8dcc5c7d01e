"""Device-resident per-sequence sampling state: token flags and logit bias rows.

A sequence that asks for penalties, ``logit_bias`` or ``min_tokens`` holds one
*slot*: row ``slot`` of ``flags[S, V]`` (int32, see ``logits_processors``) and of
``bias[S, V]`` (float32).  The row is written once when the slot is taken
(``seed``: prompt presence, suppressed ids, the bias), and after that only the
jitted step touches it (it reads the batch's rows and counts each sampled token),
so a step ships ``[B]`` slot ids, never a ``[B, V]`` array.  Sequences that asked
for none of it use ``NO_SLOT`` and cost nothing but the (skipped) ``lax.cond``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class NoFreeSlotError(RuntimeError):
    """Every sampling-state slot is held (the caller waits for one to free)."""


class SamplingState:
    """The two ``[S, V]`` tables plus a free list of slots (host bookkeeping only)."""

    def __init__(self, num_slots: int, vocab_size: int, *, sharding: jax.sharding.Sharding | None = None):
        """``sharding``: where the tables live (replicated over a tensor-parallel mesh)."""
        if num_slots <= 0:
            raise ValueError(f"sampling state needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.flags = jnp.zeros((num_slots, vocab_size), jnp.int32)
        self.bias = jnp.zeros((num_slots, vocab_size), jnp.float32)
        if sharding is not None:
            self.flags, self.bias = jax.device_put((self.flags, self.bias), sharding)
        self._free = list(range(num_slots - 1, -1, -1))
        self._seed = jax.jit(_seed_row, donate_argnums=(0, 1))

    @property
    def no_slot(self) -> int:
        """The slot id of a sequence without state (out of range: reads clamp, writes drop)."""
        return self.num_slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise NoFreeSlotError(f"all {self.num_slots} sampling-state slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)

    def warmup(self) -> None:
        """Compile ``seed``'s program (writes zeros into a free slot: no state changes)."""
        if not self._free:
            return
        slot = self._free[-1]
        self.seed(slot, np.zeros(self.vocab_size, np.int32), np.zeros(self.vocab_size, np.float32))

    def seed(self, slot: int, flags_row: np.ndarray, bias_row: np.ndarray) -> None:
        """Write a held slot's rows (one small program, one shape: compiled once)."""
        self.flags, self.bias = self._seed(self.flags, self.bias, jnp.int32(slot), flags_row, bias_row)


def _seed_row(flags, bias, slot, flags_row, bias_row):
    return flags.at[slot].set(flags_row), bias.at[slot].set(bias_row)


def gather_rows(table: jax.Array, slots: jax.Array) -> jax.Array:
    """Rows ``table[slots]`` (inside a jitted step); a slot out of range (``no_slot``)
    reads as a row of zeros, the neutral value of both tables."""
    held = slots < table.shape[0]
    rows = table[jnp.minimum(slots, table.shape[0] - 1)]
    return jnp.where(held[:, None], rows, jnp.zeros((), table.dtype))
