"""HiRadixTree: a page-granular radix tree over token ids, one subtree per namespace.

Pure Python bookkeeping (no jax, no arrays): the tree stores *page ids* of the
device pool (L1) and the host pool (L2) plus, lazily, the storage (L3) key of
every page.  The cache controller owns the allocators and moves the data.

Five modules: ``tree_node.py`` (``TreeNode``, node states, ``PrefixMatch``,
``InsertResult``, ``TreeError``; re-exported here), this one (the structure:
match, insert, split, transient life cycle, locks), ``tree_keys.py`` (the
``StorageKeys`` mixin: each page's L3 key along the hash chain),
``tree_tiers.py`` (the ``TierBookkeeping`` mixin: what each tier holds, per-tier
LRU eviction, ``check``) and ``tree_window.py`` (where a match may end on a
sliding-window model: ``local_pages`` says which pages kept their local-layer KV).

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

from collections.abc import Hashable, Iterator, Sequence

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
from strata_jax.cache.tree_tiers import TierBookkeeping, TierObserver
from strata_jax.cache.tree_window import LOCAL_MISSING, LOCAL_ON_DEVICE, LOCAL_ON_HOST, LocalPages, window_match

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


class HiRadixTree(TierBookkeeping, StorageKeys):
    """Radix tree of cached prefixes across the device and host tiers.

    Not thread-safe: one owner (the engine thread / the controller) calls it.
    """

    def __init__(self, page_size: int, kv_identity: str = "") -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise TreeError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.kv_identity = kv_identity  # seeds every chain key (hashing.namespace_seed)
        self._roots: dict[str, TreeNode] = {}
        self._owned: dict[Hashable, set[TreeNode]] = {}
        self._next_id = 1
        self._clock = 0
        self.device_pages = 0  # pages of L1 owned by the tree
        self.version = 0  # bumped by every mutation that can change a match (planning memos key on it)
        self.locked_device_pages = 0  # of which in locked nodes (kept as locks move: evictable is O(1))
        self.host_pages = 0  # pages of L2 owned by the tree
        # Nodes holding pages of each tier (eviction scans these, not the whole tree:
        # L1 holds a few dozen nodes while L2 holds thousands).
        self._device_nodes: set[TreeNode] = set()
        self._host_nodes: set[TreeNode] = set()
        self.tier_observer: TierObserver | None = None  # tree_tiers.TierObserver (KV events)
        # Sliding-window models: where each page's local-layer KV is; a match ends only
        # where that window is complete (tree_window).  None: every layer is global.
        self.local_pages: LocalPages | None = None

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

    def _common_pages(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int, n: int) -> int:
        """Tokens (page-aligned) that ``node_key`` shares with ``key[pos:n]``; first page known equal.

        Binary search over whole pages with C-speed slice compares (a long prompt
        leaving a long node costs log(pages) compares, not one per page).
        """
        ps = self.page_size
        limit = min(len(node_key), n - pos)
        limit -= limit % ps
        if key[pos : pos + limit] == node_key[:limit]:
            return limit
        lo, hi = ps, limit  # pages [0, lo) equal, [0, hi) not
        while hi - lo > ps:
            mid = lo + (hi - lo) // ps // 2 * ps
            if key[pos + lo : pos + mid] == node_key[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo

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
            self._device_nodes.add(upper)
        if node.host is not None:
            upper.host, node.host = node.host[:pages], node.host[pages:]
            self._host_nodes.add(upper)
        if node.hashes is not None:
            upper.hashes, node.hashes = node.hashes[:pages], node.hashes[pages:]
        if node.owner is not None and node.is_transient:
            self._owned[node.owner].add(upper)
        parent.children[node.key[:ps]] = upper
        node.key = node.key[tokens:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    def _make_ready(self, node: TreeNode) -> None:
        if node.is_transient:
            owned = self._owned.get(node.owner)
            if owned is not None:
                owned.discard(node)
                if not owned:
                    del self._owned[node.owner]
            node.state = READY
            node.owner = None

    def _delete(self, node: TreeNode) -> None:
        assert node.parent is not None and not node.children
        if node.storage_backed:  # the tree forgets it: it no longer vouches for L3's copy
            self.set_storage_backed(node, False)
        if node.is_transient:
            self._make_ready(node)
        del node.parent.children[node.key[: self.page_size]]
        node.parent = None
        self._device_nodes.discard(node)  # (callers clear its pages first; a detached node is indexed nowhere)
        self._host_nodes.discard(node)

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
        ps = self.page_size
        path: list[TreeNode] = []
        lens: list[int] = []
        node = root
        pos = 0
        if hint is not None and hint.walk_tokens is key and hint.namespace == namespace:
            for child, klen in zip(hint.walk_path, hint.walk_lens):
                if child.parent is not node or len(child.key) != klen:
                    break
                path.append(child)
                lens.append(klen)
                pos += klen
                node = child
        children = node.children
        while pos < n:
            child = children.get(key[pos : pos + ps])
            if child is None:
                break
            klen = len(child.key)
            if pos + klen <= n and key[pos : pos + klen] == child.key:
                pos += klen
            else:
                klen = self._common_pages(child.key, key, pos, n)
                child = self._split(child, klen)
                pos += klen
            path.append(child)
            lens.append(klen)
            children = child.children
        kinds: list[int] = []  # per path node: 0 device, 1 host, 2 transient (the walk's tiers, in order)
        phase = 0
        for node in path:
            if phase == 0 and node.device is not None:
                kind = 0
            elif phase <= 1 and node.host is not None and node.device is None:
                kind = 1
            elif node.is_transient:
                if requester is not None and node.owner == requester:
                    break
                kind = 2
            else:  # pragma: no cover - excluded by the invariants
                raise AssertionError(f"tree invariant broken on the match path at {node!r}")
            kinds.append(kind)
            phase = kind
        if self.local_pages is not None and self.local_pages.window_pages > 0:
            self._stop_at_complete_window(path, lens, kinds)
        now = self._tick() if touch else 0
        device = host = transient = 0
        owners: list[Hashable] = []
        device_pages: list[int] = []
        last = root
        for node, kind in zip(path, kinds):
            if touch:
                node.last_access = now
            ntok = len(node.key)
            if kind == 0:
                device += ntok
                device_pages.extend(node.device)  # type: ignore[arg-type]
            elif kind == 1:
                host += ntok
            else:
                transient += ntok
                if node.owner not in owners:
                    owners.append(node.owner)
                continue
            if touch:
                node.hit_count += 1
            last = node
        return PrefixMatch(
            namespace=namespace,
            device_tokens=device,
            host_tokens=host,
            storage_tokens=0,
            transient_tokens=transient,
            transient_owners=tuple(owners),
            device_page_ids=tuple(device_pages),
            last_node=last,
            walk_tokens=key,
            walk_path=tuple(path),
            walk_lens=tuple(lens),
        )

    def _stop_at_complete_window(self, path: list[TreeNode], lens: list[int], kinds: list[int]) -> None:
        """Cut the walk (``path``, ``lens``, ``kinds``, in place) at the longest prefix whose
        local-layer window is complete (``tree_window``), splitting the node it ends in.
        A cut data prefix is not followed by transient tokens: the gap is this request's
        to compute."""
        local = self.local_pages
        assert local is not None
        codes: list[int] = []
        device_pages = 0
        data_nodes = 0
        for node, kind in zip(path, kinds):
            if kind == 2:
                break
            data_nodes += 1
            if kind == 0:
                host_ids = node.host
                for j, page in enumerate(node.device):  # type: ignore[arg-type]
                    if local.on_device(page):
                        codes.append(LOCAL_ON_DEVICE)
                    else:
                        codes.append(
                            LOCAL_ON_HOST if host_ids is not None and local.on_host(host_ids[j]) else LOCAL_MISSING
                        )
                device_pages = len(codes)
            else:
                codes.extend(LOCAL_ON_HOST if local.on_host(page) else LOCAL_MISSING for page in node.host)  # type: ignore[union-attr]
        dev, host = window_match(codes, device_pages, local.window_pages)
        keep = dev + host
        if keep == len(codes):
            return
        ps = self.page_size
        pages = 0
        for i in range(data_nodes):
            npages = lens[i] // ps
            if pages + npages > keep:
                cut = keep - pages
                if cut > 0:
                    path[i] = self._split(path[i], cut * ps)
                    lens[i] = cut * ps
                    i += 1
                del path[i:], lens[i:], kinds[i:]
                return
            pages += npages
        raise AssertionError("window cut beyond the data prefix")  # pragma: no cover

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
        modes = (device_pages is not None) + (host_pages is not None) + (owner is not None)
        if modes != 1:
            raise TreeError("insert needs exactly one of device_pages, host_pages, owner")
        key, n = self._key(tokens)
        ps = self.page_size
        npages = n // ps
        given = device_pages if device_pages is not None else host_pages
        if device_pages is not None and start_page != 0:
            raise TreeError("device inserts cover the whole prefix (start_page must be 0)")
        if not 0 <= start_page <= npages:
            raise TreeError(f"start_page {start_page} outside 0..{npages}")
        if given is not None and len(given) != npages - start_page:
            raise TreeError(f"insert of {npages} pages from page {start_page} got {len(given)} page ids")
        start_tok = start_page * ps
        root = self.root(namespace)
        now = self._tick()
        node = root
        pos = 0
        unused: list[int] = []
        new_nodes: list[TreeNode] = []
        path: list[TreeNode] = []
        existing = 0
        trusted = self._hinted_positions(hint, key, namespace, root)  # id(node) -> where its key starts
        while pos < n:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            if trusted and trusted.get(id(child)) == pos:
                m = len(child.key)  # the hint's walk compared these tokens; unchanged since
            else:
                m = self._common_pages(child.key, key, pos, n)
            if m < len(child.key):
                child = self._split(child, m)
            if pos < start_tok < pos + m:
                child = self._split(child, start_tok - pos)
                m = start_tok - pos
            child.last_access = now
            if pos < start_tok:
                if given is not None and not child.has_data:
                    raise TreeError("insert with start_page: the prefix before start_page is not cached")
            elif given is not None:
                seg = list(given[(pos - start_tok) // ps : (pos + m - start_tok) // ps])
                if device_pages is not None:
                    if child.device is None:
                        child.device = seg
                        self._device_nodes.add(child)
                        self.device_pages += len(seg)
                        if child.lock_ref:
                            self.locked_device_pages += len(seg)
                        self._make_ready(child)
                        if self.tier_observer is not None:
                            self.tier_observer(True, "device", child)
                    else:
                        if seg != child.device:  # (usually equal: a page table starts with the tree's pages)
                            unused.extend(p for p, q in zip(seg, child.device) if p != q)
                else:
                    if child.host is None and (child.device is not None or child.is_transient):
                        child.host = seg
                        self._host_nodes.add(child)
                        self.host_pages += len(seg)
                        self._make_ready(child)
                        if self.tier_observer is not None:
                            self.tier_observer(True, "host", child)
                    elif child.host is None:  # pragma: no cover - a ready node has data
                        raise AssertionError("ready node without data")
                    else:
                        if seg != child.host:  # (usually equal: a page table starts with the tree's pages)
                            unused.extend(p for p, q in zip(seg, child.host) if p != q)
            existing = pos + m
            node = child
            path.append(child)
            pos += m
        if pos < n:
            if pos < start_tok:
                raise TreeError("insert with start_page: the prefix before start_page is not cached")
            if given is not None and node.is_transient:
                raise TreeError("cannot insert data below a transient node; insert its prefix first")
            leaf = self._new_node(key[pos:n], node, namespace)
            leaf.last_access = now
            seg = list(given[(pos - start_tok) // ps :]) if given is not None else None
            if device_pages is not None:
                if node is not root and node.device is None:
                    raise TreeError("device insert below a node without device pages")
                leaf.device = seg
                self._device_nodes.add(leaf)
                self.device_pages += len(seg)
                if leaf.lock_ref:
                    self.locked_device_pages += len(seg)
            elif host_pages is not None:
                leaf.host = seg
                self._host_nodes.add(leaf)
                self.host_pages += len(seg)
            else:
                leaf.state = IN_QUEUE
                leaf.owner = owner
                self._owned.setdefault(owner, set()).add(leaf)
            node.children[leaf.key[:ps]] = leaf
            if self.tier_observer is not None and given is not None:
                self.tier_observer(True, "device" if device_pages is not None else "host", leaf)
            new_nodes.append(leaf)
            path.append(leaf)
            node = leaf
        return InsertResult(
            existing_tokens=existing,
            unused_pages=tuple(unused),
            new_nodes=tuple(new_nodes),
            last_node=node,
            namespace=namespace,
            walk_tokens=key,
            walk_path=tuple(path),
            walk_lens=tuple(len(x.key) for x in path),
        )

    @staticmethod
    def _hinted_positions(
        hint: PrefixMatch | InsertResult | None, key: tuple[int, ...], namespace: str, root: TreeNode
    ) -> dict[int, int]:
        """Start position of each node of ``hint``'s walk that still hangs where the walk found it.

        Node ids are safe keys: the hint holds the nodes, so no id is reused meanwhile.
        """
        if hint is None or hint.walk_tokens is not key or hint.namespace != namespace:
            return {}
        out: dict[int, int] = {}
        node, pos = root, 0
        for child, klen in zip(hint.walk_path, hint.walk_lens):
            if child.parent is not node or len(child.key) != klen:
                break
            out[id(child)] = pos
            pos += klen
            node = child
        return out

    # ------------------------------------------------------------------ transient life cycle
    def mark_in_flight(self, owner: Hashable) -> int:
        """Owner's prefill was dispatched: its ``in_queue`` nodes become ``in_flight``; returns tokens."""
        self.version += 1  # what a match returns may change
        total = 0
        for node in self._owned.get(owner, ()):
            node.state = IN_FLIGHT
            total += len(node.key)
        return total

    def owned_tokens(self, owner: Hashable) -> int:
        """Tokens of transient nodes still owned by ``owner``."""
        return sum(len(n.key) for n in self._owned.get(owner, ()))

    def remove_transient(self, owner: Hashable) -> int:
        """Abort: drop ``owner``'s transient nodes; returns tokens removed.

        A node that other requests' transient nodes hang below is handed to the
        owner of its first child instead of being removed (that request will
        compute it).
        """
        self.version += 1  # what a match returns may change
        removed = 0
        nodes = sorted(self._owned.get(owner, ()), key=self._depth, reverse=True)
        for node in nodes:
            if node.parent is None or node.owner != owner:
                continue
            if node.children:
                heir = next(iter(node.children.values()))
                self._owned[owner].discard(node)
                node.owner = heir.owner
                node.state = heir.state
                self._owned.setdefault(heir.owner, set()).add(node)
            else:
                removed += len(node.key)
                self._delete(node)
        self._owned.pop(owner, None)
        return removed

    @staticmethod
    def _depth(node: TreeNode) -> int:
        d = 0
        while node.parent is not None:
            node = node.parent
            d += 1
        return d

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and all its ancestors from eviction (counted)."""
        if node.is_transient:
            raise TreeError("lock the deepest ready node (PrefixMatch.last_node), not a transient node")
        while node.parent is not None:
            node.lock_ref += 1
            if node.lock_ref == 1 and node.device is not None:
                self.locked_device_pages += len(node.device)
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``."""
        x = node
        while x.parent is not None:
            if x.lock_ref <= 0:
                raise TreeError(f"unlock without lock on {x!r}")
            x = x.parent
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device is not None:
                self.locked_device_pages -= len(node.device)
            node = node.parent

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())
