"""Transfer handles, how they complete, and the controller's errors (no jax, no numpy).

A ``TransferHandle`` is one asynchronous copy between tiers.  It is built with the
two things that decide its life: a ``Completion`` (how to tell that the copy landed and
how to wait for it: JAX arrays becoming ready, a storage worker's future, a simulator's
virtual clock) and ``on_done`` (the controller's bookkeeping once it landed).  Only
``InFlight`` (``inflight.py``) flips ``done``, through ``TransferHandle.complete``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from strata_jax.cache.radix_tree import TreeNode

TransferKind = Literal["load", "backup", "storage_write", "prefetch"]


class CacheError(RuntimeError):
    """Misuse of the controller (e.g. loading an unlocked match)."""


class CacheFullError(CacheError):
    """L1 cannot provide the pages even after evicting every unlocked page."""


class Completion(Protocol):
    """How one transfer lands.  ``instant``: it landed when it was issued (a bookkeeping
    controller's copies): nothing to wait for, and its duration says nothing about a link."""

    instant: bool

    def is_finished(self) -> bool: ...

    def block(self) -> None: ...

    def settle(self) -> None:
        """The mover's own work once the copy landed (e.g. staged rows into L2); runs once."""
        ...


class Landed:
    """Already there: a bookkeeping copy, or a handle built after the fact."""

    instant = True

    def is_finished(self) -> bool:
        return True

    def block(self) -> None:
        return None

    def settle(self) -> None:
        return None


class ArraysReady:
    """Lands when every (device or staging) array is ready; ``then`` runs at settle time."""

    instant = False

    def __init__(self, arrays: Sequence[Any], then: Callable[[], None] | None = None) -> None:
        self._arrays = list(arrays)
        self._then = then

    def is_finished(self) -> bool:
        return all(a.is_ready() for a in self._arrays)

    def block(self) -> None:
        for a in self._arrays:
            a.block_until_ready()

    def settle(self) -> None:
        if self._then is not None:
            self._then()


class FutureDone:
    """Lands when a worker thread's future is done (its exceptions are the worker's to handle)."""

    instant = False

    def __init__(self, future: Future[Any]) -> None:
        self.future = future

    def is_finished(self) -> bool:
        return self.future.done()

    def block(self) -> None:
        self.future.result()

    def settle(self) -> None:
        return None


class Deferred:
    """A copy queued but not dispatched yet (a backup's device gather waits for the end of the
    step): ``dispatch`` gives it the completion of the dispatched copy; waiting on it first
    asks ``dispatch_now`` (the mover's flush) to dispatch the queue."""

    instant = False

    def __init__(self, dispatch_now: Callable[[], None]) -> None:
        self._dispatch_now = dispatch_now
        self._inner: Completion | None = None

    def dispatch(self, inner: Completion) -> None:
        self._inner = inner

    def is_finished(self) -> bool:
        return self._inner is not None and self._inner.is_finished()

    def block(self) -> None:
        if self._inner is None:
            self._dispatch_now()
        if self._inner is None:
            raise CacheError("a queued transfer was not dispatched by its mover's flush")
        self._inner.block()

    def settle(self) -> None:
        if self._inner is not None:
            self._inner.settle()


class TransferTimer(Protocol):
    """Virtual time of transfers, for a controller that moves no bytes (the simulator).

    ``land_time(kind, num_pages, nbytes, issued_at)`` is when a transfer of that
    kind ("load", "backup", "prefetch") issued at ``issued_at`` lands (the timer
    models the link, its queueing and its path); ``wait_until(t)`` blocks the
    caller until virtual time ``t`` (it advances the clock).
    """

    def land_time(self, kind: str, num_pages: int, nbytes: int, issued_at: float) -> float: ...

    def wait_until(self, t: float) -> None: ...


class VirtualLanding:
    """Lands at virtual time ``when`` of ``clock``; waiting for it advances the clock."""

    instant = False

    def __init__(self, when: float, clock: Callable[[], float], timer: TransferTimer) -> None:
        self.when = when
        self._clock = clock
        self._timer = timer

    def is_finished(self) -> bool:
        return self._clock() >= self.when

    def block(self) -> None:
        self._timer.wait_until(self.when)

    def settle(self) -> None:
        return None


def _nothing() -> None:
    return None


@dataclass(eq=False)
class TransferHandle:
    """One asynchronous transfer.  ``done`` flips in ``complete`` (called by ``InFlight``)."""

    kind: TransferKind
    request_id: Hashable | None
    num_pages: int
    nbytes: int
    issued_at: float
    completion: Completion = field(default_factory=Landed, repr=False)
    on_done: Callable[[], None] = field(default=_nothing, repr=False)
    done: bool = False
    completed_at: float | None = None  # when poll/is_ready/wait noticed it
    landed_at: float | None = None  # when it landed, stamped by a watcher thread (loads) or known ahead (simulated)
    service_seconds: float | None = None  # loads: time on the link, queue in front excluded (set on completion)

    @property
    def seconds(self) -> float | None:
        """Issue to landing (to being noticed where no landing was stamped); None while in flight."""
        end = self.landed_at if self.landed_at is not None else self.completed_at
        return None if end is None else max(end - self.issued_at, 1e-9)

    def complete(self, now: float) -> None:
        """The copy landed: the mover settles, then the controller's bookkeeping runs."""
        self.done = True
        self.completed_at = now
        self.completion.settle()
        self.on_done()


@dataclass(eq=False)
class PrefetchHandle(TransferHandle):
    """An L3 -> L2 prefetch: pages ``start_page .. start_page + num_pages`` of ``tokens``."""

    tokens: tuple[int, ...] = ()
    namespace: str = ""
    start_page: int = 0
    keys: list[bytes] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    anchor: TreeNode | None = None
    deadline: float = 0.0
    landed: int = 0
    missed: bool = False  # an object the probe promised was gone or did not verify
    finished: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the worker's page writes vs settling
    # L2 with layer groups: the local host page of each host page (or NO_LOCAL_PAGE), and
    # the host pages whose objects were global-only (their local pages go back at settle time)
    local_slots: list[int] = field(default_factory=list)
    global_only: list[int] = field(default_factory=list)
