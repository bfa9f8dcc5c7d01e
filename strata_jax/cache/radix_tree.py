"""HiRadixTree: a page-granular radix tree over token ids, one subtree per namespace.

Pure Python bookkeeping (no jax, no arrays): the tree stores *page ids* of the
device pool (L1) and the host pool (L2) plus, lazily, the storage (L3) key of
every page.  The cache controller owns the allocators and moves the data.

Seven modules: ``tree_node.py`` (``TreeNode``, node states, ``PrefixMatch``,
``InsertResult``, ``TreeError``; re-exported here), this one (the structure: the
walk, match, insert, split, locks), ``tree_match.py`` (what a walk found:
classification, the window cut, the ``PrefixMatch``/``InsertResult`` of a walk),
``tree_transient.py`` (``TransientOwners``: each owner's transient nodes),
``tree_keys.py`` (``StorageKeys``: each page's L3 key along the hash chain),
``tree_tiers.py`` (``TierIndex``: what each tier holds; per-tier LRU eviction; lock
counts; ``check_tree``) and ``tree_window.py`` (where a match may end on a
sliding-window model: ``local_pages`` says which pages kept their local-layer KV).
The tree holds one ``StorageKeys``, one ``TierIndex`` and one ``TransientOwners``
and calls the functions of the other modules with explicit arguments.

Match and insert share one walk (``_walk``): it follows the tokens down from the
namespace's root and yields each node of the path, splitting a node where the
path ends inside it.  A match classifies the nodes it yields (device, host,
transient); an insert applies its mode's operation to each of them (device
pages: ``_adopt_device``; host pages: ``_adopt_host``; an owner: nothing) and
hangs a leaf for the rest (``_InsertMode.fill_leaf``).

Invariants (asserted by :meth:`HiRadixTree.check`):

* every key is a non-empty multiple of ``page_size``; a child is indexed by its
  first page of tokens; a namespace's root is never shared with another one;
* a ready node has a device copy, a host copy or both; a transient node has
  neither, has an owner, and only transient children;
* the device copies are closed upward (a node with device pages has a parent
  with device pages, or the root), so the device tier holds a prefix of every
  history; the data copies (device or host) are closed upward too;
* every page id appears at most once per tier; ``lock_ref`` of a node is at least
  the sum of its children's (locks walk to the root); locked nodes are never
  evicted from any tier.

Contract for callers (who must lock what before using returned page ids):

* ``match_prefix`` returns page ids that stay valid **only until the next
  eviction**.  Lock ``match.last_node`` (``lock``) before allocating anything
  (allocation may evict) and keep it locked while the pages are read; unlock it
  when the request finishes or aborts.
* ``insert`` with ``device_pages``/``host_pages`` transfers ownership of every
  page it adopts to the tree; pages it does not adopt come back in
  ``InsertResult.unused_pages`` and the caller must free them.
* ``evict_device``/``evict_host`` return page ids that the tree no longer owns;
  the caller returns them to its allocator (after any in-flight copy out of them).
* ``match_prefix(..., hint=m)``: ``m`` must be a match of the same tokens object
  (a tuple; the tree ignores any other hint), e.g. the previous round's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import NamedTuple

from strata_jax.cache import tree_match, tree_tiers
from strata_jax.cache.tree_keys import StorageKeys
from strata_jax.cache.tree_node import (
    IN_FLIGHT,
    IN_QUEUE,
    READY,
    TRANSIENT_STATES,
    InsertResult,
    PrefixMatch,
    TreeError,
    TreeNode,
)
from strata_jax.cache.tree_tiers import TierIndex, TierObserver
from strata_jax.cache.tree_transient import TransientOwners
from strata_jax.cache.tree_window import LocalPages

__all__ = [
    "IN_FLIGHT",
    "IN_QUEUE",
    "READY",
    "TRANSIENT_STATES",
    "HiRadixTree",
    "InsertResult",
    "PrefixMatch",
    "TreeError",
    "TreeNode",
]


class _InsertMode(NamedTuple):
    """One mode of ``insert``: the pages it brings and what it does to the walk's nodes."""

    pages: Sequence[int]  # one id per page from the start page (none for transient nodes)
    # At an existing node from the start page on, with its share of ``pages``: adopts them
    # or not; returns the ids not adopted.  None: the mode brings no data.
    adopt: Callable[[TreeNode, list[int]], list[int]] | None
    # At the new leaf, already hanging in the tree, with its share of ``pages``.
    fill_leaf: Callable[[TreeNode, list[int]], None]

    @property
    def brings_data(self) -> bool:
        return self.adopt is not None


