"""What each tier of ``HiRadixTree`` holds: tier indexes, LRU eviction, invariants.

``radix_tree.py`` owns the structure (match, insert, split, locks); this module
owns what each tier holds, as a helper object and plain functions the tree calls
with explicit arguments:

* ``TierIndex`` (one per tree): every node holding pages of each tier
  (``device_nodes`` / ``host_nodes``), the page counters, and the
  ``TierObserver`` told of every change; ``attach_*`` / ``detach_*`` are the only
  ways pages come and go;
* ``device_pages_of`` / ``host_only_path`` read a path's tiers;
* ``evict_device`` / ``evict_host``: LRU over that tier's unlocked leaves, found
  through the tier's node index, never by a walk over the whole tree (L1 holds a
  few dozen nodes while L2 holds thousands).  Ties never occur
  (``(last_access, node_id)`` is unique), so the order is the same whatever the
  index's iteration order;
* ``check_tree`` asserts every invariant of the tree, the indexes and page
  counters included.

Contract for callers: ``evict_device``/``evict_host`` return page ids that the
tree no longer owns; the caller returns them to its allocator (after any
in-flight copy out of them).  Locked nodes are never evicted, so each tier
always holds a prefix of each history.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from strata_jax.cache.tree_node import READY, TRANSIENT_STATES, TreeError, TreeNode

# Told of every change of what a tier holds: (stored, tier, node), tier "device", "host" or
# "storage", always while ``node`` hangs in the tree with its pages (a removal is reported
# before the node's pages or the node itself go).  Splits are not changes: per page,
# nothing moves.  ``strata_jax.kv_events`` turns these into KV events.
TierObserver = Callable[[bool, str, TreeNode], None]

# Removes a node without children and without pages from the tree (``HiRadixTree``).
RemoveNode = Callable[[TreeNode], None]

# An allocator's view of one tier for ``check_tree``: (free ids, pool size, reserved ids).
AllocatorView = tuple[Sequence[int] | None, int | None, Sequence[int]]


class TierIndex:
    """The nodes and page counts of each tier; reports every change to ``observer``."""

    def __init__(self) -> None:
        self.device_nodes: set[TreeNode] = set()
        self.host_nodes: set[TreeNode] = set()
        self.device_pages = 0  # pages of L1 owned by the tree
        self.locked_device_pages = 0  # of which in locked nodes (kept as locks move: evictable is O(1))
        self.host_pages = 0  # pages of L2 owned by the tree
        self.observer: TierObserver | None = None

    def _notify(self, stored: bool, tier: str, node: TreeNode) -> None:
        if self.observer is not None:
            self.observer(stored, tier, node)

    def attach_device(self, node: TreeNode, pages: list[int]) -> None:
        """Give ``node`` (without a device copy) the device pages ``pages``."""
        node.device = pages
        self.device_nodes.add(node)
        self.device_pages += len(pages)
        if node.lock_ref:
            self.locked_device_pages += len(pages)
        self._notify(True, "device", node)

    def detach_device(self, node: TreeNode) -> list[int]:
        """Take ``node``'s device pages away; returns them."""
        pages = node.device
        assert pages is not None, "detach_device of a node without a device copy"
        self._notify(False, "device", node)
        node.device = None
        self.device_pages -= len(pages)
        if node.lock_ref:  # a write-back may just have locked it for its copy
            self.locked_device_pages -= len(pages)
        self.device_nodes.discard(node)
        return pages

    def attach_host(self, node: TreeNode, pages: list[int]) -> None:
        """Give ``node`` (without a host copy) the host pages ``pages``."""
        node.host = pages
        self.host_nodes.add(node)
        self.host_pages += len(pages)
        self._notify(True, "host", node)

    def detach_host(self, node: TreeNode) -> list[int]:
        """Take ``node``'s host pages away; returns them."""
        pages = node.host
        assert pages is not None, "detach_host of a node without a host copy"
        self._notify(False, "host", node)
        node.host = None
        self.host_nodes.discard(node)
        self.host_pages -= len(pages)
        return pages

    def lock_changed(self, node: TreeNode, locked: bool) -> None:
        """``node``'s ``lock_ref`` just became 1 (``locked``) or 0."""
        if node.device is not None:
            self.locked_device_pages += len(node.device) if locked else -len(node.device)

    def track(self, node: TreeNode) -> None:
        """Index a node that got its pages by a split (no pages moved: nothing to report)."""
        if node.device is not None:
            self.device_nodes.add(node)
        if node.host is not None:
            self.host_nodes.add(node)

    def forget(self, node: TreeNode) -> None:
        """Drop a node leaving the tree from the indexes (its pages were detached first)."""
        self.device_nodes.discard(node)
        self.host_nodes.discard(node)

    def set_storage_backed(self, node: TreeNode, backed: bool) -> None:
        """Record that L3 holds (or no longer holds) ``node``'s pages, as far as the tree knows."""
        if node.storage_backed == backed:
            return
        if not backed:
            self._notify(False, "storage", node)
        node.storage_backed = backed
        if backed:
            self._notify(True, "storage", node)


