"""HiRadixTree: a page-granular radix tree over token ids, one subtree per namespace.

Pure Python bookkeeping (no jax, no arrays): the tree stores *page ids* of the
device pool (L1) and the host pool (L2) plus, lazily, the storage (L3) key of
every page.  The cache controller owns the allocators and moves the data.

Node states (DESIGN §3.4):

* ``ready``: the KV of the node's tokens exists in L1 and/or L2 (``device`` /
  ``host`` page lists);
* ``in_queue``: a waiting request (``owner``) will compute these tokens; no data;
* ``in_flight``: the owner's prefill that computes them is running; no data.

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
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from strata_jax.cache.hashing import chain_hashes, namespace_seed

READY = "ready"
IN_QUEUE = "in_queue"
IN_FLIGHT = "in_flight"
TRANSIENT_STATES = (IN_QUEUE, IN_FLIGHT)


class TreeNode:
    """One edge of the radix tree: ``key`` tokens (a multiple of the page size)."""

    __slots__ = (
        "key",
        "children",
        "parent",
        "namespace",
        "device",
        "host",
        "hashes",
        "state",
        "owner",
        "lock_ref",
        "hit_count",
        "last_access",
        "storage_backed",
        "node_id",
    )

    def __init__(self, key: tuple[int, ...], parent: TreeNode | None, namespace: str, node_id: int) -> None:
        self.key = key
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.namespace = namespace
        self.device: list[int] | None = None
        self.host: list[int] | None = None
        self.hashes: list[bytes] | None = None
        self.state = READY
        self.owner: Hashable | None = None
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access = 0
        self.storage_backed = False
        self.node_id = node_id

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_transient(self) -> bool:
        return self.state != READY

    @property
    def has_data(self) -> bool:
        return self.device is not None or self.host is not None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"TreeNode(id={self.node_id}, ns={self.namespace!r}, tokens={len(self.key)}, state={self.state}, "
            f"dev={self.device is not None}, host={self.host is not None}, lock={self.lock_ref})"
        )


@dataclass(frozen=True)
class PrefixMatch:
    """Result of matching a prompt against the cache, one walk.

    All lengths are in tokens and page-aligned.  Along the prompt, in order:

    * ``device_tokens``: prefix whose KV is in L1 (usable right away);
    * ``host_tokens``: *additional* tokens right after it whose KV is in L2 only
      (needs a load L2->L1);
    * ``storage_tokens``: *additional* tokens after those found in L3 (needs a
      prefetch L3->L2 and a load); always 0 from the tree alone, filled in by
      ``CacheController.match_prefix`` with ``batch_exists``;
    * ``transient_tokens``: *additional* tokens after those that other (or the
      same) requests have queued or are computing right now (no data yet);
    * ``transient_owners``: owner ids of those transient nodes, in path order,
      without duplicates.

    ``device_page_ids`` are the L1 page ids of the ``device_tokens`` prefix (valid
    until the next eviction unless ``last_node`` is locked).  ``last_node`` is the
    deepest node with data (device or host) on the path: the handle to ``lock``.
    ``storage_keys`` are the L3 keys of the ``storage_tokens`` pages (controller).
    """

    namespace: str
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    transient_tokens: int
    transient_owners: tuple[Hashable, ...]
    device_page_ids: tuple[int, ...]
    last_node: TreeNode
    storage_keys: tuple[bytes, ...] = ()
    # The walk behind this match, for ``match_prefix(..., hint=this)`` with the same
    # tokens object: the path's nodes and their key lengths, root-first.
    walk_tokens: object = field(default=None, repr=False, compare=False)
    walk_path: tuple[TreeNode, ...] = field(default=(), repr=False, compare=False)
    walk_lens: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV exists in some tier (device + host + storage)."""
        return self.device_tokens + self.host_tokens + self.storage_tokens


@dataclass(frozen=True)
class InsertResult:
    """What ``insert`` did.

    ``existing_tokens``: tokens that were already present (any state) before the
    call; ``unused_pages``: caller page ids the tree did not adopt (the caller
    frees them); ``new_nodes``: nodes created by this call, root-first;
    ``last_node``: the node ending at the last inserted page (the namespace root
    when no full page was given).  After a device insert every node on that path
    has device pages, so it is what ``match_prefix(tokens).last_node`` returns.
    """

    existing_tokens: int
    unused_pages: tuple[int, ...]
    new_nodes: tuple[TreeNode, ...]
    last_node: TreeNode | None = None


class TreeError(ValueError):
    """Bad input to a tree operation (wrong lengths, unknown node, unbalanced unlock)."""


