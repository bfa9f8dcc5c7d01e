"""vLLM's KV event wire format (``vllm.distributed.kv_events``, as of vllm 0.32) as msgspec structs.

One message on the PUB socket is three frames: the topic, the sequence number (8 bytes,
big-endian) and a msgpack ``EventBatch``: an array ``[ts, events, data_parallel_rank]``
whose events are maps tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``.
Fields this engine has no use for (``lora_id``, cache-spec groups) are left at their
defaults, which the encoding omits (``lora_id``, ``medium`` and ``lora_name`` have no
default in vLLM, so they are always written, ``None`` included).  A LoRA adapter's pages
carry ``lora_name`` and ``extra_keys`` (``recorder`` module doc).
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change of what a tier holds (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_struct(raw: tuple[Any, ...], block_size: int) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """One recorder tuple (``recorder`` module doc) as its wire struct."""
    kind = raw[0]
    if kind == "stored":
        _, medium, hashes, parent, tokens, lora_name, extra_keys = raw
        return BlockStored(hashes, parent, tokens, block_size, None, medium, lora_name, extra_keys)
    if kind == "removed":
        return BlockRemoved(raw[2], raw[1])
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {kind!r}")
