"""Local-layer pages of a sliding-window model, attached to global page ids (pure Python, no jax).

The bookkeeping half of layer groups (docs/models.md, "Layer groups"): per
tier, a ``LocalPageMap`` owns that tier's local-layer pool (its own page ids and free
list) and the map from a global page id (what the tree and the page tables hold) to the
local page holding the same tokens' local-layer KV.  ``TieredLocalPages`` is the
``tree_window.LocalPages`` the tree reads.  ``first_needed_page`` is the rule a running
request trims by: the local KV of pages before it is never read again.

``DeviceLocalPages`` is the L1 map of a pool with layer groups (``--kv-layer-groups``):
a global page gets a local page when its local KV will be written or read, running
requests pin the pages of their windows, and the rest are trimmed lazily (evicted, least
recently unpinned first, when a local page is wanted and none is free).  The map is an
int32 array the model step reads (a local layer's page table is the map applied to the
request's).  ``TreeLocalPages`` is what the tree's matches read: the L1 map and one flag
per L2 page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from strata_jax.cache.tree_window import window_pages_for

NO_LOCAL_PAGE = -1


class LocalPageMap:
    """One tier's local-layer pages: ``num_pages`` of them, each attached to one global page id."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._local_of: dict[int, int] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._local_of)

    def has(self, global_id: int) -> bool:
        return global_id in self._local_of

    def attach(self, global_ids: Sequence[int]) -> list[int] | None:
        """Give each of ``global_ids`` (none attached yet, no repeats) a local page; returns
        them in order, or None (nothing allocated) when too few are free."""
        if len(set(global_ids)) != len(global_ids) or any(g in self._local_of for g in global_ids):
            raise ValueError("attach: a global page id repeats or already has a local page")
        if len(global_ids) > len(self._free):
            return None
        pages = [self._free.pop() for _ in global_ids]
        self._local_of.update(zip(global_ids, pages))
        return pages

    def hand_out_in(self, order: Sequence[int]) -> None:
        """Hand free pages out in ``order`` (a permutation of all of them; every page free)."""
        if self._local_of or sorted(order) != list(range(self.num_pages)):
            raise ValueError("hand_out_in needs every local page free and a permutation of them")
        self._free = list(reversed(order))

    def detach(self, global_ids: Iterable[int]) -> list[int]:
        """Free the local pages of those of ``global_ids`` that have one; returns them."""
        freed = [self._local_of.pop(g) for g in global_ids if g in self._local_of]
        self._free.extend(freed)
        return freed

    def reassign(self, src: int, dst: int) -> None:
        """Move ``src``'s local page to ``dst`` (which has none)."""
        if dst in self._local_of:
            raise ValueError(f"reassign: page {dst} already has a local page")
        self._local_of[dst] = self._local_of.pop(src)

    def local_ids(self, global_ids: Sequence[int]) -> list[int]:
        """The local page of each id (``NO_LOCAL_PAGE`` where none): a local layer's page table."""
        return [self._local_of.get(g, NO_LOCAL_PAGE) for g in global_ids]

    def check(self) -> None:
        """Every local page is free or attached to exactly one global id."""
        attached = list(self._local_of.values())
        assert len(set(attached)) == len(attached), "a local page attached twice"
        assert sorted(attached + self._free) == list(range(self.num_pages)), "local pages lost or duplicated"


class LocalPagesFull(RuntimeError):
    """More local pages wanted than are free or held by no running request's window."""


