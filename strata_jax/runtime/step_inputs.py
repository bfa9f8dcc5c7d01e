"""What one step ships to the device, and how the jitted step turns it into model inputs.

A step's inputs are small: the batch's sequence slots, the new tokens of extends, a
few page-table entries that changed and per-row bits (``seq_state``).  Everything else
a row needs (its page table, KV length, last sampled token, sampling parameters, RNG
key) is read from the ``SeqTables`` on the device.  Two program kinds, told apart by
shape (``T == B`` is a decode):

decode (one token per row; the input is the row's last sample unless ``HOST_TOKEN``)::

    slots [B]  input_ids [B]  row_bits [B]  pt_updates [B, 3]

extend (ragged prompt chunks; positions ``start[i] ..``)::

    slots [B]  input_ids [T]  query_start [B + 1]  start [B]  row_bits [B]
    pt_updates [T // page_size + 2B, 3]  targets [T]   (prompt-logprob targets, -1: none)

An extend row with ``DEVICE_TOKEN`` is a decode row in a mixed step: one token, whose id
(``input_ids``) and position (``start``) the program takes from the slot's last sample and
KV length instead, as a decode program does (the host may not have read that sample yet).

A pool with layer groups whose local pages have ids of their own adds ``local_map``
(int32 ``[num_pages]``, global -> local page, -1 for none; a device array the runner
copies only when it changed).

Rows are packed first, padding after (slot ``S``, out of range); ``pt_updates`` padding
triples have slot ``S`` too and are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.engine.executor import ExtendChunk
from strata_jax.models.llama import AttentionMetadata
from strata_jax.runtime import sampling_step
from strata_jax.runtime.seq_state import (
    COUNT_SAMPLE,
    DEVICE_TOKEN,
    HOST_TOKEN,
    VERIFY,
    SeqTables,
    apply_page_updates,
    step_keys,
    step_rows,
)


def update_capacity(tokens: int, rows: int, page_size: int) -> int:
    """Page-table entries one step can carry: a decode adds at most a page per row; an
    extend chunk of ``n`` tokens at most ``n // page_size + 2`` pages."""
    return rows if tokens == rows else tokens // page_size + 2 * rows


def empty_inputs(tokens: int, rows: int, *, padding_slot: int, page_size: int) -> dict[str, np.ndarray]:
    x = {
        "slots": np.full(rows, padding_slot, np.int32),
        "input_ids": np.zeros(tokens, np.int32),
        "row_bits": np.zeros(rows, np.int32),
        "pt_updates": np.full((update_capacity(tokens, rows, page_size), 3), padding_slot, np.int32),
    }
    if tokens != rows:
        x["query_start"] = np.zeros(rows + 1, np.int32)
        x["start"] = np.zeros(rows, np.int32)
        x["targets"] = np.full(tokens, sampling_step.NO_TARGET, np.int32)
    return x


def pack_updates(x: dict[str, np.ndarray], updates: np.ndarray | None) -> None:
    if updates is None or not len(updates):
        return
    cap = len(x["pt_updates"])
    if len(updates) > cap:
        raise ValueError(f"{len(updates)} page-table updates exceed the step's {cap}")
    x["pt_updates"][: len(updates)] = updates


def pack_extend(x: dict[str, np.ndarray], rows: Sequence[ExtendChunk[int]]) -> int:
    """Fill an extend step's arrays from chunks addressed by slot (each slot's row is
    already written); returns the packed token count."""
    offset = 0
    qs, start, ids, bits, targets = x["query_start"], x["start"], x["input_ids"], x["row_bits"], x["targets"]
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        if n == 0:
            raise ValueError("a sequence in the batch has no new tokens")
        x["slots"][i] = r.row
        ids[offset : offset + n] = r.token_ids
        start[i] = r.start
        bits[i] = (COUNT_SAMPLE if r.keep_sample else 0) | (VERIFY if r.verify else 0)
        if r.device_token:
            if n != 1 or r.verify or r.prompt_logprob_targets is not None:
                raise ValueError("a decode row in an extend step carries exactly one token and nothing else")
            bits[i] |= DEVICE_TOKEN
        if r.prompt_logprob_targets is not None:
            if len(r.prompt_logprob_targets) != n:
                raise ValueError(f"{len(r.prompt_logprob_targets)} prompt logprob targets for {n} tokens")
            targets[offset : offset + n] = r.prompt_logprob_targets
        offset += n
        qs[i + 1] = offset
    qs[len(rows) + 1 :] = offset
    return offset


