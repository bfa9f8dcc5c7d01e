"""Where a match may end on a sliding-window model (pure Python, no jax).

A model with sliding-window ("local") layers keeps two kinds of KV per token page:
the full-attention ("global") layers' KV, which every later token reads, and the
local layers' KV, which only the next ``window`` positions read.  The tree's page ids
(``TreeNode.device`` / ``TreeNode.host``) name a page's global KV; its local KV is an
optional attachment per tier (``LocalPages``: SGLang's hybrid SWA cache maps full-KV
slots to SWA slots the same way), so the local pages of old positions can go back to
their pool while the global pages stay.

A prefix of ``e`` pages is a usable hit only if the first new token finds every key its
local layers attend to: the local KV of the pages ``[e - w, e)``, where ``w`` =
``LocalPages.window_pages`` (``window_pages_for``).  ``window_match`` finds, on the
tiers of the pages along a match path, the longest such prefix:

* **device**: the longest ``e <= D`` (``D``: pages whose global KV is in L1) whose
  window pages have their local KV in L1 too;
* **host** (only when the device part ended at ``D``): the longest ``e`` in ``(D, D + H]``
  (``H``: host-only pages after them) whose window pages have their local KV in L1
  (pages ``< D``) or in L2 (pages ``>= D``): a load brings whole pages, so a window
  that needs the local KV of a page whose global KV is already in L1 is not a hit.

Matching stops at the last point where every layer's KV is present; the missing window
is never recomputed (a window recomputed from a later point would not be exact: its
first token attends to the window before it).  Which prefix lengths can hit: page
boundaries ``e`` with the local KV of the ``w`` pages before ``e`` kept, in practice
the ends of cached sequences and of their shared prefixes (what the controller keeps).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized
from typing import Protocol

from strata_jax.cache.tree_node import TreeNode

# Where a page's local-layer KV is, per page along a match path.
LOCAL_MISSING = 0
LOCAL_ON_HOST = 1
LOCAL_ON_DEVICE = 2


class LocalPages(Protocol):
    """Which pages of each tier have their local-layer KV (owned by the cache controller).

    ``window_pages``: pages before a match end whose local KV the next token reads
    (``window_pages_for``); ``on_device(page_id)`` / ``on_host(page_id)``: whether the
    L1 / L2 page with that (global) id has its local KV attached.
    """

    window_pages: int

    def on_device(self, page_id: int) -> bool: ...

    def on_host(self, page_id: int) -> bool: ...


def window_pages_for(window: int, page_size: int) -> int:
    """Pages a match end needs the local KV of: the token at position ``e`` (the first
    one computed after a prefix of ``e`` tokens, a page boundary) attends to positions
    ``e - window + 1 .. e - 1`` on a layer with ``window`` keys (itself included), which
    lie in the last ``ceil((window - 1) / page_size)`` pages before ``e``."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    return -(-(window - 1) // page_size)


def window_match(local: Sequence[int], device_pages: int, window_pages: int) -> tuple[int, int]:
    """``(device, host)`` pages of the longest usable prefix (module docstring).

    ``local[i]``: where page ``i`` of the path's data prefix has its local KV
    (``LOCAL_*``); the first ``device_pages`` pages have their global KV in L1, the
    rest in L2 only.  ``host`` counts pages after ``device``, and is 0 unless
    ``device == device_pages``.
    """
    if window_pages <= 0:
        raise ValueError(f"window_pages must be positive, got {window_pages}")
    total = len(local)
    if not 0 <= device_pages <= total:
        raise ValueError(f"device_pages={device_pages} outside [0, {total}]")

    def usable(i: int) -> bool:
        return local[i] == LOCAL_ON_DEVICE if i < device_pages else local[i] != LOCAL_MISSING

    # run[e]: usable pages in a row ending just before page e (run[0] = 0)
    run = [0] * (total + 1)
    for i in range(total):
        run[i + 1] = run[i] + 1 if usable(i) else 0

    def valid(e: int) -> bool:
        return run[e] >= min(window_pages, e)

    device = next(e for e in range(device_pages, -1, -1) if valid(e))  # e = 0 is always valid
    if device < device_pages:
        return device, 0
    host = next((e for e in range(total, device_pages, -1) if valid(e)), device_pages)
    return device, host - device_pages


def local_codes(nodes: Sequence[TreeNode], local: LocalPages) -> tuple[list[int], int]:
    """Where each page of a match's data prefix has its local KV (``LOCAL_*``) and how many
    of them have their global KV in L1: ``window_match``'s ``local`` and ``device_pages``.

    ``nodes``: the data part of a match path, root-first (nodes with a device copy, then
    host-only ones).  A device page counts as having its local KV on the host when the
    node's host copy of that page has it.
    """
    codes: list[int] = []
    device_pages = 0
    for node in nodes:
        if node.device is not None:
            host_ids = node.host
            for j, page in enumerate(node.device):
                if local.on_device(page):
                    codes.append(LOCAL_ON_DEVICE)
                elif host_ids is not None and local.on_host(host_ids[j]):
                    codes.append(LOCAL_ON_HOST)
                else:
                    codes.append(LOCAL_MISSING)
            device_pages = len(codes)
        else:
            assert node.host is not None, "a data node without data"
            codes.extend(LOCAL_ON_HOST if local.on_host(page) else LOCAL_MISSING for page in node.host)
    return codes, device_pages


def host_window_pages(nodes: Iterable[TreeNodeLike], pages: int) -> set[int]:
    """Host pages inside the last ``pages`` pages before a point where a match can end: a
    leaf or a branch point (a node with no child or with several).  L2 keeps their local
    KV first (``GroupedHostPool.attach_local``).  The window runs up the path into the
    parents' host pages; it stops at a page with no host copy."""
    keep: set[int] = set()
    for node in nodes:
        if node.host is None or len(node.children) == 1:
            continue
        need = pages
        x: TreeNodeLike | None = node
        while x is not None and need > 0:
            host = x.host
            if host is None:
                break
            keep.update(host[-need:])
            need -= len(host)
            x = x.parent
    return keep


class TreeNodeLike(Protocol):
    """What ``host_window_pages`` reads of a node (``TreeNode`` has it)."""

    @property
    def host(self) -> list[int] | None: ...

    @property
    def children(self) -> Sized: ...

    @property
    def parent(self) -> TreeNodeLike | None: ...
