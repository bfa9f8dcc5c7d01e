"""Per-sequence state that stays on the device between steps (``SeqTables``).

A running sequence holds one *slot* ``s`` (``SeqSlots.acquire``) and row ``s`` of every
table below, written once when the sequence starts (``SeqSlots.write_rows``: one small
program for up to ``K`` rows) and after that only by the jitted step itself:

    page_table    [S, W] int32   the sequence's device pages in order
    seq_lens      [S]    int32   tokens whose KV the dispatched steps write (the next position)
    last_token    [S]    int32   the token sampled last: the input of the next decode
    sampled       [S]    int32   samples kept so far (the RNG step; min_tokens)
    temperature, top_k, top_p [S]; penalties [S, 3] (repetition, frequency, presence)
    sampling_slot [S]    int32   its ``SamplingState`` slot (penalty flags / bias rows) or none
    min_tokens    [S]    int32   EOS and stop ids are masked while ``sampled < min_tokens``
    want_logprobs [S]    int32   1: return the sampled token's logprob and top alternatives
    rng_base      [S, 2] uint32  the sequence's PRNG key; step ``k`` draws with ``fold_in(key, k)``
    constrained   [S]    int32   1: a grammar constrains the output (structured outputs)
    adapter_slot  [S]    int32   its LoRA adapter's slot (``runtime/lora_bank.py``), -1: the base model
    token_mask    [S, W] int32   its allowed next tokens, one bit per id (``W = ceil(V / 32)``);
                                 written before every step that samples for it (``write_masks``)

So a step ships only ``[B]`` slot ids, the new tokens of extends, a few page-table
entries that changed (``[U, 3]`` triples: slot, index, page) and per-row bits: a decode
step's input tokens are the previous step's samples, read on the device, which is what
lets the engine dispatch step N+1 before it has read step N's tokens.

Slot ids out of range (``S``, used for padding rows) read clamped rows that the step
masks, and their writes are dropped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.runtime.buckets import power_of_two_buckets

# per-row bits of a step (``StepInputs.row_bits``)
COUNT_SAMPLE = 2  # the sampled token is kept (not a prompt chunk that is not the last)
VERIFY = 4  # extend rows: a speculative verification (the target's token after every position)
HOST_TOKEN = 8  # decode rows: the input token is ``input_ids[row]``, not the slot's last sample
# extend rows: a decode row riding in a prompt chunk's program (a mixed step): its one token is the
# slot's last sample, at the slot's KV length, as a decode program would take them
DEVICE_TOKEN = 16


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SeqTables:
    page_table: jax.Array
    seq_lens: jax.Array
    last_token: jax.Array
    sampled: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    penalties: jax.Array
    sampling_slot: jax.Array
    min_tokens: jax.Array
    want_logprobs: jax.Array
    rng_base: jax.Array
    constrained: jax.Array
    adapter_slot: jax.Array
    token_mask: jax.Array

    @staticmethod
    def zeros(num_slots: int, width: int, no_sampling_slot: int, mask_words: int = 1) -> SeqTables:
        s = num_slots
        return SeqTables(
            page_table=jnp.zeros((s, width), jnp.int32),
            seq_lens=jnp.zeros(s, jnp.int32),
            last_token=jnp.zeros(s, jnp.int32),
            sampled=jnp.zeros(s, jnp.int32),
            temperature=jnp.zeros(s, jnp.float32),
            top_k=jnp.zeros(s, jnp.int32),
            top_p=jnp.ones(s, jnp.float32),
            penalties=jnp.tile(jnp.asarray([1.0, 0.0, 0.0], jnp.float32), (s, 1)),
            sampling_slot=jnp.full(s, no_sampling_slot, jnp.int32),
            min_tokens=jnp.zeros(s, jnp.int32),
            want_logprobs=jnp.zeros(s, jnp.int32),
            rng_base=jnp.zeros((s, 2), jnp.uint32),
            constrained=jnp.zeros(s, jnp.int32),
            adapter_slot=jnp.full(s, -1, jnp.int32),
            token_mask=jnp.full((s, mask_words), -1, jnp.int32),
        )


ROW_FIELDS = (
    "page_table",
    "seq_lens",
    "last_token",
    "sampled",
    "temperature",
    "top_k",
    "top_p",
    "penalties",
    "sampling_slot",
    "min_tokens",
    "want_logprobs",
    "rng_base",
    "constrained",
    "adapter_slot",
)  # what ``write_rows`` writes (the token mask has ``write_masks``)


@dataclass(frozen=True)
class RowParams:
    """What a sequence's row holds besides its pages: fixed for its life on the device."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    sampling_slot: int | None = None
    min_tokens: int = 0
    want_logprobs: bool = False
    rng_base: tuple[int, int] = (0, 0)
    constrained: bool = False
    adapter_slot: int = -1  # its LoRA adapter's device slot; -1: the base model


