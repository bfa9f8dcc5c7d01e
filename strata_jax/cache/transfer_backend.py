"""What the cache controller asks of whatever moves its pages (pure Python, no jax).

Two implementations: ``DeviceTransfers`` (``device_transfers.py``: the L1 and L2 pools,
I/O threads, the landing watcher) and ``SimulatedTransfers`` (``sim_transfers.py``: no
bytes, transfers land at once or in a ``TransferTimer``'s virtual time).  The policy --
which pages move when, locks, accounting -- stays in ``CacheController`` and is the same
code over either.

Every method that starts a copy returns its ``TransferHandle``, built with its
``Completion`` and the ``on_done`` bookkeeping the controller passes in; the controller
tracks it (``InFlight``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from strata_jax.cache.handles import Completion, PrefetchHandle, TransferHandle
from strata_jax.cache.local_pages import TreeLocalPages
from strata_jax.cache.storage_service import StorageService
from strata_jax.cache.tier_format import TierFormat


class TransferBackend(Protocol):
    """Moves pages between L1, L2 and L3 for a ``CacheController``."""

    @property
    def page_bytes(self) -> int:
        """One page in the tier format: what L2 holds, a load or backup moves."""
        ...

    @property
    def device_page_bytes(self) -> int:
        """One L1 page."""
        ...

    @property
    def tier_format_name(self) -> str: ...

    @property
    def tier_format(self) -> TierFormat | None:
        """None: moves no bytes, so has no format of its own."""
        ...

    @property
    def local_pages(self) -> TreeLocalPages | None:
        """Layer groups: where each page's local-layer KV is."""
        ...

    def host_page_bytes(self) -> float:
        """One L2 page as held (a pool with layer groups keeps a share of the local layers)."""
        ...

    def backup(
        self, dev_pages: Sequence[int], host_pages: Sequence[int], on_done: Callable[[], None]
    ) -> TransferHandle:
        """Copy L1 ``dev_pages`` into L2 ``host_pages``; ``on_done`` once they are there."""
        ...

    def flush(self) -> None:
        """Dispatch copies queued during the step (backups' gathers), as few programs as possible."""
        ...

    def load(
        self,
        host_pages: Sequence[int],
        dev_pages: Sequence[int],
        with_local: Sequence[bool] | None,
        request_id: Hashable | None,
        measure: Callable[[TransferHandle], None],
    ) -> TransferHandle:
        """Copy L2 ``host_pages`` into L1 ``dev_pages`` (``with_local``: which pages bring their
        local-layer KV); ``measure(handle)`` once it landed."""
        ...

    def load_bytes(self, num_pages: int, with_local: Sequence[bool] | None) -> int:
        """Tier-format bytes a load of ``num_pages`` moves."""
        ...

    def write_storage(
        self, storage: StorageService, keys: Sequence[bytes], host_pages: Sequence[int]
    ) -> TransferHandle:
        """Write a snapshot of L2 ``host_pages`` to L3 under ``keys`` (the host pages may be
        reused once this returns)."""
        ...

    def start_prefetch(
        self,
        storage: StorageService,
        num_pages: int,
        issued_at: float,
        build: Callable[[Completion], PrefetchHandle],
    ) -> PrefetchHandle:
        """Start reading a prefetch's objects into its reserved host pages."""
        ...

    def pages_landed(self, handle: PrefetchHandle) -> int:
        """Pages of the prefetch in L2 by now."""
        ...

    def stop_prefetch(self, handle: PrefetchHandle, policy: str) -> int:
        """Apply the stop ``policy`` (waiting as it says), stop the reader; returns pages landed."""
        ...

    def cancel_prefetch(self, handle: PrefetchHandle) -> None:
        """Stop the reader at once; nothing it read is used."""
        ...

    def release_prefetch(self, handle: PrefetchHandle) -> None:
        """The prefetch is settled: release what the reader held."""
        ...

    def device_kv_bytes(self, num_pages: int, pinned_local_pages: int) -> int:
        """L1 bytes of ``num_pages`` pages whose window pins ``pinned_local_pages`` local pages."""
        ...

    def moved(self) -> dict[str, int] | None:
        """What crossed the host<->device link as the L1 pool counted it (None: not counted)."""
        ...

    def chunk_pages(self) -> int:
        """Pages per staging chunk of a load or backup."""
        ...

    def warmup(self) -> int:
        """Compile the load and backup programs now; returns compiles."""
        ...

    def check(self, device_used: Sequence[int], host_used: Sequence[int]) -> None:
        """Assert the pools' own accounting given the pages in use."""
        ...

    def close(self) -> None: ...
