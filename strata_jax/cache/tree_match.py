"""What a walk of ``HiRadixTree`` found, as plain functions over its path (pure Python, no jax).

``radix_tree.py`` walks (``HiRadixTree._walk``: follow the tokens down, split where
the path ends inside a node); this module turns a walk into its answer:

* ``shared_tokens``: how far a node's key agrees with the tokens (binary search over
  whole pages);
* ``hinted_positions``: which nodes of an earlier walk of the same tokens still hang
  where it found them (taken without comparing tokens);
* ``classify``: what a match finds at each node (device, host-only, transient);
* ``window_cut``: where a match on a sliding-window model must end (``tree_window``);
* ``tally`` / ``insert_result``: the ``PrefixMatch`` / ``InsertResult`` of a walk.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from strata_jax.cache.tree_node import InsertResult, PrefixMatch, TreeNode
from strata_jax.cache.tree_window import LocalPages, local_codes, window_match

# What a match found at each node of its path, in path order (device, then host, then transient).
ON_DEVICE = 0
HOST_ONLY = 1
TRANSIENT = 2


def shared_tokens(node_key: tuple[int, ...], key: tuple[int, ...], pos: int, n: int, page_size: int) -> int:
    """Tokens (whole pages) that ``node_key`` shares with ``key[pos:n]``; first page known equal.

    Binary search over whole pages with C-speed slice compares (a long prompt
    leaving a long node costs log(pages) compares, not one per page).
    """
    ps = page_size
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


def hinted_positions(
    hint: PrefixMatch | InsertResult | None, key: tuple[int, ...], namespace: str, root: TreeNode
) -> dict[int, int]:
    """Start position of each node of ``hint``'s walk that still hangs where the walk found it.

    A node still below the previous one with the same key length has the same
    tokens: keys change only by splits, which also re-parent.  Node ids are safe
    keys: the hint holds the nodes, so no id is reused meanwhile.
    """
    if hint is None or hint.walk_tokens is not key or hint.namespace != namespace:
        return {}
    out: dict[int, int] = {}
    node, pos = root, 0
    for child, klen in zip(hint.walk_path, hint.walk_lens, strict=True):
        if child.parent is not node or len(child.key) != klen:
            break
        out[id(child)] = pos
        pos += klen
        node = child
    return out


def classify(path: list[TreeNode], requester: Hashable | None) -> list[int]:
    """What a match finds at each node of ``path``: ``ON_DEVICE`` nodes, then ``HOST_ONLY``
    ones, then ``TRANSIENT`` ones, up to the first node owned by ``requester`` (excluded,
    and so is the rest of the path)."""
    found: list[int] = []
    phase = ON_DEVICE
    for node in path:
        if phase == ON_DEVICE and node.device is not None:
            kind = ON_DEVICE
        elif phase <= HOST_ONLY and node.host is not None and node.device is None:
            kind = HOST_ONLY
        elif node.is_transient:
            if requester is not None and node.owner == requester:
                break
            kind = TRANSIENT
        else:  # pragma: no cover - excluded by the invariants
            raise AssertionError(f"tree invariant broken on the match path at {node!r}")
        found.append(kind)
        phase = kind
    return found


def window_cut(
    path: list[TreeNode],
    found: list[int],
    local: LocalPages,
    page_size: int,
    split: Callable[[TreeNode, int], TreeNode],
) -> None:
    """Cut a match (``path`` and ``found``, in place) at the longest prefix whose local-layer
    window is complete (``tree_window``), splitting (``split(node, tokens)``) the node it ends
    in.  A cut data prefix is not followed by transient tokens: the gap is this request's to
    compute."""
    data = path[: len(found) - found.count(TRANSIENT)]
    codes, device_pages = local_codes(data, local)
    device, host = window_match(codes, device_pages, local.window_pages)
    keep = device + host
    if keep == len(codes):
        return
    pages = 0
    for i, node in enumerate(data):
        npages = len(node.key) // page_size
        if pages + npages > keep:
            end = i
            if keep > pages:
                path[i] = split(node, (keep - pages) * page_size)
                end = i + 1
            del path[end:], found[end:]
            return
        pages += npages
    raise AssertionError("window cut beyond the data prefix")  # pragma: no cover


def tally(
    namespace: str,
    root: TreeNode,
    key: tuple[int, ...],
    path: list[TreeNode],
    found: list[int],
    now: int | None,
) -> PrefixMatch:
    """The ``PrefixMatch`` of a walk (``path``) and what it found (``found``, maybe shorter).

    ``now``: the tree's clock to mark the path used (LRU) and count a hit on every node with
    data; None for a read-only query.
    """
    device = host = transient = 0
    owners: list[Hashable] = []
    device_pages: list[int] = []
    last = root
    for node, kind in zip(path, found, strict=False):  # the path may go on past the requester's nodes
        if now is not None:
            node.last_access = now
        if kind == TRANSIENT:
            transient += len(node.key)
            if node.owner not in owners:
                owners.append(node.owner)
            continue
        if kind == ON_DEVICE:
            device += len(node.key)
            assert node.device is not None
            device_pages.extend(node.device)
        else:
            host += len(node.key)
        if now is not None:
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
        walk_lens=tuple(len(node.key) for node in path),
    )


def insert_result(
    namespace: str,
    key: tuple[int, ...],
    existing: int,
    unused: list[int],
    new_nodes: tuple[TreeNode, ...],
    last: TreeNode,
    path: list[TreeNode],
) -> InsertResult:
    """The ``InsertResult`` of an insert's walk (``path``, the new leaf last if there is one)."""
    return InsertResult(
        existing_tokens=existing,
        unused_pages=tuple(unused),
        new_nodes=new_nodes,
        last_node=last,
        namespace=namespace,
        walk_tokens=key,
        walk_path=tuple(path),
        walk_lens=tuple(len(node.key) for node in path),
    )
