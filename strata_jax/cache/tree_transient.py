"""The transient nodes of ``HiRadixTree`` by owner: prefixes a request will compute (no jax).

A transient node holds no data: it marks tokens a queued (``in_queue``) or dispatched
(``in_flight``) request is computing, so a later request with the same prefix waits
for it instead of computing it twice.  ``TransientOwners`` keeps, for each owner, the
set of its transient nodes; the tree calls it at every change of a node's owner
(a new queued leaf, a split, a node made ready, an abort).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from strata_jax.cache.tree_node import IN_FLIGHT, IN_QUEUE, READY, TreeNode


def _depth(node: TreeNode) -> int:
    d = 0
    while node.parent is not None:
        node = node.parent
        d += 1
    return d


class TransientOwners:
    """Each owner's transient nodes (``by_owner``); the only code that changes a node's owner."""

    def __init__(self) -> None:
        self.by_owner: dict[Hashable, set[TreeNode]] = {}

    def queue(self, leaf: TreeNode, owner: Hashable) -> None:
        """Make a new leaf an ``in_queue`` node of ``owner``."""
        leaf.state = IN_QUEUE
        leaf.owner = owner
        self.by_owner.setdefault(owner, set()).add(leaf)

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        """``upper`` was split off ``node`` (and copied its owner): it is that owner's too."""
        if node.is_transient:
            self.by_owner[node.owner].add(upper)

    def make_ready(self, node: TreeNode) -> None:
        """``node`` got data (or leaves the tree): it is no longer anyone's to compute."""
        if node.is_transient:
            owned = self.by_owner.get(node.owner)
            if owned is not None:
                owned.discard(node)
                if not owned:
                    del self.by_owner[node.owner]
            node.state = READY
            node.owner = None

    def mark_in_flight(self, owner: Hashable) -> int:
        """Owner's prefill was dispatched: its ``in_queue`` nodes become ``in_flight``; returns tokens."""
        total = 0
        for node in self.by_owner.get(owner, ()):
            node.state = IN_FLIGHT
            total += len(node.key)
        return total

    def owned_tokens(self, owner: Hashable) -> int:
        """Tokens of transient nodes still owned by ``owner``."""
        return sum(len(n.key) for n in self.by_owner.get(owner, ()))

    def remove(self, owner: Hashable, delete: Callable[[TreeNode], None]) -> int:
        """Abort: ``delete`` ``owner``'s transient nodes, deepest first; returns tokens removed.

        A node that other requests' transient nodes hang below is handed to the
        owner of its first child instead of being removed (that request will
        compute it).
        """
        removed = 0
        for node in sorted(self.by_owner.get(owner, ()), key=_depth, reverse=True):
            if node.parent is None or node.owner != owner:
                continue
            if node.children:
                heir = next(iter(node.children.values()))
                self.by_owner[owner].discard(node)
                node.owner = heir.owner
                node.state = heir.state
                self.by_owner.setdefault(heir.owner, set()).add(node)
            else:
                removed += len(node.key)
                delete(node)
        self.by_owner.pop(owner, None)
        return removed
