"""O(1) page allocator with exact accounting (pure Python, no jax).

A free stack of page ids plus a per-page "is free" byte, so a double free or a
foreign id is caught immediately.  Fresh pools hand pages out in ascending order,
so a sequence allocated at once gets a contiguous run (a host run needs no
gather, only a view).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class AllocatorError(ValueError):
    """A page id freed twice, out of range, or a negative request."""


class AllocationListener(Protocol):
    def freed(self, pages: list[int]) -> None: ...


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1``.

    Contract: ``alloc`` either returns exactly ``n`` distinct ids or ``None``
    (nothing is taken); the caller owns the ids until it passes them to ``free``
    (or hands them to the tree, which returns them through eviction).
    """

    def __init__(self, num_pages: int, name: str = "pages") -> None:
        if not isinstance(num_pages, int) or num_pages < 0:
            raise AllocatorError(f"{name}: num_pages must be a non-negative int, got {num_pages!r}")
        self.name = name
        self.num_pages = num_pages
        # told of every free (``freed(ids)``): the local pages of a pool with layer groups go
        # back with their global pages (local_pages.DeviceLocalPages)
        self.listener: AllocationListener | None = None
        self._free = list(range(num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise AllocatorError(f"{self.name}: cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        flags = self._is_free
        for p in out:
            flags[p] = 0
        return out

    def free(self, pages: Iterable[int]) -> None:
        flags = self._is_free
        pages = list(pages)
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise AllocatorError(f"{self.name}: page {p} out of range 0..{self.num_pages - 1}")
            if flags[p]:
                raise AllocatorError(f"{self.name}: page {p} freed twice")
            flags[p] = 1
        self._free.extend(reversed(pages))
        if self.listener is not None:
            self.listener.freed(pages)

    def free_pages(self) -> list[int]:
        """A copy of the free list (for invariant checks)."""
        return list(self._free)
