"""Transfer handles and the controller's errors (no jax, no numpy).

A ``TransferHandle`` is one asynchronous copy between tiers.  Who completes it:
``CacheController.poll`` / ``is_ready`` / ``wait`` flip ``done`` (and run its
``_on_done`` bookkeeping) once ``_is_finished()`` says the copy landed; how it
lands is up to whoever issued it (JAX arrays becoming ready, a storage worker's
future, or a simulator's virtual clock passing ``landed_at``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from strata_jax.cache.radix_tree import TreeNode


def await_arrays(handle: TransferHandle, arrays: Sequence[Any]) -> None:
    """``handle`` lands when every (device or staging) array in ``arrays`` is ready."""

    def block() -> None:
        for a in arrays:
            a.block_until_ready()

    handle._is_finished = lambda: all(a.is_ready() for a in arrays)
    handle._block = block


class CacheError(RuntimeError):
    """Misuse of the controller (e.g. loading an unlocked match)."""


class CacheFullError(CacheError):
    """L1 cannot provide the pages even after evicting every unlocked page."""


@dataclass(eq=False)
class TransferHandle:
    """One asynchronous transfer.  ``done`` flips in ``poll``/``is_ready``/``wait``."""

    kind: str  # "load" | "backup" | "storage_write" | "prefetch"
    request_id: Hashable | None
    num_pages: int
    nbytes: int
    issued_at: float
    done: bool = False
    completed_at: float | None = None  # when poll/is_ready/wait noticed it
    landed_at: float | None = None  # when it landed, stamped by a watcher thread (loads)
    service_seconds: float | None = None  # loads: time on the link, queue in front excluded (set on completion)
    _is_finished: Callable[[], bool] = field(default=lambda: True, repr=False)
    _block: Callable[[], None] = field(default=lambda: None, repr=False)
    _on_done: Callable[[], None] = field(default=lambda: None, repr=False)

    @property
    def seconds(self) -> float | None:
        """Issue to landing (to being noticed where no landing was stamped); None while in flight."""
        end = self.landed_at if self.landed_at is not None else self.completed_at
        return None if end is None else max(end - self.issued_at, 1e-9)


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
    future: Future | None = None
    # L2 with layer groups: the local host page of each host page (or NO_LOCAL_PAGE), and
    # the host pages whose objects were global-only (their local pages go back at settle time)
    local_slots: list[int] = field(default_factory=list)
    global_only: list[int] = field(default_factory=list)


class TransferTimer(Protocol):
    """Virtual time of transfers, for a bookkeeping-only controller (the simulator).

    ``land_time(kind, num_pages, nbytes, issued_at)`` is when a transfer of that
    kind ("load", "backup", "prefetch") issued at ``issued_at`` lands (the timer
    models the link, its queueing and its path); ``wait_until(t)`` blocks the
    caller until virtual time ``t`` (it advances the clock).
    """

    def land_time(self, kind: str, num_pages: int, nbytes: int, issued_at: float) -> float: ...

    def wait_until(self, t: float) -> None: ...


def land_at(handle: TransferHandle, when: float, clock: Callable[[], float], timer: TransferTimer) -> None:
    """``handle`` lands at virtual time ``when`` of ``clock`` (waiting for it advances the clock)."""
    handle.landed_at = when
    handle._is_finished = lambda: clock() >= when
    handle._block = lambda: timer.wait_until(when)
