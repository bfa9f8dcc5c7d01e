"""``StorageKeys``: the L3 key of every page of the tree, along the hash chain (pure Python).

Key of page i = H(key of page i - 1 | token ids of page i), the chain seeded by the
namespace and the model's KV identity (``hashing``); computed lazily per node and
kept in ``TreeNode.hashes``.  ``HiRadixTree`` holds one and exposes its methods.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata_jax.cache.hashing import chain_hashes, namespace_seed
from strata_jax.cache.tree_node import TreeNode


class StorageKeys:
    """Storage keys of the pages of a tree with pages of ``page_size`` tokens."""

    def __init__(self, page_size: int, kv_identity: str) -> None:
        self.page_size = page_size
        self.kv_identity = kv_identity  # seeds every chain key (hashing.namespace_seed)

    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """Storage keys of ``node``'s pages (computed lazily along the chain)."""
        chain: list[TreeNode] = []
        x = node
        while x.hashes is None:
            chain.append(x)
            assert x.parent is not None, "a root's hashes are set when it is created"
            x = x.parent
        prev = x.hashes[-1] if x.hashes else self._seed_of(x)
        for y in reversed(chain):
            y.hashes = chain_hashes(prev, y.key, self.page_size)
            prev = y.hashes[-1]
        assert node.hashes is not None
        return node.hashes

    def adopt_hashes(self, node: TreeNode, keys: Sequence[bytes], first_page: int) -> None:
        """Record known storage keys for pages ``first_page ..`` of the path ending at ``node``.

        ``keys[i]`` is the key of path page ``first_page + i`` and the path to
        ``node`` ends at page ``first_page + len(keys)``; nodes lying entirely in
        that range and without keys get theirs (saves re-hashing after a prefetch).
        """
        end = first_page + len(keys)
        ps = self.page_size
        while node.parent is not None:
            npg = len(node.key) // ps
            start = end - npg
            if start < first_page:
                break
            if node.hashes is None:
                node.hashes = list(keys[start - first_page : end - first_page])
            end = start
            node = node.parent

    def last_hash(self, node: TreeNode) -> bytes:
        """Key of the last page on the path to ``node`` (the namespace seed at the root)."""
        while node.parent is not None and not node.key:
            node = node.parent
        if node.parent is None:
            return self.seed(node.namespace)
        return self.page_hashes(node)[-1]

    def _seed_of(self, node: TreeNode) -> bytes:
        while node.parent is not None:
            node = node.parent
        return self.seed(node.namespace)

    def seed(self, namespace: str) -> bytes:
        """The chain key before the first page of ``namespace``."""
        return namespace_seed(namespace, self.kv_identity)