# ---------------------------------------------------------------------- tier views
def lock_path(tiers: TierIndex, node: TreeNode) -> None:
    """Count one lock on ``node`` and every ancestor below the root (locked nodes are never evicted)."""
    while node.parent is not None:
        node.lock_ref += 1
        if node.lock_ref == 1:
            tiers.lock_changed(node, True)
        node = node.parent


def unlock_path(tiers: TierIndex, node: TreeNode) -> None:
    """Undo one ``lock_path(tiers, node)``; raises ``TreeError`` (changing nothing) without one."""
    x = node
    while x.parent is not None:
        if x.lock_ref <= 0:
            raise TreeError(f"unlock without lock on {x!r}")
        x = x.parent
    while node.parent is not None:
        node.lock_ref -= 1
        if node.lock_ref == 0:
            tiers.lock_changed(node, False)
        node = node.parent


def device_pages_of(node: TreeNode) -> list[int]:
    """Device page ids of the path root -> ``node``, up to its first node without a device copy."""
    parts: list[list[int] | None] = []
    while node.parent is not None:
        parts.append(node.device)
        node = node.parent
    out: list[int] = []
    for p in reversed(parts):
        if p is None:
            break
        out.extend(p)
    return out


def host_only_path(node: TreeNode) -> list[TreeNode]:
    """Nodes on root -> ``node`` that have a host copy but no device copy, root-first."""
    out = []
    while node.parent is not None and node.device is None:
        out.append(node)
        node = node.parent
    return out[::-1]


# ---------------------------------------------------------------------- eviction
def evict_device(
    tiers: TierIndex,
    num_pages: int,
    backup: Callable[[TreeNode], Sequence[int] | None] | None,
    drop_host: Callable[[list[int]], None] | None,
    *,
    set_host: Callable[[TreeNode, Sequence[int]], None],
    remove: RemoveNode,
    scope: Callable[[str], bool] | None = None,
) -> list[int]:
    """``HiRadixTree.evict_device`` (its docstring), over ``tiers``.

    ``set_host`` attaches the pages a ``backup`` returns; ``remove`` takes a node
    out of the tree; ``scope``: only nodes of the namespaces it accepts are evicted
    (a node's parent is of its namespace, so the walk up stays inside).
    """
    # Children with device pages, per node: a leaf test without scanning the children
    # (a document's node has thousands of host-only question nodes below it).
    device_children = Counter(n.parent for n in tiers.device_nodes)
    heap = [
        (n.last_access, n.node_id, n)
        for n in tiers.device_nodes
        if n.lock_ref == 0 and not device_children[n] and (scope is None or scope(n.namespace))
    ]
    heapq.heapify(heap)
    freed: list[int] = []
    while len(freed) < num_pages and heap:
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        if node.device is None or node.lock_ref or parent is None:
            continue
        if node.host is None and backup is not None:
            pages = backup(node)
            if pages is not None:
                set_host(node, pages)
        if node.host is not None:
            freed.extend(tiers.detach_device(node))
        elif drop_host is not None or _only_transient_below(node):
            # The node goes with everything below it.  Waiting requests' queued (not
            # computed) continuations must not pin the prefix in L1: their owners
            # match less next round and insert their KV when they compute it.
            # Host-only nodes (only with ``drop_host``) would pin it for as long as
            # they stay in L2; they are no newer than it (a match through them
            # touches it), so LRU drops them with it.
            dropped_host = _drop_descendants(tiers, node, remove)
            if drop_host is not None:
                drop_host(dropped_host)
            freed.extend(tiers.detach_device(node))
            remove(node)
        else:
            continue
        device_children[parent] -= 1
        if parent.parent is not None and parent.device is not None and parent.lock_ref == 0:
            if not device_children[parent]:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
    return freed


def _only_transient_below(node: TreeNode) -> bool:
    return all(c.is_transient and _only_transient_below(c) for c in node.children.values())


def _drop_descendants(tiers: TierIndex, node: TreeNode, remove: RemoveNode) -> list[int]:
    """Remove every node below ``node`` (none holds device pages); returns their host pages."""
    host: list[int] = []
    for child in list(node.children.values()):
        host.extend(_drop_descendants(tiers, child, remove))
        if child.host is not None:
            host.extend(tiers.detach_host(child))
        remove(child)
    return host


def _host_leaf(node: TreeNode) -> bool:
    """Whether ``evict_host`` may drop ``node``: an unlocked host-only leaf."""
    return node.host is not None and node.device is None and node.lock_ref == 0 and not node.children