def model_inputs(
    tables: SeqTables,
    x: dict,
    *,
    page_size: int,
    num_kv_slots: int,
    no_sampling_slot: int,
    layer_pages: tuple[tuple[int, int], ...] | None = None,
) -> tuple[jax.Array, jax.Array, AttentionMetadata, dict, jax.Array, SeqTables]:
    """Inside the jitted step: (input_ids, positions, attention metadata, sampling inputs,
    each row's KV length after the step, tables with the page updates applied).
    ``layer_pages``: a pool with layer groups, each layer's (first row, page count)
    (``GroupedPoolLayout.layer_rows``, ``AttentionMetadata``); ``num_kv_slots``
    is then its whole slot count."""
    tables = apply_page_updates(tables, x["pt_updates"])
    slots = x["slots"]
    rows = step_rows(tables, slots, no_sampling_slot)
    valid = rows["valid"]
    bits = x["row_bits"]
    num_rows, num_tokens = slots.shape[0], x["input_ids"].shape[0]
    if num_tokens == num_rows:  # decode: one token per row, at the row's KV length
        row_of_token = jnp.arange(num_rows)
        positions = jnp.where(valid, rows["seq_lens"], 0)
        input_ids = jnp.where((bits & HOST_TOKEN) != 0, x["input_ids"], rows["last_token"])
        new_lens = jnp.where(valid, positions + 1, 0)
        token_valid = valid
        query_start = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), jnp.sum(valid, dtype=jnp.int32))
        last_index = jnp.arange(num_rows, dtype=jnp.int32)
        targets = jnp.full(num_tokens, sampling_step.NO_TARGET, jnp.int32)
        token_offset = jnp.zeros(num_tokens, jnp.int32)
    else:
        query_start = x["query_start"]
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        # row of token t = rows that end at or before t: a scatter of row ends and a cumsum (no loop)
        ends = jnp.zeros(num_tokens, jnp.int32).at[query_start[1:]].add(1, mode="drop")
        row_of_token = jnp.minimum(jnp.cumsum(ends), num_rows - 1)
        token_valid = t < query_start[num_rows]
        device_row = valid & ((bits & DEVICE_TOKEN) != 0)  # a decode row of a mixed step
        start = jnp.where(device_row, rows["seq_lens"], x["start"])
        positions = jnp.where(token_valid, start[row_of_token] + t - query_start[row_of_token], 0)
        input_ids = jnp.where(token_valid & device_row[row_of_token], rows["last_token"][row_of_token], x["input_ids"])
        lengths = query_start[1:] - query_start[:-1]
        new_lens = jnp.where(valid & (lengths > 0), start + lengths, 0)
        last_index = jnp.maximum(query_start[1:] - 1, 0)
        targets = x["targets"]
        token_offset = t - query_start[row_of_token]
    width = rows["page_table"].shape[1]
    page_index = jnp.minimum(positions // page_size, width - 1)
    page = rows["page_table"][row_of_token, page_index]  # T elements, not T rows
    slot_mapping = jnp.where(token_valid, page * page_size + positions % page_size, num_kv_slots)
    base = count = None
    if layer_pages is not None:
        base, count = (jnp.asarray(column, jnp.int32) for column in zip(*layer_pages))
    local_table = local_slots = None
    if "local_map" in x:  # local layers' pages are local ids: the map applied to the tables
        # (a missing local page, -1, is clipped / dropped by AttentionMetadata.for_layer)
        local_map = x["local_map"]
        local_table = local_map[jnp.clip(rows["page_table"], 0, local_map.shape[0] - 1)]
        local_page = local_map[jnp.clip(page, 0, local_map.shape[0] - 1)]
        local_slots = jnp.where(token_valid, local_page * page_size + positions % page_size, num_kv_slots)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        page_table=rows["page_table"],
        seq_lens=new_lens,
        query_start=query_start,
        layer_page_base=base,
        layer_page_count=count,
        local_page_table=local_table,
        local_slot_mapping=local_slots,
    )
    kept = valid & ((bits & COUNT_SAMPLE) != 0)
    row_bits = (
        jnp.where(rows["sampled"] < rows["min_tokens"], sampling_step.MIN_TOKENS_ACTIVE, 0)
        | jnp.where(kept, sampling_step.COUNT_SAMPLE, 0)
        | jnp.where(kept & (rows["want_logprobs"] != 0), sampling_step.WANT_LOGPROBS, 0)
    ).astype(jnp.int32)
    sampling = {
        "last_index": last_index,
        "temperature": rows["temperature"],
        "top_k": rows["top_k"],
        "top_p": rows["top_p"],
        "rng_keys": step_keys(rows["rng_base"], rows["sampled"]),
        "slot": rows["sampling_slot"],
        "penalties": rows["penalties"],
        "row_bits": row_bits,
        "targets": targets,
        "kept": kept,
        "constrained": rows["constrained"],
        "mask_slot": rows["mask_slot"],
        # a speculative verification's tokens (verify_sampling): each drawn as decoding would
        "verify": token_valid & ((bits[row_of_token] & VERIFY) != 0),
        "row_of_token": row_of_token,
        "token_offset": token_offset,
        "input_ids": input_ids,
        "sampled": rows["sampled"],
        "min_tokens": rows["min_tokens"],
        "rng_base": rows["rng_base"],
        # not sampling's: each token's LoRA adapter slot (-1: the base model, -2: padding), for the forward
        "token_adapter": jnp.where(token_valid, rows["adapter_slot"][row_of_token], -2),
    }
    return input_ids, positions, meta, sampling, new_lens, tables
