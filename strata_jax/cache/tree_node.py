"""Tree nodes and what the tree's operations return (pure Python, no jax).

Node states (docs/design.md §3.4):

* ``ready``: the KV of the node's tokens exists in L1 and/or L2 (``device`` /
  ``host`` page lists);
* ``in_queue``: a waiting request (``owner``) will compute these tokens; no data;
* ``in_flight``: the owner's prefill that computes them is running; no data.

A ``TreeNode`` is one edge of ``HiRadixTree`` (``radix_tree.py``), mutated only
by the tree.  ``PrefixMatch`` and ``InsertResult`` are frozen snapshots: their
page ids stay valid only as the tree's contract says (lock ``last_node``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

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
    namespace: str = ""
    # The insert's walk (as ``PrefixMatch.walk_*``): a hint for the next match of the same tokens.
    walk_tokens: object = field(default=None, repr=False, compare=False)
    walk_path: tuple[TreeNode, ...] = field(default=(), repr=False, compare=False)
    walk_lens: tuple[int, ...] = field(default=(), repr=False, compare=False)


class TreeError(ValueError):
    """Bad input to a tree operation (wrong lengths, unknown node, unbalanced unlock)."""