class DeviceLocalPages:
    """L1 local pages of a pool with layer groups, trimmed lazily (docs/models.md, "Trimming").
    The L2 of such a pool (``GroupedHostPool``) keeps its local pages with the same
    bookkeeping, over host page ids.

    A global page gets a local page when something will read or write its local-layer KV
    (``attach``: a request's new pages, a load's window pages), and gives it back when the
    global page is freed (the device allocator's ``listener``).  A running request *pins*
    the pages of its window (``pin``); every attached page no request pins is evictable,
    least recently unpinned first, and ``attach`` takes those when no local page is free
    (``evicted`` counts them).  The page keeps its global KV: the tree's matches then end
    where a window is still complete (``tree_window``).

    ``array`` is the global -> local map (``NO_LOCAL_PAGE`` where none) the step ships to
    the device; ``version`` changes whenever it does.
    """

    def __init__(self, global_pages: int, local_pages: int) -> None:
        self.map = LocalPageMap(local_pages)
        self.array = np.full(global_pages, NO_LOCAL_PAGE, np.int32)
        self.version = 0
        self.evicted = 0
        self._pins: dict[Hashable, dict[int, None]] = {}  # owner -> global ids it pins (ordered)
        self._pinned_by: dict[int, set[Hashable]] = {}  # global id -> owners pinning it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # attached, unpinned: oldest first

    @property
    def num_pages(self) -> int:
        return self.map.num_pages

    @property
    def room(self) -> int:
        """Local pages ``attach`` can hand out now: free ones and evictable ones."""
        return self.map.free_pages + len(self._evictable)

    @property
    def pinned_pages(self) -> int:
        return len(self._pinned_by)

    def has(self, global_id: int) -> bool:
        return self.map.has(global_id)

    def attach(self, global_ids: Sequence[int]) -> None:
        """Give each of ``global_ids`` without one a local page (evicting the least recently
        unpinned pages if none is free); raises ``LocalPagesFull`` (nothing changed) when
        every other local page is pinned.  New pages are evictable until pinned."""
        want = list(dict.fromkeys(g for g in global_ids if not self.map.has(g)))
        if not want:
            return
        short = len(want) - self.map.free_pages
        if short > len(self._evictable):
            raise LocalPagesFull(
                f"{len(want)} local-layer pages wanted, {self.room} free or evictable of {self.num_pages} "
                f"({self.pinned_pages} pinned by running requests' windows)"
            )
        if short > 0:
            victims = [self._evictable.popitem(last=False)[0] for _ in range(short)]
            self._drop(victims)
            self.evicted += short
        local = self.map.attach(want)
        assert local is not None
        self.array[want] = local
        self._evictable.update(dict.fromkeys(want))
        self.version += 1

    def detach(self, global_ids: Iterable[int]) -> None:
        """Drop the local pages of ``global_ids`` (their local KV is not wanted); none may be pinned."""
        ids = [g for g in global_ids if self.map.has(g)]
        if any(g in self._pinned_by for g in ids):
            raise ValueError("detach: a pinned page")
        for g in ids:
            self._evictable.pop(g, None)
        self._drop(ids)

    def freed(self, pages: list[int]) -> None:
        """Allocator listener: global pages went back to the pool; so do their local pages."""
        for g in pages:
            for owner in self._pinned_by.pop(g, ()):
                self._pins[owner].pop(g, None)
            self._evictable.pop(g, None)
        self._drop([g for g in pages if self.map.has(g)])

    def _drop(self, ids: list[int]) -> None:
        if ids:
            self.map.detach(ids)
            self.array[ids] = NO_LOCAL_PAGE
            self.version += 1

    def pin(self, owner: Hashable, global_ids: Iterable[int]) -> None:
        """``owner`` (a running request) reads the local KV of ``global_ids`` (those attached):
        they are not evictable until no owner pins them.  Replaces ``owner``'s earlier pins;
        pages it lets go become evictable in the order it had pinned them (its page order:
        the earliest positions go first)."""
        new = {g: None for g in global_ids if self.map.has(g)}
        old = self._pins.pop(owner, {})
        for g in old:
            if g in new:
                continue
            owners = self._pinned_by[g]
            owners.discard(owner)
            if not owners:
                del self._pinned_by[g]
                self._evictable[g] = None  # the most recently released: evicted last
        for g in new:
            if g not in old:
                self._pinned_by.setdefault(g, set()).add(owner)
                self._evictable.pop(g, None)
        if new:
            self._pins[owner] = new

    def unpin(self, owner: Hashable) -> None:
        self.pin(owner, ())

    def evictable_pages(self) -> list[int]:
        """Attached pages no owner pins, least recently attached or released first."""
        return list(self._evictable)

    def evict(self, global_ids: Sequence[int]) -> None:
        """Trim the local pages of ``global_ids`` (evictable ones) for room; counted in ``evicted``."""
        if any(g not in self._evictable for g in global_ids):
            raise ValueError("evict: a page that is not evictable")
        for g in global_ids:
            del self._evictable[g]
        self._drop(list(global_ids))
        self.evicted += len(global_ids)

    def pinned(self, owner: Hashable) -> int:
        """How many local pages ``owner`` pins."""
        return len(self._pins.get(owner, ()))

    def move(self, src: int, dst: int) -> None:
        """The tree kept page ``dst`` for the tokens of ``src`` (a duplicate about to be freed):
        if only ``src`` has local KV, it becomes ``dst``'s, with its pins."""
        if src == dst or not self.map.has(src) or self.map.has(dst):
            return
        self.map.reassign(src, dst)
        self.array[dst], self.array[src] = self.array[src], NO_LOCAL_PAGE
        owners = self._pinned_by.pop(src, None)
        if owners:
            self._pinned_by[dst] = owners
            for owner in owners:  # (dst takes src's place in the owner's order)
                self._pins[owner] = {dst if g == src else g: None for g in self._pins[owner]}
        if src in self._evictable:
            del self._evictable[src]
            self._evictable[dst] = None
        self.version += 1

    def local_ids(self, global_ids: np.ndarray) -> np.ndarray:
        """The local page of each id; ``NO_LOCAL_PAGE`` for none or an id out of range (padding)."""
        ids = np.asarray(global_ids)
        inside = (ids >= 0) & (ids < len(self.array))
        return np.where(inside, self.array[np.where(inside, ids, 0)], NO_LOCAL_PAGE).astype(np.int32)

    def hand_out_in(self, order: Sequence[int]) -> None:
        """Hand free local pages out in ``order`` (a permutation of them) instead of ascending:
        for tests, so a local page id differs from its global one."""
        self.map.hand_out_in(order)

    def check(self, used_global: Iterable[int]) -> None:
        """Only allocated global pages have local pages, the array says which, every attached
        page is pinned or evictable (not both), and pins name attached pages."""
        self.map.check()
        used = set(used_global)
        attached = [g for g in range(len(self.array)) if self.array[g] != NO_LOCAL_PAGE]
        assert set(attached) <= used, "a free global page holds a local page"
        assert self.map.local_ids(attached) == self.array[attached].tolist(), "map array out of step"
        assert self.map.used_pages == len(attached), "map and array disagree on what is attached"
        assert set(self._pinned_by) | set(self._evictable) == set(attached), (
            "an attached page neither pinned nor evictable"
        )
        assert not set(self._pinned_by) & set(self._evictable), "a pinned page is evictable"
        for owner, pages in self._pins.items():
            assert all(owner in self._pinned_by[g] for g in pages), "pins out of step"


