"""Hierarchical KV cache: HiRadixTree, pools, cache controller, L3 storage.  See docs/cache.md.

Files (one job each):

* ``radix_tree.py``  HiRadixTree (pure Python, no jax), built from ``tree_node.py`` (TreeNode,
  PrefixMatch, InsertResult) and ``tree_tiers.py`` (per-tier attach, eviction, check)
* ``allocator.py``   O(1) page allocator (pure Python)
* ``hashing.py``     SHA-256 page-key chain seeded by the namespace (pure Python)
* ``config.py``      CacheConfig (frozen; every default documented)
* ``storage.py``     L3 interface, object framing, backend registry (+ memory backend)
* ``storage_file.py`` / ``storage_redis.py``  the file and Redis backends
* ``pools.py``       DevicePool (layer-first jax array) and HostPool (page-first numpy)
* ``controller.py``  CacheController: the policy core (queries, locks, inserts, write and eviction
  policy, the link estimate, accounting), composed of the parts below
* ``transfer_backend.py``  TransferBackend: what moves pages; ``device_transfers.py`` (real pools,
  I/O threads) and ``sim_transfers.py`` (no bytes; at once or in virtual time)
* ``storage_service.py``  the L3 store as the controller sees it: keys, probes, writes, errors
* ``prefetch.py``    L3 -> L2 prefetches: start, stop policy, settle into the tree
* ``inflight.py``    transfers in flight and their completion
* ``handles.py``     TransferHandle, PrefetchHandle, Completion kinds, CacheError, CacheFullError
* ``replay.py``      the request driver the cache benchmarks use

Names are imported lazily so that ``import strata_jax.cache.radix_tree`` never pulls in jax.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HiRadixTree": "radix_tree",
    "PrefixMatch": "radix_tree",
    "InsertResult": "radix_tree",
    "TreeNode": "radix_tree",
    "TreeError": "radix_tree",
    "PageAllocator": "allocator",
    "AllocatorError": "allocator",
    "CacheConfig": "config",
    "CacheConfigError": "config",
    "StorageBackend": "storage",
    "StorageStats": "storage",
    "STORAGE_BACKENDS": "storage",
    "make_storage": "storage",
    "CacheController": "controller",
    "CacheError": "controller",
    "CacheFullError": "controller",
    "TransferHandle": "handles",
    "PrefetchHandle": "handles",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'strata_jax.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(f"strata_jax.cache.{module}"), name)