def rng_base_for(seed: int | None, request_id: str) -> tuple[int, int]:
    """A request's PRNG key (two uint32 words), reproducible for a seed; hashed once per request."""
    digest = hashlib.sha256(f"{seed if seed is not None else request_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def _row_arrays(k: int, width: int, no_sampling_slot: int) -> dict[str, np.ndarray]:
    return {
        "slot": np.zeros(k, np.int32),  # padding rows get an out-of-range slot below
        "whole": np.zeros(k, np.int32),  # 1: every field; 0: the page table only
        "page_table": np.zeros((k, width), np.int32),
        "seq_lens": np.zeros(k, np.int32),
        "last_token": np.zeros(k, np.int32),
        "sampled": np.zeros(k, np.int32),
        "temperature": np.zeros(k, np.float32),
        "top_k": np.zeros(k, np.int32),
        "top_p": np.ones(k, np.float32),
        "penalties": np.tile(np.asarray([1.0, 0.0, 0.0], np.float32), (k, 1)),
        "sampling_slot": np.full(k, no_sampling_slot, np.int32),
        "min_tokens": np.zeros(k, np.int32),
        "want_logprobs": np.zeros(k, np.int32),
        "rng_base": np.zeros((k, 2), np.uint32),
        "constrained": np.zeros(k, np.int32),
        "adapter_slot": np.full(k, -1, np.int32),
    }


def _write_rows(tables: SeqTables, rows: dict) -> SeqTables:
    slot = rows["slot"]
    current = jnp.minimum(slot, tables.seq_lens.shape[0] - 1)
    whole = rows["whole"] != 0
    updates = {}
    for name in ROW_FIELDS:
        table = getattr(tables, name)
        new = rows[name]
        if name != "page_table":  # a page-table-only rewrite keeps what the steps wrote (last token, ...)
            keep = whole.reshape((-1,) + (1,) * (new.ndim - 1))
            new = jnp.where(keep, new, table[current])
        updates[name] = table.at[slot].set(new, mode="drop")
    return _replace(tables, **updates)


def _write_masks(tables: SeqTables, slots: jax.Array, masks: jax.Array) -> SeqTables:
    return _replace(tables, token_mask=tables.token_mask.at[slots].set(masks, mode="drop"))


class SeqSlots:
    """The device tables plus a free list of slots (host bookkeeping; one engine thread).

    ``write_rows`` compiles one program per row bucket (powers of two up to
    ``max_rows``); warm-up compiles them all.
    """

    def __init__(
        self,
        num_slots: int,
        width: int,
        *,
        no_sampling_slot: int,
        max_rows: int,
        mask_words: int = 1,
        sharding: jax.sharding.Sharding | None = None,
    ) -> None:
        if num_slots <= 0 or width <= 0:
            raise ValueError(f"sequence state needs slots and pages, got {num_slots} x {width}")
        self.num_slots = num_slots
        self.width = width
        self.no_sampling_slot = no_sampling_slot
        self.mask_words = mask_words
        tables = SeqTables.zeros(num_slots, width, no_sampling_slot, mask_words)
        self.tables = jax.device_put(tables, sharding) if sharding is not None else tables
        self._free = list(range(num_slots - 1, -1, -1))
        self.row_buckets = power_of_two_buckets(1, max(1, max_rows))
        jit_kwargs: dict[str, Any] = {"out_shardings": sharding} if sharding is not None else {}
        self._write = jax.jit(_write_rows, donate_argnums=(0,), **jit_kwargs)
        self._write_masks = jax.jit(_write_masks, donate_argnums=(0,), **jit_kwargs)

    # -- slots --------------------------------------------------------------
    @property
    def padding_slot(self) -> int:
        """The slot id of a padding row: out of range, so reads are masked and writes dropped."""
        return self.num_slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot, or None when every slot holds a running sequence."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"sequence slot {slot} is not held")
        self._free.append(slot)

    # -- rows ---------------------------------------------------------------
    def write_rows(self, rows: list[tuple[int, list[int] | np.ndarray, int, int, int, RowParams | None]]) -> None:
        """Write rows: ``(slot, pages, seq_len, last_token, sampled, params)`` each; with
        ``params=None`` only the page table is written (the rest is what the steps left).

        Dispatched like a step (asynchronously, ordered before every later step by the
        donated tables), in as few programs as the row buckets allow.
        """
        largest = self.row_buckets[-1]
        for start in range(0, len(rows), largest):
            part = rows[start : start + largest]
            k = next(b for b in self.row_buckets if b >= len(part))
            x = _row_arrays(k, self.width, self.no_sampling_slot)
            x["slot"][:] = self.padding_slot
            for i, (slot, pages, seq_len, last_token, sampled, p) in enumerate(part):
                if len(pages) > self.width:
                    raise ValueError(f"{len(pages)} pages exceed the page table's {self.width} columns")
                x["slot"][i] = slot
                x["page_table"][i, : len(pages)] = pages
                if p is None:
                    continue
                x["whole"][i] = 1
                x["seq_lens"][i] = seq_len
                x["last_token"][i] = last_token
                x["sampled"][i] = sampled
                x["temperature"][i] = p.temperature
                x["top_k"][i] = p.top_k
                x["top_p"][i] = p.top_p
                x["penalties"][i] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                x["sampling_slot"][i] = self.no_sampling_slot if p.sampling_slot is None else p.sampling_slot
                x["min_tokens"][i] = p.min_tokens
                x["want_logprobs"][i] = int(p.want_logprobs)
                x["rng_base"][i] = p.rng_base
                x["constrained"][i] = int(p.constrained)
                x["adapter_slot"][i] = p.adapter_slot
            self.tables = self._write(self.tables, x)

    def write_masks(self, slots: list[int], masks: list[np.ndarray]) -> None:
        """Write the next-token masks of constrained rows (before the step that samples for them)."""
        largest = self.row_buckets[-1]
        for start in range(0, len(slots), largest):
            part = slots[start : start + largest]
            k = next(b for b in self.row_buckets if b >= len(part))
            ids = np.full(k, self.padding_slot, np.int32)
            ids[: len(part)] = part
            rows = np.full((k, self.mask_words), -1, np.int32)
            rows[: len(part)] = masks[start : start + largest]
            self.tables = self._write_masks(self.tables, ids, rows)

    @property
    def warmup_programs(self) -> int:
        """How many programs ``warmup`` compiles: ``write_rows`` and ``write_masks`` per row bucket."""
        return 2 * len(self.row_buckets)

    def warmup(self) -> int:
        """Compile ``write_rows`` and ``write_masks`` for every row bucket (padding rows: no change)."""
        for k in self.row_buckets:
            x = _row_arrays(k, self.width, self.no_sampling_slot)
            x["slot"][:] = self.padding_slot
            self.tables = self._write(self.tables, x)
            ids = np.full(k, self.padding_slot, np.int32)
            self.tables = self._write_masks(self.tables, ids, np.full((k, self.mask_words), -1, np.int32))
        return self.warmup_programs

    def compile_count(self) -> int:
        return self._write._cache_size() + self._write_masks._cache_size()  # type: ignore[attr-defined]  # no public count


# ---------------------------------------------------------------------------- inside the step
def step_rows(tables: SeqTables, slots: jax.Array, no_sampling_slot: int) -> dict[str, jax.Array]:
    """The batch's rows of the tables (padding rows: neutral values, no sampling state)."""
    valid = slots < tables.seq_lens.shape[0]
    idx = jnp.minimum(slots, tables.seq_lens.shape[0] - 1)
    rows = {
        "page_table": tables.page_table[idx],
        "seq_lens": jnp.where(valid, tables.seq_lens[idx], 0),
        "last_token": tables.last_token[idx],
        "sampled": tables.sampled[idx],
        "temperature": jnp.where(valid, tables.temperature[idx], 0.0),
        "top_k": tables.top_k[idx],
        "top_p": jnp.where(valid, tables.top_p[idx], 1.0),
        "penalties": jnp.where(valid[:, None], tables.penalties[idx], jnp.asarray([1.0, 0.0, 0.0], jnp.float32)),
        "sampling_slot": jnp.where(valid, tables.sampling_slot[idx], no_sampling_slot),
        "min_tokens": jnp.where(valid, tables.min_tokens[idx], 0),
        "want_logprobs": jnp.where(valid, tables.want_logprobs[idx], 0),
        "rng_base": tables.rng_base[idx],
        "constrained": valid & (tables.constrained[idx] != 0),
        "adapter_slot": jnp.where(valid, tables.adapter_slot[idx], -1),
        "mask_slot": idx,
        "valid": valid,
    }
    return rows


def apply_page_updates(tables: SeqTables, updates: jax.Array) -> SeqTables:
    """Set ``page_table[slot, index] = page`` for each ``[U, 3]`` triple (out-of-range slots dropped)."""
    table = tables.page_table.at[updates[:, 0], updates[:, 1]].set(updates[:, 2], mode="drop")
    return _replace(tables, page_table=table)


def after_step(
    tables: SeqTables, slots: jax.Array, kept: jax.Array, next_tokens: jax.Array, new_lens: jax.Array
) -> SeqTables:
    """Record the step: rows that kept their sample store it as the next input and count it;
    every row's KV now reaches ``new_lens``."""
    drop = tables.seq_lens.shape[0]
    kept_slots = jnp.where(kept, slots, drop)
    return _replace(
        tables,
        seq_lens=tables.seq_lens.at[slots].set(new_lens, mode="drop"),
        last_token=tables.last_token.at[kept_slots].set(next_tokens, mode="drop"),
        sampled=tables.sampled.at[kept_slots].add(1, mode="drop"),
    )


def step_keys(rng_base: jax.Array, sampled: jax.Array) -> jax.Array:
    """Raw PRNG keys ``[B, 2]``: each row's key folded with its sample count."""

    def one(base, count):
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(base), count))

    return jax.vmap(one)(rng_base, sampled.astype(jnp.uint32))


def _replace(tables: SeqTables, **changes: jax.Array) -> SeqTables:
    return SeqTables(**{f.name: changes.get(f.name, getattr(tables, f.name)) for f in fields(SeqTables)})