class TreeLocalPages:
    """``tree_window.LocalPages`` of a controller whose L1 pool has layer groups: L1 from its
    ``DeviceLocalPages``, L2 from the ``GroupedHostPool``'s (host page ids; empty without L2)."""

    def __init__(self, window: int, page_size: int, device: DeviceLocalPages, host: DeviceLocalPages) -> None:
        self.window = window
        self.window_pages = window_pages_for(window, page_size)
        self.device = device
        self.host = host

    def on_device(self, page_id: int) -> bool:
        return self.device.has(page_id)

    def on_host(self, page_id: int) -> bool:
        return self.host.has(page_id)


class TieredLocalPages:
    """``tree_window.LocalPages`` over one ``LocalPageMap`` per tier (L1, L2)."""

    def __init__(self, window: int, page_size: int, device_pages: int, host_pages: int) -> None:
        self.window = window
        self.page_size = page_size
        self.window_pages = window_pages_for(window, page_size)
        self.device = LocalPageMap(device_pages)
        self.host = LocalPageMap(host_pages)

    def on_device(self, page_id: int) -> bool:
        return self.device.has(page_id)

    def on_host(self, page_id: int) -> bool:
        return self.host.has(page_id)


def first_needed_page(next_position: int, window: int, page_size: int) -> int:
    """The first page whose local KV a sequence still reads when its next token is at
    ``next_position``: that token attends to positions ``next_position - window + 1 ..``
    and every later token to later ones, so pages ending before that are done with (the
    page the token is written into is never before it)."""
    if window <= 0 or page_size <= 0 or next_position < 0:
        raise ValueError(f"window={window}, page_size={page_size}, next_position={next_position}")
    return max(0, (next_position - window + 1) // page_size)
