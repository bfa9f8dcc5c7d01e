"""Local-layer KV of sliding-window models in L1: which pages keep it, who pins it (pure Python).

A pool with layer groups keeps every page's global layers but the local (sliding-window)
layers' KV of a page only while a window may read it.  ``LayerWindows`` is the cache
controller's part for that: requests ``attach`` the pages they write and ``pin`` their
windows; a load moves the local KV of the match end's window only (``load_mask``); a
match ends where a window is complete (``complete_end``).  ``NoWindows`` is the same
interface for a pool without layer groups, where all of this is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from strata_jax.cache.handles import CacheFullError
from strata_jax.cache.local_pages import LocalPagesFull, TreeLocalPages, first_needed_page


class NoWindows:
    """Every layer of every page is kept: nothing to attach, pin or trim."""

    moves = False  # whether a request's next position moves anything (callers skip ``pin`` when not)

    def attach(self, pages: Sequence[int]) -> None:
        return None

    def pin(self, owner: Hashable, page_table: Sequence[int], next_position: int) -> None:
        return None

    def unpin(self, owner: Hashable) -> None:
        return None

    def new_request_room(self, step_tokens: int) -> int | None:
        return None

    def pinned(self, owner: Hashable) -> int:
        return 0

    def complete_end(self, pages: Sequence[int], end: int) -> int:
        return end

    def moved_duplicates(self, mine: Sequence[int], kept: Sequence[int]) -> None:
        return None

    def load_mask(self, first: int, end: int, host_pages: Sequence[int]) -> list[bool] | None:
        return None


class LayerWindows(NoWindows):
    """Where the local KV of each L1 page is (``TreeLocalPages``).  ``flush``: dispatch queued
    backup gathers (they read the local pages their pages had when issued)."""

    moves = True

    def __init__(self, local_pages: TreeLocalPages, page_size: int, flush: Callable[[], None]) -> None:
        self._local = local_pages
        self._page_size = page_size
        self._flush = flush

    def attach(self, pages: Sequence[int]) -> None:
        """Device ``pages`` will hold their local-layer KV (a step writes it, a load brings it):
        give them local pages, trimming unpinned ones if none is free.  Raises
        ``CacheFullError`` when the running requests' windows pin every other one."""
        self._flush()
        try:
            self._local.device.attach(pages)
        except LocalPagesFull as exc:
            raise CacheFullError(str(exc)) from None

    def pin(self, owner: Hashable, page_table: Sequence[int], next_position: int) -> None:
        """``owner``'s next token is at ``next_position``: it still reads the local KV of the
        pages of ``page_table`` from ``first_needed_page`` on; the rest becomes evictable.
        One page more is kept: the window of the page boundary before the last one, where a
        repeat of a fully cached prompt resumes (the scheduler recomputes its last page)."""
        ps = self._page_size
        first = first_needed_page(max(0, next_position - ps), self._local.window, ps)
        self._local.device.pin(owner, page_table[first:])

    def unpin(self, owner: Hashable) -> None:
        self._local.device.unpin(owner)

    def new_request_room(self, step_tokens: int) -> int | None:
        """Requests that may start running now for the local-layer pages: each pins its window
        plus the page it writes (``window_pages + 2``), after room for one prefill step of
        ``step_tokens``; 1 when no page is pinned (the engine refuses a ratio too small for one
        request's window and chunk)."""
        local = self._local.device
        room = max(0, (local.room - -(-step_tokens // self._page_size)) // (self._local.window_pages + 2))
        return max(room, 1) if local.pinned_pages == 0 else room

    def pinned(self, owner: Hashable) -> int:
        return self._local.device.pinned(owner)

    def complete_end(self, pages: Sequence[int], end: int) -> int:
        """The largest ``e <= end`` whose window (the ``window_pages`` before it) has its local
        KV on the device: where a prefix of the device ``pages`` may end."""
        w, has = self._local.window_pages, self._local.on_device
        e = end
        while e > 0 and not all(has(p) for p in pages[max(0, e - w) : e]):
            e -= 1
        return e

    def moved_duplicates(self, mine: Sequence[int], kept: Sequence[int]) -> None:
        """An insert freed ``mine`` as duplicates of the tree's ``kept``: a duplicate's local KV
        goes to the tree's page if that has none."""
        for m, k in zip(mine, kept, strict=False):
            if m != k:
                self._local.device.move(m, k)

    def load_mask(self, first: int, end: int, host_pages: Sequence[int]) -> list[bool] | None:
        """Which of ``host_pages`` (path pages ``first ..``) a load brings with their local KV:
        those of the window before ``end`` that the host holds.  Earlier pages stay global-only."""
        w = self._local.window_pages
        return [end - w <= first + i < end and self._local.on_host(h) for i, h in enumerate(host_pages)]
