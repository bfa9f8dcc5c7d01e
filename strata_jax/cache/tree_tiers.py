"""Per-tier bookkeeping of ``HiRadixTree``: attaching copies, LRU eviction, invariants.

``TierBookkeeping`` is a mixin of ``HiRadixTree`` (``radix_tree.py``), which owns
the structure (match, insert, split, locks); this half owns what each tier holds:

* ``set_device`` / ``set_host`` attach a load's / backup's pages to a node;
  ``device_pages_of`` / ``host_only_path`` read a path's tiers;
* ``evict_device`` / ``evict_host``: LRU over that tier's unlocked leaves, found
  through the per-tier node indexes (``_device_nodes`` / ``_host_nodes``: every
  node holding pages of the tier, kept by each operation that attaches or
  drops pages), never by a walk over the whole tree (L1 holds a few dozen nodes
  while L2 holds thousands).  Ties never occur (``(last_access, node_id)`` is
  unique), so the order is the same whatever the index's iteration order;
* ``check`` asserts every invariant of the tree, the indexes and page counters
  included.

Contract for callers: ``evict_device``/``evict_host`` return page ids that the
tree no longer owns; the caller returns them to its allocator (after any
in-flight copy out of them).  Locked nodes are never evicted, so each tier
always holds a prefix of each history.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

from strata_jax.cache.tree_node import READY, TRANSIENT_STATES, TreeError, TreeNode

# Told of every change of what a tier holds: (stored, tier, node), tier "device", "host" or
# "storage", always while ``node`` hangs in the tree with its pages (a removal is reported
# before the node's pages or the node itself go).  Splits are not changes: per page,
# nothing moves.  ``strata_jax.kv_events`` turns these into KV events.
TierObserver = Callable[[bool, str, TreeNode], None]


class TierBookkeeping:
    """Mixin: tier views, per-tier eviction and ``check`` (state lives on ``HiRadixTree``)."""

    page_size: int
    version: int
    device_pages: int
    locked_device_pages: int
    host_pages: int
    _roots: dict[str, TreeNode]
    _owned: dict[Hashable, set[TreeNode]]
    _device_nodes: set[TreeNode]
    _host_nodes: set[TreeNode]
    tier_observer: TierObserver | None

    if TYPE_CHECKING:

        def iter_nodes(self) -> Iterator[TreeNode]: ...
        def _delete(self, node: TreeNode) -> None: ...

    # ------------------------------------------------------------------ tier views
    def device_pages_of(self, node: TreeNode) -> list[int]:
        """Device page ids of the path root -> ``node``, up to its first node without a device copy.

        Device copies are closed upward, so this is the device prefix of the path
        (all of it after a successful ``load``).
        """
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

    def host_only_path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes on root -> ``node`` that have a host copy but no device copy, root-first."""
        out = []
        while node.parent is not None and node.device is None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def set_device(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Attach device pages to a host-only node whose parent is on the device (a load)."""
        self.version += 1  # what a match returns may change
        if node.device is not None or node.host is None:
            raise TreeError("set_device needs a host-only node")
        if node.parent is not None and node.parent.parent is not None and node.parent.device is None:
            raise TreeError("load parents first (device copies are closed upward)")
        if len(pages) != len(node.key) // self.page_size:
            raise TreeError("wrong number of device pages")
        node.device = list(pages)
        self._device_nodes.add(node)
        self.device_pages += len(pages)
        if node.lock_ref:
            self.locked_device_pages += len(pages)
        if self.tier_observer is not None:
            self.tier_observer(True, "device", node)

    def set_host(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Attach host pages to a node with a device copy and no host copy (a backup)."""
        self.version += 1  # what a match returns may change
        if node.host is not None or node.device is None:
            raise TreeError("set_host needs a device-only node")
        if len(pages) != len(node.key) // self.page_size:
            raise TreeError("wrong number of host pages")
        node.host = list(pages)
        self._host_nodes.add(node)
        self.host_pages += len(pages)
        if self.tier_observer is not None:
            self.tier_observer(True, "host", node)

    def set_storage_backed(self, node: TreeNode, backed: bool) -> None:
        """Record that L3 holds (or no longer holds) ``node``'s pages, as far as this tree knows."""
        if node.storage_backed == backed:
            return
        if self.tier_observer is not None and not backed:
            self.tier_observer(False, "storage", node)
        node.storage_backed = backed
        if self.tier_observer is not None and backed:
            self.tier_observer(True, "storage", node)

    # ------------------------------------------------------------------ eviction
    def evict_device(
        self,
        num_pages: int,
        backup: Callable[[TreeNode], Sequence[int] | None] | None = None,
        drop_host: Callable[[list[int]], None] | None = None,
    ) -> list[int]:
        """Free at least ``num_pages`` L1 pages if possible; returns the freed page ids.

        LRU over device leaves (nodes with device pages and no child with device
        pages), skipping locked nodes.  A leaf with a host copy stays as
        host-only.  Without one, ``backup(node)`` may return host page ids holding
        (or about to hold) its data; otherwise the node is removed together with
        any transient (queued, not computed) descendants.  When host-only nodes
        hang below it too, they are removed with it and their host pages handed to
        ``drop_host`` (without ``drop_host`` such a node is kept).  With
        ``drop_host`` every unlocked device node can be freed, which is what
        ``evictable_device_pages`` counts and the scheduler plans with.
        """
        self.version += 1  # what a match returns may change
        # Children with device pages, per node: a leaf test without scanning the children
        # (a document's node has thousands of host-only question nodes below it).
        device_children = Counter(n.parent for n in self._device_nodes)
        heap = [(n.last_access, n.node_id, n) for n in self._device_nodes if n.lock_ref == 0 and not device_children[n]]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if node.device is None or node.lock_ref or node.parent is None:
                continue
            if node.host is None and backup is not None:
                pages = backup(node)
                if pages is not None:
                    self.set_host(node, pages)
            parent = node.parent
            if node.host is not None:
                freed.extend(self._clear_device(node))
                device_children[parent] -= 1
            elif drop_host is not None or self._only_transient_below(node):
                # The node goes with everything below it.  Waiting requests' queued (not
                # computed) continuations must not pin the prefix in L1: their owners
                # match less next round and insert their KV when they compute it.
                # Host-only nodes (only with ``drop_host``) would pin it for as long as
                # they stay in L2; they are no newer than it (a match through them
                # touches it), so LRU drops them with it.
                dropped_host = self._drop_descendants(node)
                if drop_host is not None:
                    drop_host(dropped_host)
                freed.extend(self._clear_device(node))
                device_children[parent] -= 1
                self._delete(node)
            else:
                continue
            if (
                parent.parent is not None
                and parent.device is not None
                and parent.lock_ref == 0
                and not device_children[parent]
            ):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def _clear_device(self, node: TreeNode) -> list[int]:
        """Detach ``node``'s device pages (the reverse of ``set_device``); returns them."""
        if self.tier_observer is not None:
            self.tier_observer(False, "device", node)
        pages, node.device = node.device, None
        self.device_pages -= len(pages)
        if node.lock_ref:  # a write-back may just have locked it for its copy
            self.locked_device_pages -= len(pages)
        self._device_nodes.discard(node)
        return pages

    def _only_transient_below(self, node: TreeNode) -> bool:
        return all(c.is_transient and self._only_transient_below(c) for c in node.children.values())

    def _drop_descendants(self, node: TreeNode) -> list[int]:
        """Remove every node below ``node`` (none holds device pages); returns their host pages."""
        host: list[int] = []
        for child in list(node.children.values()):
            host.extend(self._drop_descendants(child))
            if child.host is not None:
                if self.tier_observer is not None:
                    self.tier_observer(False, "host", child)
                host.extend(child.host)
                self.host_pages -= len(child.host)
                child.host = None
                self._host_nodes.discard(child)
            self._delete(child)
        return host

    def evictable_device_pages(self) -> int:
        """Pages ``evict_device(..., drop_host=...)`` can free now: every unlocked device node."""
        return self.device_pages - self.locked_device_pages

    def evict_host(self, num_pages: int, before_drop: Callable[[TreeNode], None] | None = None) -> list[int]:
        """Free at least ``num_pages`` L2 pages if possible; returns the freed page ids.

        LRU over host-only leaves (host copy, no device copy, no children),
        skipping locked nodes; each is removed from the tree after
        ``before_drop(node)`` (e.g. a write-back to storage) has been called.
        """
        self.version += 1  # what a match returns may change

        def candidate(n: TreeNode) -> bool:
            return (
                n.host is not None and n.device is None and n.lock_ref == 0 and not n.children and n.parent is not None
            )

        heap = [(n.last_access, n.node_id, n) for n in self._host_nodes if candidate(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not candidate(node):
                continue
            if before_drop is not None:
                before_drop(node)
            parent = node.parent
            if self.tier_observer is not None:
                self.tier_observer(False, "host", node)
            freed.extend(node.host)  # type: ignore[arg-type]
            self.host_pages -= len(node.host)  # type: ignore[arg-type]
            node.host = None
            self._host_nodes.discard(node)
            self._delete(node)
            if candidate(parent):  # type: ignore[arg-type]
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))  # type: ignore[union-attr]
        return freed

    def drop_host_copy(self, node: TreeNode) -> list[int]:
        """Forget the host copy of a node that also has a device copy; returns its host pages."""
        self.version += 1  # what a match returns may change
        if node.host is None or node.device is None:
            raise TreeError("drop_host_copy needs a node with both copies")
        if self.tier_observer is not None:
            self.tier_observer(False, "host", node)
        pages, node.host = node.host, None
        self._host_nodes.discard(node)
        self.host_pages -= len(pages)
        return pages

    # ------------------------------------------------------------------ invariants
    def check(
        self,
        device_free: Sequence[int] | None = None,
        device_total: int | None = None,
        host_free: Sequence[int] | None = None,
        host_total: int | None = None,
        device_reserved: Sequence[int] = (),
        host_reserved: Sequence[int] = (),
    ) -> None:
        """Assert every invariant; with allocator views also owned + free + reserved == total."""
        ps = self.page_size
        dev_seen: set[int] = set()
        host_seen: set[int] = set()
        owned_seen: dict[Hashable, set[TreeNode]] = {}
        for ns, root in self._roots.items():
            assert root.parent is None and root.namespace == ns and root.key == ()
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for first, child in node.children.items():
                    assert child.parent is node, "broken parent link"
                    assert child.namespace == ns, "node crossed namespaces"
                    assert child.key[:ps] == first, "child indexed under the wrong first page"
                    child_locks += child.lock_ref
                    stack.append(child)
                if node.parent is None:
                    continue
                assert len(node.key) > 0 and len(node.key) % ps == 0, "key not page-aligned"
                npg = len(node.key) // ps
                assert node.lock_ref >= child_locks >= 0, "lock_ref below its children's"
                for pages, seen in ((node.device, dev_seen), (node.host, host_seen)):
                    if pages is not None:
                        assert len(pages) == npg, "page list length differs from key"
                        for p in pages:
                            assert p not in seen, f"page {p} owned twice"
                            seen.add(p)
                if node.hashes is not None:
                    assert len(node.hashes) == npg
                parent = node.parent
                if node.is_transient:
                    assert node.state in TRANSIENT_STATES
                    assert node.device is None and node.host is None, "transient node holds data"
                    assert node.owner is not None
                    owned_seen.setdefault(node.owner, set()).add(node)
                    assert node.lock_ref == child_locks, "transient node locked directly"
                else:
                    assert node.state == READY and node.owner is None
                    assert node.has_data, "ready node without data"
                    assert parent.parent is None or not parent.is_transient, "ready node below a transient one"
                    assert parent.parent is None or parent.has_data, "data not closed upward"
                if node.device is not None:
                    assert parent.parent is None or parent.device is not None, "device tier not a prefix"
        assert len(dev_seen) == self.device_pages, "device page counter drifted"
        locked = sum(len(n.device) for n in self.iter_nodes() if n.device is not None and n.lock_ref > 0)
        assert locked == self.locked_device_pages, "locked device page counter drifted"
        assert len(host_seen) == self.host_pages, "host page counter drifted"
        assert self._device_nodes == {n for n in self.iter_nodes() if n.device is not None}, (
            "device node index out of sync"
        )
        assert self._host_nodes == {n for n in self.iter_nodes() if n.host is not None}, "host node index out of sync"
        assert owned_seen == {k: v for k, v in self._owned.items() if v}, "owner index out of sync"
        for seen, free, total, reserved in (
            (dev_seen, device_free, device_total, device_reserved),
            (host_seen, host_free, host_total, host_reserved),
        ):
            if free is None or total is None:
                continue
            free_set = set(free)
            res = set(reserved)
            assert len(free_set) == len(free), "page freed twice"
            assert not (free_set & seen) and not (res & seen) and not (free_set & res), "page both owned and free"
            assert len(free_set) + len(seen) + len(res) == total, "pages leaked"
