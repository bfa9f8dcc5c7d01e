"""KV pools: the layer-first device pool (L1, a jax array) and the page-first host pool (L2, numpy).

Layouts are the ``pallas_kernels.layout`` contract.  The pools hold data only;
which page belongs to whom is the allocators' and the tree's business.

* ``DevicePool.kv`` is updated in place: every writer (the runner's jitted step,
  ``load_pages``) *donates* it and stores the result back with ``replace``.
  Reads (``gather_pages``) are ordered before later writes by JAX's data flow, so
  a device page may be freed as soon as a gather out of it is dispatched.
* Under tensor parallelism the device pool is split on its KV-head axis (each device
  moves its own heads of a page); host pages and L3 objects stay whole pages in the
  page-first layout, so they are the same bytes whatever the tp size.
* ``HostPool.data`` is plain numpy ``[num_pages, L, 2, page_size, H, D]`` (pinned
  host memory on GPU is future work, see docs/cache.md); one page is one
  contiguous block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pallas_kernels.layout import KVLayout


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= ``max(n, minimum)``: staging shapes come from a fixed set."""
    b = minimum
    while b < n:
        b *= 2
    return b


def chunk_pages_for(page_bytes: int, chunk_bytes: int) -> int:
    """Pages per transfer chunk (``CacheConfig.transfer_chunk_bytes``): the largest power of
    two of at most ``chunk_bytes`` (>= 1 page)."""
    pages = max(1, chunk_bytes // max(1, page_bytes))
    return 1 << (pages.bit_length() - 1)


def _is_run(pages: Sequence[int]) -> bool:
    return len(pages) > 0 and pages[-1] - pages[0] == len(pages) - 1 and all(
        pages[i + 1] == pages[i] + 1 for i in range(len(pages) - 1)
    )


class HostPool:
    """Page-first L2 pool in host memory."""

    def __init__(self, layout: KVLayout, num_pages: int) -> None:
        from pallas_kernels.layout import _numpy_dtype_name

        self.layout = layout
        self.num_pages = num_pages
        self.data = np.zeros(layout.page_first_shape(num_pages), dtype=_numpy_dtype_name(layout.dtype))

    @classmethod
    def from_array(cls, layout: KVLayout, data: np.ndarray) -> HostPool:
        """A pool over an existing page-first array (no copy), e.g. a benchmark's host pages."""
        if data.ndim != 6 or tuple(data.shape[1:]) != tuple(layout.page_first_shape(1)[1:]):
            raise ValueError(f"host array shape {data.shape} does not match the layout's page shape")
        pool = cls.__new__(cls)
        pool.layout, pool.num_pages, pool.data = layout, data.shape[0], data
        return pool

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def read(self, pages: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Pages as ``[n, L, 2, S, H, D]``: a view for a contiguous run (no copy), else a gather.

        A returned view aliases the pool: keep the pages owned until done with it.
        With ``out`` (at least ``len(pages)`` rows) the pages are copied into
        ``out[:n]`` and ``out`` is returned.
        """
        from pallas_kernels.transfer import gather_host_pages

        n = len(pages)
        if out is not None:
            gather_host_pages(self.data, np.asarray(pages, dtype=np.int64), out[:n])
            return out
        if _is_run(pages):
            return self.data[pages[0] : pages[0] + n]
        # page-first: every page is one contiguous block, copied run by run (np.take goes item by item)
        return gather_host_pages(self.data, np.asarray(pages, dtype=np.int64))

    def write(self, pages: Sequence[int], values: np.ndarray) -> None:
        """Store ``values[:len(pages)]`` (page-first) into ``pages``."""
        n = len(pages)
        if _is_run(pages):
            self.data[pages[0] : pages[0] + n] = values[:n]
        else:
            self.data[np.asarray(pages, dtype=np.int64)] = values[:n]


_JITTED: dict[tuple, tuple] = {}


def _jitted_transfers(backend: str, sharding=None) -> tuple:  # noqa: ANN001
    """The jitted scatter (pool donated) and gather for a concrete kernel backend, shared
    by every pool using it (one compile per shape and backend).

    With a head-sharded ``sharding`` (tensor parallelism, ``strata_jax.runtime.sharding``)
    pool, staging and gathered pages are split on the KV heads and the kernels run per
    shard (``pallas_kernels.sharded``): each device scatters / gathers only its heads.
    """
    key = (backend, sharding)
    if key not in _JITTED:  # a cache of compiled functions, not state: pools stay independent
        import jax

        import pallas_kernels
        from pallas_kernels.sharded import use_head_sharding

        mesh = sharding.mesh if sharding is not None else None

        def _scatter(pool, staging, ids):  # noqa: ANN001, ANN202
            with use_head_sharding(mesh):
                return pallas_kernels.scatter_pages(pool, staging, ids, backend=backend)

        def _gather(pool, ids):  # noqa: ANN001, ANN202
            with use_head_sharding(mesh):
                return pallas_kernels.gather_pages(pool, ids, backend=backend)

        if sharding is None:
            _JITTED[key] = (jax.jit(_scatter, donate_argnums=0), jax.jit(_gather))
        else:
            ids = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            _JITTED[key] = (
                jax.jit(_scatter, donate_argnums=0, in_shardings=(sharding, sharding, ids), out_shardings=sharding),
                jax.jit(_gather, in_shardings=(sharding, ids), out_shardings=sharding),
            )
    return _JITTED[key]


class DevicePool:
    """Layer-first L1 pool ``kv[L, 2, num_pages, S, H, D]`` with donated page transfers.

    ``device``: a device, or a sharding; a ``NamedSharding`` splitting axis 4 (the KV
    heads) over a ``tp`` mesh axis (``strata_jax.runtime.sharding.pool_sharding``)
    makes a tensor-parallel pool: each device holds its heads of every page, a load
    ``device_put``s a whole-page staging buffer with the same sharding (each device
    receives its heads' bytes only) and a backup's gather comes back as whole pages.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device=None, *, kernel_backend: str = "auto") -> None:  # noqa: ANN001
        import jax
        import jax.numpy as jnp

        import pallas_kernels

        self.layout = layout
        self.num_pages = num_pages
        self._device = device
        shape = layout.device_pool_shape(num_pages)
        if isinstance(device, jax.sharding.Sharding):  # allocated in place, shard by shard
            self.kv = jax.jit(lambda: jnp.zeros(shape, dtype=layout.dtype), out_shardings=device)()
        else:
            kv = jnp.zeros(shape, dtype=layout.dtype)
            self.kv = jax.device_put(kv, device) if device is not None else kv

        # Resolved now (argument, then $STRATA_KERNEL_BACKEND, then platform) and fixed for the pool's life.
        self.kernel_backend = pallas_kernels.resolve_backend(kernel_backend)
        head_sharded = isinstance(device, jax.sharding.NamedSharding) and len(device.mesh.devices.flat) > 1
        self._scatter, self._gather = _jitted_transfers(self.kernel_backend, device if head_sharded else None)

    def replace(self, kv) -> None:  # noqa: ANN001
        """Store the pool returned by a step that donated ``self.kv``."""
        self.kv = kv

    def _ids(self, page_ids: Sequence[int], size: int) -> np.ndarray:
        ids = np.full((size,), self.num_pages, dtype=np.int32)  # out of range: dropped by scatter
        ids[: len(page_ids)] = page_ids
        return ids

    def load_pages(self, staging: np.ndarray, page_ids: Sequence[int]):  # noqa: ANN201
        """One ``device_put`` of page-first ``staging`` (rows beyond ``len(page_ids)`` are padding), then scatter.

        ``staging`` must have a bucketed row count (``bucket(len(page_ids))``) and
        must not be modified afterwards (the copy may still be reading it).
        Returns the device staging array: ready means the link transfer landed.
        """
        import jax

        dev_staging = jax.device_put(staging, self._device) if self._device is not None else jax.device_put(staging)
        ids = self._ids(page_ids, staging.shape[0])
        self.kv = self._scatter(self.kv, dev_staging, ids)
        return dev_staging

    @property
    def compile_count(self) -> int:
        """Programs compiled so far by this pool's (backend-shared) scatter and gather."""
        return self._scatter._cache_size() + self._gather._cache_size()  # noqa: SLF001

    def warmup(self, chunk_pages: int) -> int:
        """Compile every transfer shape serving can hit: scatters and gathers of 1 ..
        ``chunk_pages`` pages in powers of two (loads and backups go in such chunks).
        Touches no page: the scattered ids are out of range.  Returns programs compiled."""
        before = self.compile_count
        n = 1
        while n <= chunk_pages:
            self.load_pages(np.zeros(self.layout.page_first_shape(n), np.dtype(self.kv.dtype)), []).block_until_ready()
            self.gather_pages([0] * n).block_until_ready()
            n *= 2
        self.kv.block_until_ready()
        return self.compile_count - before

    def load_from_host(
        self, host: HostPool, host_pages: Sequence[int], page_ids: Sequence[int], *, chunk_pages: int
    ) -> list:
        """Pipelined coalesced load of host pages ``host_pages`` into device pages ``page_ids``.

        The pages go in chunks of ``chunk_pages`` (a power of two, so staging shapes
        stay bucketed): chunk i is gathered into its own page-first staging buffer,
        handed to ``device_put`` (asynchronous: on XLA:CPU it returns in ~0.5 ms for
        4 MiB) and scattered; gathering chunk i + 1 then overlaps the copy of chunk i,
        instead of the whole host gather preceding the whole transfer.  Returns the
        device staging arrays: when all are ready the transfer has landed.
        """
        if len(host_pages) != len(page_ids):
            raise ValueError(f"{len(host_pages)} host pages but {len(page_ids)} device pages")
        if chunk_pages < 1 or chunk_pages & (chunk_pages - 1):
            raise ValueError(f"chunk_pages must be a power of two, got {chunk_pages}")
        arrays = []
        for start in range(0, len(page_ids), chunk_pages):
            rows = min(chunk_pages, len(page_ids) - start)
            staging = np.empty(self.layout.page_first_shape(bucket(rows)), dtype=host.data.dtype)
            host.read(host_pages[start : start + rows], out=staging)
            staging[rows:] = 0
            arrays.append(self.load_pages(staging, page_ids[start : start + rows]))
        return arrays

    def gather_pages(self, page_ids: Sequence[int]):  # noqa: ANN201
        """Dispatch a gather of ``page_ids`` into a page-first device array (bucketed rows; extra rows junk).

        Starts the device->host copy asynchronously; ``np.asarray(result)[:n]`` waits for it.
        """
        size = bucket(len(page_ids))
        ids = np.full((size,), 0, dtype=np.int32)
        ids[: len(page_ids)] = page_ids
        out = self._gather(self.kv, ids)
        try:
            out.copy_to_host_async()
        except Exception:  # pragma: no cover - optional on some backends
            pass
        return out
