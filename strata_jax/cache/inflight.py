"""The transfers in flight and their completion (pure Python).

``InFlight`` is the one place a handle's ``done`` flips: ``poll`` (every finished one),
``is_ready`` (one, if finished), ``wait`` (one, blocking) and ``drain`` (all but
prefetches).  It also knows which L2 pages a backup is still writing, so that no
reader sees a half-written page (``wait_host``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

from strata_jax.cache.handles import PrefetchHandle, TransferHandle


class InFlight:
    """Pending handles, completed in issue order.

    ``dispatch``: the mover's flush of queued copies, called before polling and draining
    (a queued backup's gather goes out with the others of its step).  ``timeout_prefetch``:
    a prefetch counts as finished at its deadline (the ``timeout`` stop policy)."""

    def __init__(self, clock: Callable[[], float], dispatch: Callable[[], None], timeout_prefetch: bool) -> None:
        self._clock = clock
        self._dispatch = dispatch
        self._timeout_prefetch = timeout_prefetch
        self._pending: list[TransferHandle] = []
        self._host_writes: dict[int, TransferHandle] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[TransferHandle]:
        return iter(list(self._pending))

    def track(self, handle: TransferHandle, writes_host_pages: Sequence[int] = ()) -> None:
        """Follow ``handle`` until it lands (at once if its completion is instant);
        ``writes_host_pages``: L2 pages it writes, not to be read before it lands."""
        if handle.completion.instant and not isinstance(handle, PrefetchHandle):
            handle.complete(self._clock())
            return
        for p in writes_host_pages:
            self._host_writes[p] = handle
        self._pending.append(handle)

    def host_written(self, host_pages: Sequence[int]) -> None:
        """A backup into ``host_pages`` landed: they may be read."""
        for p in host_pages:
            self._host_writes.pop(p, None)

    def wait_host(self, host_pages: Sequence[int]) -> None:
        """Block until no backup is still writing one of ``host_pages``."""
        for p in host_pages:
            h = self._host_writes.get(p)
            if h is not None:
                self.wait(h)

    def finished(self, handle: TransferHandle) -> bool:
        if isinstance(handle, PrefetchHandle) and not handle.done and self._timeout_prefetch:
            if self._clock() >= handle.deadline:
                return True
        return handle.completion.is_finished()

    def complete(self, handle: TransferHandle) -> None:
        handle.complete(self._clock())

    def forget(self, handle: TransferHandle) -> None:
        """A settled prefetch leaves the list."""
        if handle in self._pending:
            self._pending.remove(handle)

    def poll(self) -> list[TransferHandle]:
        """Complete every finished transfer; returns them.  A prefetch stays listed after it
        landed until it is settled (``forget``)."""
        self._dispatch()
        done: list[TransferHandle] = []
        keep: list[TransferHandle] = []
        for h in self._pending:
            if not h.done and self.finished(h):
                self.complete(h)
            if h.done:
                done.append(h)
                if isinstance(h, PrefetchHandle) and not h.finished:
                    keep.append(h)
            else:
                keep.append(h)
        self._pending = keep
        return done

    def is_ready(self, handle: TransferHandle | None) -> bool:
        """Has this transfer landed (completing it if so)?  ``None`` counts as ready."""
        if handle is None or handle.done:
            return True
        if self.finished(handle):
            self.complete(handle)
            return True
        return False

    def wait(self, handle: TransferHandle | None) -> None:
        """Block until ``handle`` landed."""
        if handle is None or handle.done:
            return
        handle.completion.block()
        self.complete(handle)

    def drain(self) -> None:
        """Wait for every in-flight transfer (prefetches excluded: they are settled, not waited)."""
        self._dispatch()
        for h in list(self._pending):
            if not isinstance(h, PrefetchHandle):
                self.wait(h)
        self.poll()

    def has_unlanded(self, kind: str) -> bool:
        return any(not h.done and h.kind == kind for h in self._pending)

    def pending_for(self, request_id: Hashable) -> bool:
        """A load or prefetch issued for ``request_id`` has not landed."""
        return any(not h.done and h.request_id == request_id and not self.finished(h) for h in self._pending)

    def prefetches_of(self, request_id: Hashable) -> list[PrefetchHandle]:
        """``request_id``'s prefetches not settled yet."""
        return [
            h for h in self._pending if isinstance(h, PrefetchHandle) and h.request_id == request_id and not h.finished
        ]

    def prefetches(self) -> list[PrefetchHandle]:
        return [h for h in self._pending if isinstance(h, PrefetchHandle) and not h.finished]

    def next_landing(self) -> float | None:
        """Earliest known landing time of a transfer still in flight (simulated runs know it ahead)."""
        times = [h.landed_at for h in self._pending if not h.done and h.landed_at is not None]
        return min(times) if times else None