class HiRadixTree:
    """Radix tree of cached prefixes across the device and host tiers.

    Not thread-safe: one owner (the engine thread / the controller) calls it.
    """

    def __init__(self, page_size: int, kv_identity: str = "") -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise TreeError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.version = 0  # bumped by every mutation that can change a match (planning memos key on it)
        # Sliding-window models: where each page's local-layer KV is; a match ends only
        # where that window is complete (tree_window).  None: every layer is global.
        self.local_pages: LocalPages | None = None
        self._keys = StorageKeys(page_size, kv_identity)
        self._tiers = TierIndex()
        self._roots: dict[str, TreeNode] = {}
        self._transient = TransientOwners()
        self._next_id = 1
        self._clock = 0

    # ------------------------------------------------------------------ tier counters
    @property
    def kv_identity(self) -> str:
        """What the KV depends on besides the tokens; seeds every chain key (``hashing.namespace_seed``)."""
        return self._keys.kv_identity

    @property
    def device_pages(self) -> int:
        """Pages of L1 owned by the tree."""
        return self._tiers.device_pages

    @property
    def locked_device_pages(self) -> int:
        """Of ``device_pages``, those in locked nodes (kept as locks move: ``evictable_device_pages`` is O(1))."""
        return self._tiers.locked_device_pages

    @property
    def host_pages(self) -> int:
        """Pages of L2 owned by the tree."""
        return self._tiers.host_pages

    @property
    def tier_observer(self) -> TierObserver | None:
        """Told of every change of what a tier holds (``tree_tiers.TierObserver``: KV events)."""
        return self._tiers.observer

    @tier_observer.setter
    def tier_observer(self, observer: TierObserver | None) -> None:
        self._tiers.observer = observer

    # ------------------------------------------------------------------ helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: tuple[int, ...], parent: TreeNode | None, namespace: str) -> TreeNode:
        node = TreeNode(key, parent, namespace, self._next_id)
        self._next_id += 1
        return node

    def root(self, namespace: str = "") -> TreeNode:
        """The root of ``namespace`` (created on first use)."""
        if not isinstance(namespace, str):
            raise TreeError(f"namespace must be a str, got {type(namespace).__name__}")
        root = self._roots.get(namespace)
        if root is None:
            root = self._new_node((), None, namespace)
            root.hashes = []
            self._roots[namespace] = root
        return root

    def namespaces(self) -> list[str]:
        return list(self._roots)

    def _key(self, tokens: Sequence[int]) -> tuple[tuple[int, ...], int]:
        """``tokens`` as a tuple (not copied when it is one) and its full-page length."""
        key = tokens if isinstance(tokens, tuple) else tuple(tokens)
        return key, len(key) - len(key) % self.page_size

    def _split(self, node: TreeNode, tokens: int) -> TreeNode:
        """Split ``node`` after ``tokens`` tokens; returns the new upper node.

        The original object keeps the lower part (so lock handles held on it stay
        valid: unlocking it walks through the new parent, which got the same
        ``lock_ref``).  Every per-page field is split at the same page.
        """
        ps = self.page_size
        pages = tokens // ps
        parent = node.parent
        assert parent is not None and 0 < tokens < len(node.key) and tokens % ps == 0
        upper = self._new_node(node.key[:tokens], parent, node.namespace)
        upper.state = node.state
        upper.owner = node.owner
        upper.lock_ref = node.lock_ref
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.storage_backed = node.storage_backed
        if node.device is not None:
            upper.device, node.device = node.device[:pages], node.device[pages:]
        if node.host is not None:
            upper.host, node.host = node.host[:pages], node.host[pages:]
        if node.hashes is not None:
            upper.hashes, node.hashes = node.hashes[:pages], node.hashes[pages:]
        self._tiers.track(upper)
        self._transient.split(node, upper)
        parent.children[node.key[:ps]] = upper
        node.key = node.key[tokens:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    def _delete(self, node: TreeNode) -> None:
        """Take a node without children out of the tree (its pages were detached first)."""
        assert node.parent is not None and not node.children
        self._tiers.set_storage_backed(node, False)  # the tree forgets it: it no longer vouches for L3's copy
        self._transient.make_ready(node)
        del node.parent.children[node.key[: self.page_size]]
        node.parent = None
        self._tiers.forget(node)

    # ------------------------------------------------------------------ the walk
    def _walk(
        self, root: TreeNode, key: tuple[int, ...], n: int, hinted: dict[int, int], split_at: int = 0
    ) -> Iterator[tuple[TreeNode, int]]:
        """Each node of the path from ``root`` along the longest prefix of ``key[:n]`` in the
        tree, with the position where its key starts.

        A node that prefix ends inside is split there, and so is a node ``split_at`` (a
        token position) falls inside: every node yielded lies entirely in the prefix,
        on one side of ``split_at``.  ``hinted`` (``_hinted_positions``): nodes known
        to match ``key`` from a position on, taken without comparing tokens.  The
        caller may change a node's pages and state before asking for the next one.
        """
        ps = self.page_size
        node, pos = root, 0
        while pos < n:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                return
            if hinted and hinted.get(id(child)) == pos:
                tokens = len(child.key)  # the hint's walk compared these tokens; unchanged since
            else:
                tokens = tree_match.shared_tokens(child.key, key, pos, n, ps)
                if tokens < len(child.key):
                    child = self._split(child, tokens)
            if pos < split_at < pos + tokens:
                child = self._split(child, split_at - pos)
            yield child, pos
            node, pos = child, pos + len(child.key)

    # ------------------------------------------------------------------ match
    def match_prefix(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        *,
        requester: Hashable | None = None,
        touch: bool = True,
        hint: PrefixMatch | InsertResult | None = None,
    ) -> PrefixMatch:
        """Longest cached (or transient) page-aligned prefix of ``tokens`` in ``namespace``.

        One walk; splits the last matched node when the match ends inside it (so
        ``last_node`` covers exactly the matched data).  With ``touch`` the path is
        marked used for LRU and every node with data counts a hit (pass
        ``touch=False`` for read-only planning queries).  The transient part stops
        at the first node owned by ``requester`` (a request never waits for
        itself).  ``storage_tokens`` is 0 here.

        With ``local_pages`` set (a model with sliding-window layers), the data part ends
        at the longest prefix whose window pages have their local-layer KV
        (``tree_window.window_match``; the node it ends in is split there), and a cut
        data part is followed by no transient tokens.

        ``hint``: an earlier match of the *same tokens object* (a tuple; anything
        else is ignored).  The walk re-checks that hint's path node by node (each
        node still hangs below the previous one with the same key length: keys
        change only by splits, which also re-parent) instead of re-comparing its
        tokens, then walks on as usual, so the result is exactly a fresh walk's.
        """
        root = self.root(namespace)
        key, n = self._key(tokens)
        hinted = tree_match.hinted_positions(hint, key, namespace, root)
        path = [node for node, _ in self._walk(root, key, n, hinted)]
        found = tree_match.classify(path, requester)
        if self.local_pages is not None and self.local_pages.window_pages > 0:
            tree_match.window_cut(path, found, self.local_pages, self.page_size, self._split)
        return tree_match.tally(namespace, root, key, path, found, self._tick() if touch else None)

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        tokens: Sequence[int],
        namespace: str = "",
        *,
        device_pages: Sequence[int] | None = None,
        host_pages: Sequence[int] | None = None,
        start_page: int = 0,
        owner: Hashable | None = None,
        hint: PrefixMatch | InsertResult | None = None,
    ) -> InsertResult:
        """Insert the full pages of ``tokens``; exactly one of three modes.

        * ``device_pages`` (computed KV, one id per full page from ``start_page``;
          ``start_page`` must be 0): nodes without a device copy adopt the ids
          (transient nodes of any owner become ready); ids of pages already on the
          device with other ids are returned unused.
        * ``host_pages`` (KV landed in L2, e.g. a prefetch; pages ``start_page..``):
          pages before ``start_page`` must already have data; nodes with no data
          adopt the ids (becoming ready host-only), others return them unused.
        * ``owner`` (no pages): every page not yet in the tree becomes an
          ``in_queue`` node owned by ``owner``; existing nodes are left alone.

        ``hint`` as for ``match_prefix`` (a match or insert of the same tokens
        object): nodes of its path that still hang where it found them are taken
        without comparing their tokens.  The result carries this walk (``walk_*``),
        so it is a hint for the next match of the same tokens.
        """
        self.version += 1  # what a match returns may change
        if (device_pages is not None) + (host_pages is not None) + (owner is not None) != 1:
            raise TreeError("insert needs exactly one of device_pages, host_pages, owner")
        if device_pages is not None:
            if start_page != 0:
                raise TreeError("device inserts cover the whole prefix (start_page must be 0)")
            mode = _InsertMode(device_pages, self._adopt_device, self._fill_device_leaf)
        elif host_pages is not None:
            mode = _InsertMode(host_pages, self._adopt_host, self._fill_host_leaf)
        else:
            mode = _InsertMode((), None, lambda leaf, _pages: self._transient.queue(leaf, owner))
        return self._insert(tokens, namespace, start_page, mode, hint)

    def _insert(
        self,
        tokens: Sequence[int],
        namespace: str,
        start_page: int,
        mode: _InsertMode,
        hint: PrefixMatch | InsertResult | None,
    ) -> InsertResult:
        """One walk along ``tokens`` applying ``mode`` from page ``start_page`` on; a new leaf
        for the pages below the walk's end."""
        key, n = self._key(tokens)
        ps = self.page_size
        npages = n // ps
        if not 0 <= start_page <= npages:
            raise TreeError(f"start_page {start_page} outside 0..{npages}")
        if mode.brings_data and len(mode.pages) != npages - start_page:
            raise TreeError(f"insert of {npages} pages from page {start_page} got {len(mode.pages)} page ids")
        start = start_page * ps
        root = self.root(namespace)
        now = self._tick()
        path: list[TreeNode] = []
        unused: list[int] = []
        end = 0  # where the walk's last node ends
        hinted = tree_match.hinted_positions(hint, key, namespace, root)
        for node, pos in self._walk(root, key, n, hinted, split_at=start):
            node.last_access = now
            path.append(node)
            end = pos + len(node.key)
            if pos < start:
                if mode.brings_data and not node.has_data:
                    raise TreeError("insert with start_page: the prefix before start_page is not cached")
            elif mode.adopt is not None:
                unused.extend(mode.adopt(node, list(mode.pages[(pos - start) // ps : (end - start) // ps])))
        parent = path[-1] if path else root
        if end == n:
            return tree_match.insert_result(namespace, key, end, unused, (), parent, path)
        if end < start:
            raise TreeError("insert with start_page: the prefix before start_page is not cached")
        assert not (mode.brings_data and parent.is_transient), "a data insert leaves no transient node on its path"
        leaf = self._new_node(key[end:n], parent, namespace)
        leaf.last_access = now
        parent.children[leaf.key[:ps]] = leaf
        mode.fill_leaf(leaf, list(mode.pages[(end - start) // ps :]))
        path.append(leaf)
        return tree_match.insert_result(namespace, key, end, unused, (leaf,), leaf, path)

    def _adopt_device(self, node: TreeNode, pages: list[int]) -> list[int]:
        """A device insert at an existing node: without a device copy it adopts ``pages`` and
        is ready; returns the ids it did not adopt (those differing from its own)."""
        if node.device is None:
            self._transient.make_ready(node)
            self._tiers.attach_device(node, pages)
            return []
        if pages == node.device:  # the usual case: a page table starts with the tree's pages
            return []
        return [p for p, q in zip(pages, node.device, strict=True) if p != q]

    def _adopt_host(self, node: TreeNode, pages: list[int]) -> list[int]:
        """A host insert at an existing node: without a host copy it adopts ``pages`` and is
        ready; returns the ids it did not adopt (those differing from its own)."""
        if node.host is None:
            assert node.device is not None or node.is_transient, "ready node without data"
            self._transient.make_ready(node)
            self._tiers.attach_host(node, pages)
            return []
        if pages == node.host:  # the usual case: a page table starts with the tree's pages
            return []
        return [p for p, q in zip(pages, node.host, strict=True) if p != q]

    def _fill_device_leaf(self, leaf: TreeNode, pages: list[int]) -> None:
        assert leaf.parent is not None and (leaf.parent.parent is None or leaf.parent.device is not None), (
            "device insert below a node without device pages"
        )
        self._tiers.attach_device(leaf, pages)

    def _fill_host_leaf(self, leaf: TreeNode, pages: list[int]) -> None:
        self._tiers.attach_host(leaf, pages)

    # ------------------------------------------------------------------ transient life cycle (tree_transient)
    def mark_in_flight(self, owner: Hashable) -> int:
        """Owner's prefill was dispatched: its ``in_queue`` nodes become ``in_flight``; returns tokens."""
        self.version += 1  # what a match returns may change
        return self._transient.mark_in_flight(owner)

    def owned_tokens(self, owner: Hashable) -> int:
        """Tokens of transient nodes still owned by ``owner``."""
        return self._transient.owned_tokens(owner)

    def remove_transient(self, owner: Hashable) -> int:
        """Abort: drop ``owner``'s transient nodes; returns tokens removed
        (``tree_transient.TransientOwners.remove``: a node with others' nodes below is handed on)."""
        self.version += 1  # what a match returns may change
        return self._transient.remove(owner, self._delete)

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and all its ancestors from eviction (counted)."""
        if node.is_transient:
            raise TreeError("lock the deepest ready node (PrefixMatch.last_node), not a transient node")
        tree_tiers.lock_path(self._tiers, node)

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``."""
        tree_tiers.unlock_path(self._tiers, node)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ tiers (tree_tiers)
    def device_pages_of(self, node: TreeNode) -> list[int]:
        """Device page ids of the path root -> ``node``, up to its first node without a device copy.

        Device copies are closed upward, so this is the device prefix of the path
        (all of it after a successful ``load``).
        """
        return tree_tiers.device_pages_of(node)

    def host_only_path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes on root -> ``node`` that have a host copy but no device copy, root-first."""
        return tree_tiers.host_only_path(node)

    def set_device(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Attach device pages to a host-only node whose parent is on the device (a load)."""
        self.version += 1  # what a match returns may change
        if node.device is not None or node.host is None:
            raise TreeError("set_device needs a host-only node")
        if node.parent is not None and node.parent.parent is not None and node.parent.device is None:
            raise TreeError("load parents first (device copies are closed upward)")
        if len(pages) != len(node.key) // self.page_size:
            raise TreeError("wrong number of device pages")
        self._tiers.attach_device(node, list(pages))

    def set_host(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Attach host pages to a node with a device copy and no host copy (a backup)."""
        self.version += 1  # what a match returns may change
        if node.host is not None or node.device is None:
            raise TreeError("set_host needs a device-only node")
        if len(pages) != len(node.key) // self.page_size:
            raise TreeError("wrong number of host pages")
        self._tiers.attach_host(node, list(pages))

    def set_storage_backed(self, node: TreeNode, backed: bool) -> None:
        """Record that L3 holds (or no longer holds) ``node``'s pages, as far as this tree knows."""
        self._tiers.set_storage_backed(node, backed)

    def drop_host_copy(self, node: TreeNode) -> list[int]:
        """Forget the host copy of a node that also has a device copy; returns its host pages."""
        self.version += 1  # what a match returns may change
        if node.host is None or node.device is None:
            raise TreeError("drop_host_copy needs a node with both copies")
        return self._tiers.detach_host(node)

    def evict_device(
        self,
        num_pages: int,
        backup: Callable[[TreeNode], Sequence[int] | None] | None = None,
        drop_host: Callable[[list[int]], None] | None = None,
        scope: Callable[[str], bool] | None = None,
    ) -> list[int]:
        """Free at least ``num_pages`` L1 pages if possible; returns the freed page ids.
        ``scope``: only nodes of the namespaces it accepts (a flush of one LoRA adapter's KV).

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
        return tree_tiers.evict_device(
            self._tiers, num_pages, backup, drop_host, set_host=self.set_host, remove=self._delete, scope=scope
        )

    def evictable_device_pages(self) -> int:
        """Pages ``evict_device(..., drop_host=...)`` can free now: every unlocked device node."""
        return self._tiers.device_pages - self._tiers.locked_device_pages

    def evict_host(
        self,
        num_pages: int,
        before_drop: Callable[[TreeNode], None] | None = None,
        scope: Callable[[str], bool] | None = None,
    ) -> list[int]:
        """Free at least ``num_pages`` L2 pages if possible; returns the freed page ids
        (``scope``: only nodes of the namespaces it accepts).

        LRU over host-only leaves (host copy, no device copy, no children),
        skipping locked nodes; each is removed from the tree after
        ``before_drop(node)`` (e.g. a write-back to storage) has been called.
        """
        self.version += 1  # what a match returns may change
        return tree_tiers.evict_host(self._tiers, num_pages, before_drop, remove=self._delete, scope=scope)

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
        tree_tiers.check_tree(
            self.page_size,
            self._roots,
            self._transient.by_owner,
            self._tiers,
            ((device_free, device_total, device_reserved), (host_free, host_total, host_reserved)),
        )

    # ------------------------------------------------------------------ storage keys (tree_keys)
    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """Storage keys of ``node``'s pages (computed lazily along the chain)."""
        return self._keys.page_hashes(node)

    def adopt_hashes(self, node: TreeNode, keys: Sequence[bytes], first_page: int) -> None:
        """Record known storage keys for pages ``first_page ..`` of the path ending at ``node``
        (``tree_keys.StorageKeys.adopt_hashes``)."""
        self._keys.adopt_hashes(node, keys, first_page)

    def last_hash(self, node: TreeNode) -> bytes:
        """Key of the last page on the path to ``node`` (the namespace seed at the root)."""
        return self._keys.last_hash(node)

    def seed(self, namespace: str) -> bytes:
        """The chain key before the first page of ``namespace``."""
        return self._keys.seed(namespace)
