"""Local-layer pages of a sliding-window model, attached to global page ids (pure Python, no jax).

The bookkeeping half of issue 22's layer groups (docs/models.md, "Layer groups"): per
tier, a ``LocalPageMap`` owns that tier's local-layer pool (its own page ids and free
list) and the map from a global page id (what the tree and the page tables hold) to the
local page holding the same tokens' local-layer KV.  ``TieredLocalPages`` is the
``tree_window.LocalPages`` the tree reads.  ``first_needed_page`` is the rule a running
request trims by: the local KV of pages before it is never read again.

``DeviceLocalPages`` is the L1 map of a pool with layer groups (``--kv-layer-groups``):
every device page the allocator hands out gets a local page, freed with it, and the map
is an int32 array the model step reads (a local layer's page table is the map applied to
the request's).  Trimming local pages out of a running request's window, and the tree's
and L2/L3's use of the map, are the next steps (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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

    def detach(self, global_ids: Iterable[int]) -> list[int]:
        """Free the local pages of those of ``global_ids`` that have one; returns them."""
        freed = [self._local_of.pop(g) for g in global_ids if g in self._local_of]
        self._free.extend(freed)
        return freed

    def local_ids(self, global_ids: Sequence[int]) -> list[int]:
        """The local page of each id (``NO_LOCAL_PAGE`` where none): a local layer's page table."""
        return [self._local_of.get(g, NO_LOCAL_PAGE) for g in global_ids]

    def check(self) -> None:
        """Every local page is free or attached to exactly one global id."""
        attached = list(self._local_of.values())
        assert len(set(attached)) == len(attached), "a local page attached twice"
        assert sorted(attached + self._free) == list(range(self.num_pages)), "local pages lost or duplicated"


class DeviceLocalPages:
    """L1 local pages kept in step with the device page allocator (its ``listener``): each
    allocated global page gets a local page and gives it back when freed.  ``array`` is
    the global -> local map (``NO_LOCAL_PAGE`` where none) the step ships to the device,
    ``version`` changes whenever it does."""

    def __init__(self, global_pages: int, local_pages: int) -> None:
        self.map = LocalPageMap(local_pages)
        self.array = np.full(global_pages, NO_LOCAL_PAGE, np.int32)
        self.version = 0

    def allocated(self, pages: list[int]) -> None:
        local = self.map.attach(pages)
        if local is None:  # cannot happen while every global page has a local one
            raise RuntimeError(f"{len(pages)} local pages wanted, {self.map.free_pages} free")
        self.array[pages] = local
        self.version += 1

    def freed(self, pages: list[int]) -> None:
        self.map.detach(pages)
        self.array[pages] = NO_LOCAL_PAGE
        self.version += 1

    def local_ids(self, global_ids: np.ndarray) -> np.ndarray:
        """The local page of each id; ``NO_LOCAL_PAGE`` for none or an id out of range (padding)."""
        ids = np.asarray(global_ids)
        inside = (ids >= 0) & (ids < len(self.array))
        return np.where(inside, self.array[np.where(inside, ids, 0)], NO_LOCAL_PAGE).astype(np.int32)

    def hand_out_in(self, order: Sequence[int]) -> None:
        """Hand free local pages out in ``order`` (a permutation of them) instead of ascending:
        for tests, so a local page id differs from its global one."""
        if self.map.used_pages or sorted(order) != list(range(self.map.num_pages)):
            raise ValueError("hand_out_in needs every local page free and a permutation of them")
        self.map._free = list(reversed(order))  # noqa: SLF001

    def check(self, used_global: Iterable[int]) -> None:
        """Exactly the allocated global pages have local pages, and the array says which."""
        self.map.check()
        used = sorted(used_global)
        assert [g for g in range(len(self.array)) if self.array[g] != NO_LOCAL_PAGE] == used, "local pages out of step"
        assert self.map.local_ids(used) == self.array[used].tolist(), "map array out of step"


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