def evict_host(
    tiers: TierIndex,
    num_pages: int,
    before_drop: Callable[[TreeNode], None] | None,
    *,
    remove: RemoveNode,
    scope: Callable[[str], bool] | None = None,
) -> list[int]:
    """``HiRadixTree.evict_host`` (its docstring), over ``tiers``; ``remove`` takes a node out of
    the tree; ``scope`` as ``evict_device``'s."""
    heap = [
        (n.last_access, n.node_id, n)
        for n in tiers.host_nodes
        if n.parent is not None and _host_leaf(n) and (scope is None or scope(n.namespace))
    ]
    heapq.heapify(heap)
    freed: list[int] = []
    while len(freed) < num_pages and heap:
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        if parent is None or not _host_leaf(node):
            continue
        if before_drop is not None:
            before_drop(node)
        freed.extend(tiers.detach_host(node))
        remove(node)
        if parent.parent is not None and _host_leaf(parent):
            heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
    return freed


# ---------------------------------------------------------------------- invariants
def check_tree(
    page_size: int,
    roots: dict[str, TreeNode],
    owned: dict[Hashable, set[TreeNode]],
    tiers: TierIndex,
    allocators: tuple[AllocatorView, AllocatorView],
) -> None:
    """Assert every invariant (``HiRadixTree.check``).

    ``allocators``: the device's and the host's view; where ``free`` and ``total``
    are given, owned + free + reserved == total.
    """
    dev_seen: set[int] = set()
    host_seen: set[int] = set()
    owned_seen: dict[Hashable, set[TreeNode]] = {}
    nodes: list[TreeNode] = []
    for ns, root in roots.items():
        assert root.parent is None and root.namespace == ns and root.key == ()
        stack = [root]
        while stack:
            node = stack.pop()
            _check_children(node, page_size)
            stack.extend(node.children.values())
            if node.parent is not None:
                _check_node(node, page_size, dev_seen, host_seen, owned_seen)
                nodes.append(node)
    assert len(dev_seen) == tiers.device_pages, "device page counter drifted"
    locked = sum(len(n.device) for n in nodes if n.device is not None and n.lock_ref > 0)
    assert locked == tiers.locked_device_pages, "locked device page counter drifted"
    assert len(host_seen) == tiers.host_pages, "host page counter drifted"
    assert tiers.device_nodes == {n for n in nodes if n.device is not None}, "device node index out of sync"
    assert tiers.host_nodes == {n for n in nodes if n.host is not None}, "host node index out of sync"
    assert owned_seen == {k: v for k, v in owned.items() if v}, "owner index out of sync"
    for seen, (free, total, reserved) in zip((dev_seen, host_seen), allocators, strict=True):
        if free is None or total is None:
            continue
        free_set = set(free)
        res = set(reserved)
        assert len(free_set) == len(free), "page freed twice"
        assert not (free_set & seen) and not (res & seen) and not (free_set & res), "page both owned and free"
        assert len(free_set) + len(seen) + len(res) == total, "pages leaked"


def _check_children(node: TreeNode, page_size: int) -> None:
    child_locks = 0
    for first, child in node.children.items():
        assert child.parent is node, "broken parent link"
        assert child.namespace == node.namespace, "node crossed namespaces"
        assert child.key[:page_size] == first, "child indexed under the wrong first page"
        child_locks += child.lock_ref
    if node.parent is not None:
        assert node.lock_ref >= child_locks >= 0, "lock_ref below its children's"
        if node.is_transient:
            assert node.lock_ref == child_locks, "transient node locked directly"


def _check_node(
    node: TreeNode,
    page_size: int,
    dev_seen: set[int],
    host_seen: set[int],
    owned_seen: dict[Hashable, set[TreeNode]],
) -> None:
    """One non-root node's invariants; collects its pages and, if transient, its owner."""
    parent = node.parent
    assert parent is not None
    assert len(node.key) > 0 and len(node.key) % page_size == 0, "key not page-aligned"
    npg = len(node.key) // page_size
    for pages, seen in ((node.device, dev_seen), (node.host, host_seen)):
        if pages is not None:
            assert len(pages) == npg, "page list length differs from key"
            for p in pages:
                assert p not in seen, f"page {p} owned twice"
                seen.add(p)
    if node.hashes is not None:
        assert len(node.hashes) == npg
    if node.is_transient:
        assert node.state in TRANSIENT_STATES
        assert node.device is None and node.host is None, "transient node holds data"
        assert node.owner is not None
        owned_seen.setdefault(node.owner, set()).add(node)
    else:
        assert node.state == READY and node.owner is None
        assert node.has_data, "ready node without data"
        assert parent.parent is None or not parent.is_transient, "ready node below a transient one"
        assert parent.parent is None or parent.has_data, "data not closed upward"
    if node.device is not None:
        assert parent.parent is None or parent.device is not None, "device tier not a prefix"
