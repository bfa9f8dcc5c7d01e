"""Transfers that move no bytes: the bookkeeping controller of the simulator and the
no-model benchmarks (pure Python).

Without a ``TransferTimer`` every copy lands as it is issued; with one, in the timer's
virtual time (``land_time``), and waiting for one advances the virtual clock.  A
prefetch's pages land evenly between its issue and its landing.  Storage objects are
written with empty payloads (their existence is what the policy needs).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from strata_jax.cache.handles import (
    Completion,
    Landed,
    PrefetchHandle,
    TransferHandle,
    TransferKind,
    TransferTimer,
    VirtualLanding,
)
from strata_jax.cache.local_pages import TreeLocalPages
from strata_jax.cache.storage_service import StorageService
from strata_jax.cache.tier_format import TierFormat


class SimulatedTransfers:
    """``TransferBackend`` in (virtual) time only; ``page_bytes``: one page, in L1, L2 and on the link."""

    local_pages: TreeLocalPages | None = None
    tier_format: TierFormat | None = None

    def __init__(
        self,
        page_bytes: int,
        clock: Callable[[], float],
        timer: TransferTimer | None = None,
        tier_format_name: str = "full",
    ) -> None:
        self.page_bytes = page_bytes
        self.device_page_bytes = page_bytes
        self.tier_format_name = tier_format_name
        self._clock = clock
        self._timer = timer

    def host_page_bytes(self) -> float:
        return self.page_bytes

    def _landing(self, kind: TransferKind, num_pages: int, nbytes: int, issued_at: float) -> Completion:
        if self._timer is None:
            return Landed()
        return VirtualLanding(self._timer.land_time(kind, num_pages, nbytes, issued_at), self._clock, self._timer)

    def _handle(
        self, kind: TransferKind, request_id: Hashable | None, num_pages: int, on_done: Callable[[], None]
    ) -> TransferHandle:
        now = self._clock()
        nbytes = num_pages * self.page_bytes
        completion = self._landing(kind, num_pages, nbytes, now)
        handle = TransferHandle(kind, request_id, num_pages, nbytes, now, completion, on_done)
        if isinstance(completion, VirtualLanding):
            handle.landed_at = completion.when
        return handle

    def backup(
        self, dev_pages: Sequence[int], host_pages: Sequence[int], on_done: Callable[[], None]
    ) -> TransferHandle:
        return self._handle("backup", None, len(dev_pages), on_done)

    def flush(self) -> None:
        return None

    def load(
        self,
        host_pages: Sequence[int],
        dev_pages: Sequence[int],
        with_local: Sequence[bool] | None,
        request_id: Hashable | None,
        measure: Callable[[TransferHandle], None],
    ) -> TransferHandle:
        handle = self._handle("load", request_id, len(dev_pages), lambda: measure(handle))
        return handle

    def load_bytes(self, num_pages: int, with_local: Sequence[bool] | None) -> int:
        return num_pages * self.page_bytes

    def write_storage(
        self, storage: StorageService, keys: Sequence[bytes], host_pages: Sequence[int]
    ) -> TransferHandle:
        storage.write(keys, [b""] * len(keys))
        now = self._clock()
        return TransferHandle("storage_write", None, len(keys), len(keys) * self.page_bytes, now)

    def start_prefetch(
        self,
        storage: StorageService,
        num_pages: int,
        issued_at: float,
        build: Callable[[Completion], PrefetchHandle],
    ) -> PrefetchHandle:
        completion = self._landing("prefetch", num_pages, num_pages * self.page_bytes, issued_at)
        handle = build(completion)
        if isinstance(completion, VirtualLanding):
            handle.landed_at = completion.when
        else:  # bookkeeping only: batch_exists just said they are there
            handle.landed = num_pages
        return handle

    def pages_landed(self, handle: PrefetchHandle) -> int:
        """Pages land evenly until ``landed_at``."""
        if self._timer is None:
            return handle.landed
        end = handle.landed_at if handle.landed_at is not None else handle.issued_at
        now = self._clock()
        if now >= end:
            return handle.num_pages
        return int(handle.num_pages * max(0.0, now - handle.issued_at) / max(end - handle.issued_at, 1e-12))

    def stop_prefetch(self, handle: PrefetchHandle, policy: str) -> int:
        if self._timer is None:
            return handle.landed
        end = handle.landed_at if handle.landed_at is not None else handle.issued_at
        if policy == "wait_complete":
            self._timer.wait_until(end)
        elif policy == "timeout":
            self._timer.wait_until(min(end, handle.deadline))
        return self.pages_landed(handle)

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        return None

    def release_prefetch(self, handle: PrefetchHandle) -> None:
        return None

    def device_kv_bytes(self, num_pages: int, pinned_local_pages: int) -> int:
        return num_pages * self.device_page_bytes

    def moved(self) -> dict[str, int] | None:
        return None

    def chunk_pages(self) -> int:
        return 1

    def warmup(self) -> int:
        return 0

    def check(self, device_used: Sequence[int], host_used: Sequence[int]) -> None:
        return None

    def close(self) -> None:
        return None