class HiRadixTree:
    """Radix tree of cached prefixes across the device and host tiers.

    Not thread-safe: one owner (the engine thread / the controller) calls it.
    """

    def __init__(self, page_size: int) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise TreeError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
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
        hint: PrefixMatch | None = None,
    ) -> PrefixMatch:
        """Longest cached (or transient) page-aligned prefix of ``tokens`` in ``namespace``.

        One walk; splits the last matched node when the match ends inside it (so
        ``last_node`` covers exactly the matched data).  With ``touch`` the path is
        marked used for LRU and every node with data counts a hit (pass
        ``touch=False`` for read-only planning queries).  The transient part stops
        at the first node owned by ``requester`` (a request never waits for
        itself).  ``storage_tokens`` is 0 here.

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
        if hint is not None and hint.walk_tokens is tokens and hint.namespace == namespace:
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
        now = self._tick() if touch else 0
        device = host = transient = 0
        owners: list[Hashable] = []
        device_pages: list[int] = []
        last = root
        phase = 0  # 0 device, 1 host, 2 transient
        for node in path:
            if touch:
                node.last_access = now
            ntok = len(node.key)
            if phase == 0 and node.device is not None:
                device += ntok
                device_pages.extend(node.device)
            elif phase <= 1 and node.host is not None and node.device is None:
                phase = 1
                host += ntok
            elif node.is_transient:
                if requester is not None and node.owner == requester:
                    break
                phase = 2
                transient += ntok
                if node.owner not in owners:
                    owners.append(node.owner)
                continue
            else:  # pragma: no cover - excluded by the invariants
                raise AssertionError(f"tree invariant broken on the match path at {node!r}")
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
        existing = 0
        while pos < n:
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
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
                    else:
                        unused.extend(p for p, q in zip(seg, child.device) if p != q)
                else:
                    if child.host is None and (child.device is not None or child.is_transient):
                        child.host = seg
                        self._host_nodes.add(child)
                        self.host_pages += len(seg)
                        self._make_ready(child)
                    elif child.host is None:  # pragma: no cover - a ready node has data
                        raise AssertionError("ready node without data")
                    else:
                        unused.extend(p for p, q in zip(seg, child.host) if p != q)
            existing = pos + m
            node = child
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
            new_nodes.append(leaf)
            node = leaf
        return InsertResult(existing_tokens=existing, unused_pages=tuple(unused), new_nodes=tuple(new_nodes), last_node=node)

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

    # ------------------------------------------------------------------ storage keys
    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """Storage keys of ``node``'s pages (computed lazily along the chain)."""
        chain: list[TreeNode] = []
        x = node
        while x.hashes is None:
            chain.append(x)
            x = x.parent  # type: ignore[assignment]
        prev = x.hashes[-1] if x.hashes else self._seed_of(x)
        for y in reversed(chain):
            y.hashes = chain_hashes(prev, y.key, self.page_size)
            prev = y.hashes[-1]
        return node.hashes  # type: ignore[return-value]

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
            return namespace_seed(node.namespace)
        return self.page_hashes(node)[-1]

    def _seed_of(self, node: TreeNode) -> bytes:
        while node.parent is not None:
            node = node.parent
        return namespace_seed(node.namespace)

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

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

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
        heap = [
            (n.last_access, n.node_id, n)
            for n in self._device_nodes
            if n.lock_ref == 0 and not any(c.device is not None for c in n.children.values())
        ]
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
                freed.extend(node.device)
                self.device_pages -= len(node.device)
                if node.lock_ref:  # a write-back just locked it for its copy
                    self.locked_device_pages -= len(node.device)
                node.device = None
                self._device_nodes.discard(node)
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
                freed.extend(node.device)
                self.device_pages -= len(node.device)
                if node.lock_ref:  # a write-back just locked it for its copy
                    self.locked_device_pages -= len(node.device)
                node.device = None
                self._device_nodes.discard(node)
                self._delete(node)
            else:
                continue
            if (
                parent.parent is not None
                and parent.device is not None
                and parent.lock_ref == 0
                and not any(c.device is not None for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def _only_transient_below(self, node: TreeNode) -> bool:
        return all(c.is_transient and self._only_transient_below(c) for c in node.children.values())

    def _drop_descendants(self, node: TreeNode) -> list[int]:
        """Remove every node below ``node`` (none holds device pages); returns their host pages."""
        host: list[int] = []
        for child in list(node.children.values()):
            host.extend(self._drop_descendants(child))
            if child.host is not None:
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
            return n.host is not None and n.device is None and n.lock_ref == 0 and not n.children and n.parent is not None

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
        assert self._device_nodes == {n for n in self.iter_nodes() if n.device is not None}, "device node index out of sync"
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
