"""KV events: what each cache tier holds, published in vLLM's wire format for KV-aware routers.

``recorder.KVEventRecorder`` (pure Python) watches the tree (``HiRadixTree.tier_observer``)
on the engine thread and hands each step's changes, as plain tuples, to
``publisher.ZmqKVEventPublisher``, whose own thread encodes them (``schema``: msgspec
structs of vLLM's ``EventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``)
and sends them on a ZMQ PUB socket, keeping the last batches for a ROUTER replay socket.
Mapping of tiers and pages: docs/serving.md, "KV events".
"""

from strata_jax.kv_events.recorder import MEDIUMS, KVEventRecorder, block_hash

__all__ = ["MEDIUMS", "KVEventRecorder", "block_hash"]
