"""Tree tier changes -> per-step lists of KV events (pure Python; no zmq, no msgspec).

A *block* is one KV page (``block_size`` = the page size).  Its hash is the first 8 bytes
(big-endian, unsigned) of the page's SHA-256 chain key (``strata_jax.cache.hashing``): the
key of the page and its whole prefix, seeded by the tenant namespace, so replicas of the
same model agree on it and two tenants never share one.  The parent of a node's first
block is the block before it (``None`` at the start of a sequence).

Events are tuples until the publisher's thread encodes them, so the engine thread pays
only for the hashes (which L3 needs anyway) and a list append:

    ("stored", medium, block_hashes, parent_block_hash, token_ids, lora_name, extra_keys)

A page computed under a LoRA adapter carries the name it is loaded under (vLLM's
``lora_name``) and, per block, ``("lora", identity)`` in ``extra_keys``: the content
digest its chain key is seeded with, so a consumer can tell two adapters of one name apart.
    ("removed", medium, block_hashes)
    ("cleared",)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from strata_jax.cache.radix_tree import HiRadixTree
from strata_jax.cache.tree_node import TreeNode
from strata_jax.lora.peft_adapter import namespace_adapter

# The tree's tiers as vLLM's ``medium`` names them (its MEDIUM_GPU / MEDIUM_CPU / MEDIUM_STORAGE).
MEDIUMS = {"device": "GPU", "host": "CPU", "storage": "STORAGE"}

RawEvent = tuple[Any, ...]
BatchSink = Callable[[float, list[RawEvent]], object]  # a sink may return a status (publish: bool); it is ignored


def block_hash(key: bytes) -> int:
    """The 64-bit block hash of a page's chain key."""
    return int.from_bytes(key[:8], "big")


class KVEventRecorder:
    """The tree's ``tier_observer``: collects one step's events, hands them to ``sink`` at ``end_step``."""

    def __init__(
        self, tree: HiRadixTree, sink: BatchSink, lora_name: Callable[[str], str | None] = lambda identity: None
    ) -> None:
        """``lora_name(identity)``: the name an adapter is loaded under (None: not loaded)."""
        self.tree = tree
        self.sink = sink
        self.lora_name = lora_name
        self._events: list[RawEvent] = []

    def observe(self, stored: bool, tier: str, node: TreeNode) -> None:
        tree = self.tree
        hashes = [block_hash(k) for k in tree.page_hashes(node)]
        if not stored:
            self._events.append(("removed", MEDIUMS[tier], hashes))
            return
        parent = node.parent
        parent_hash = None if parent is None or parent.parent is None else block_hash(tree.last_hash(parent))
        identity = namespace_adapter(node.namespace)
        if identity is None:
            self._events.append(("stored", MEDIUMS[tier], hashes, parent_hash, list(node.key), None, None))
            return
        extra = [("lora", identity)] * len(hashes)
        self._events.append(
            ("stored", MEDIUMS[tier], hashes, parent_hash, list(node.key), self.lora_name(identity), extra)
        )

    def mark(self) -> int:
        """A point in this step's events (``cleared_since`` rewinds to it)."""
        return len(self._events)

    def cleared_since(self, mark: int) -> None:
        """Every tier is empty now: the removals since ``mark`` become one ``AllBlocksCleared``."""
        del self._events[mark:]
        self._events.append(("cleared",))

    def end_step(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.sink(time.time(), events)
