"""KV pools: the layer-first device pool (L1, a jax array) and the page-first host pool (L2, numpy).

Layouts are the ``pallas_kernels.layout`` contract.  The pools hold data only;
which page belongs to whom is the allocators' and the tree's business.

* ``DevicePool.kv`` is updated in place: every writer (the runner's jitted step,
  ``load_pages``) *donates* it and stores the result back in ``kv``.
  Reads (``gather_pages``) are ordered before later writes by JAX's data flow, so
  a device page may be freed as soon as a gather out of it is dispatched.
* Under tensor parallelism the device pool is split on its KV-head axis (each device
  moves its own heads of a page); host pages and L3 objects stay whole pages in the
  page-first layout, so they are the same bytes whatever the tp size.
* ``HostPool.data`` is plain numpy ``[num_pages, L, 2, page_size, H, D]`` (pinned
  host memory on GPU is future work, see docs/cache.md); one page is one
  contiguous block.
* Tier formats (``strata_jax.cache.tier_format``): with a quantized format (``fp8``,
  ``int8``) ``HostPool.data`` holds the 8-bit values and ``HostPool.scales[num_pages,
  L, 2, H]`` (float32) their scales; the device pool quantizes right after the page
  gather of a backup (``gather_tier``: the device->host copy carries the small
  format) and dequantizes inside the scatter of a load (``load_tier``), both in
  ``pallas_kernels.quant_transfer``.  No pass over host memory converts anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from pallas_kernels.layout import GroupedPoolLayout, KVLayout
from strata_jax.cache.local_pages import DeviceLocalPages
from strata_jax.cache.tier_format import TierFormat

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jax.stages import Wrapped

    from strata_jax.cache.host_grouped import GroupedHostPool


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
    return (
        len(pages) > 0
        and pages[-1] - pages[0] == len(pages) - 1
        and all(pages[i + 1] == pages[i] + 1 for i in range(len(pages) - 1))
    )


def numpy_dtype(name: str) -> np.dtype[Any]:
    """NumPy dtype of a KV dtype name (bfloat16 and float8_e4m3fn come from ml_dtypes)."""
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        dtype: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))  # typed here: ml_dtypes has no annotations
        return dtype
    return np.dtype(name)


class HostPool:
    """Page-first L2 pool in host memory, in a tier format (default: full width, the layout's dtype).

    ``data[P, L, 2, S, H, D]`` in the format's element dtype; ``scales[P, L, 2, H]`` (float32)
    for a quantized format, else ``None``."""

    def __init__(self, layout: KVLayout, num_pages: int, tier_format: TierFormat | None = None) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.format = tier_format or TierFormat.resolve("full", layout.dtype)
        self.data: np.ndarray = np.zeros(
            layout.page_first_shape(num_pages), dtype=numpy_dtype(self.format.element_dtype)
        )
        self.scales: np.ndarray | None = (
            np.ones((num_pages, layout.num_layers, 2, layout.num_kv_heads), np.float32)
            if self.format.quantized
            else None
        )

    @classmethod
    def from_array(
        cls, layout: KVLayout, data: np.ndarray, scales: np.ndarray | None = None, tier_format: TierFormat | None = None
    ) -> HostPool:
        """A pool over an existing page-first array (no copy), e.g. a benchmark's host pages
        (with ``scales`` and a quantized ``tier_format`` for quantized pages)."""
        if data.ndim != 6 or tuple(data.shape[1:]) != tuple(layout.page_first_shape(1)[1:]):
            raise ValueError(f"host array shape {data.shape} does not match the layout's page shape")
        pool = cls.__new__(cls)
        pool.layout, pool.num_pages, pool.data = layout, data.shape[0], data
        pool.format = tier_format or TierFormat.resolve("full", layout.dtype)
        if pool.format.quantized != (scales is not None):
            raise ValueError(
                f"tier format {pool.format.name} {'needs' if pool.format.quantized else 'takes no'} scales"
            )
        pool.scales = scales
        return pool

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype

    def read_layers(self, pages: Sequence[int], layers: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``layers`` of ``pages`` into ``out[:n]`` (a device pool with layer groups loads its
        global and local layers apart)."""
        out[: len(pages)] = self.data[np.ix_(np.asarray(pages, np.int64), layers)]
        return out

    def read_layer_scales(self, pages: Sequence[int], layers: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.scales is None:
            raise ValueError("a full-width host pool has no scales")
        out[: len(pages)] = self.scales[np.ix_(np.asarray(pages, np.int64), layers)]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (values and scales)."""
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in this pool (values and scales): ``nbytes / num_pages``."""
        return self.format.page_bytes(self.layout)

    @property
    def bytes_per_token(self) -> float:
        return self.page_bytes / self.layout.page_size

    def read_scales(self, pages: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Scales of ``pages`` as ``[n, L, 2, H]`` (a quantized pool only); a copy, or into ``out[:n]``."""
        if self.scales is None:
            raise ValueError("a full-width host pool has no scales")
        idx = np.asarray(pages, dtype=np.int64)
        if out is None:
            return self.scales[idx]
        np.take(self.scales, idx, axis=0, out=out[: len(idx)])
        return out

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

    def write(self, pages: Sequence[int], values: np.ndarray, scales: np.ndarray | None = None) -> None:
        """Store ``values[:len(pages)]`` (page-first, the pool's element dtype) into ``pages``,
        and their ``scales[:len(pages)]`` (required by a quantized pool, refused by a full one)."""
        n = len(pages)
        pool_scales = self.scales
        if (scales is not None) != (pool_scales is not None):
            raise ValueError(f"tier format {self.format.name}: scales {'missing' if scales is None else 'unexpected'}")
        # past that check scales and pool_scales are both set or both None
        if _is_run(pages):
            self.data[pages[0] : pages[0] + n] = values[:n]
            if scales is not None and pool_scales is not None:
                pool_scales[pages[0] : pages[0] + n] = scales[:n]
        else:
            idx = np.asarray(pages, dtype=np.int64)
            self.data[idx] = values[:n]
            if scales is not None and pool_scales is not None:
                pool_scales[idx] = scales[:n]


_JITTED: dict[tuple[str, NamedSharding | None, str, bool], tuple[Wrapped, Wrapped]] = {}


def _jitted_transfers(
    backend: str, sharding: NamedSharding | None = None, tier_format: str = "full", grouped: bool = False
) -> tuple[Wrapped, Wrapped]:
    """The jitted scatter (pool donated) and gather for a concrete kernel backend, shared
    by every pool using it (one compile per shape and backend).

    ``tier_format`` ``"fp8"`` / ``"int8"``: the scatter takes ``(pool, q, scales, ids)`` and
    dequantizes while scattering, the gather returns ``(q, scales)`` quantized right after
    the gather (``pallas_kernels.quant_transfer``); ``"full"``: plain page moves.

    With a head-sharded ``sharding`` (tensor parallelism, ``strata_jax.runtime.sharding``)
    pool, staging and gathered pages are split on the KV heads and the kernels run per
    shard (``pallas_kernels.sharded``): each device scatters / gathers only its heads
    (scales: their axis 3).

    ``grouped``: the pool has layer groups (``pallas_kernels.grouped``, XLA on every
    platform) and ``ids`` are rows ``[n, L]`` (``GroupedPoolLayout.rows``).
    """
    key = (backend, sharding, tier_format, grouped)
    if key not in _JITTED:  # a cache of compiled functions, not state: pools stay independent
        import pallas_kernels
        from pallas_kernels import grouped as moves
        from pallas_kernels import quant_transfer
        from pallas_kernels.sharded import use_head_sharding

        # the sharding places the pool's arrays, so its mesh is a concrete Mesh, not an AbstractMesh
        mesh = cast("Mesh", sharding.mesh) if sharding is not None else None

        def scatter_full(pool: jax.Array, staging: jax.Array, ids: jax.Array) -> jax.Array:
            with use_head_sharding(mesh):
                if grouped:
                    return moves.scatter_pages_grouped(pool, staging, ids)
                return pallas_kernels.scatter_pages(pool, staging, ids, backend=backend)

        def gather_full(pool: jax.Array, ids: jax.Array) -> jax.Array:
            with use_head_sharding(mesh):
                if grouped:
                    return moves.gather_pages_grouped(pool, ids)
                return pallas_kernels.gather_pages(pool, ids, backend=backend)

        def scatter_quantized(pool: jax.Array, q: jax.Array, scales: jax.Array, ids: jax.Array) -> jax.Array:
            with use_head_sharding(mesh):
                if grouped:
                    return moves.scatter_dequantize_grouped(pool, q, scales, ids)
                return quant_transfer.scatter_dequantize(pool, q, scales, ids, backend=backend)

        def gather_quantized(pool: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
            with use_head_sharding(mesh):
                if grouped:
                    return moves.gather_quantize_grouped(pool, ids, tier_format)
                return quant_transfer.gather_quantize(pool, ids, tier_format, backend=backend)

        scatter: Callable[..., jax.Array]
        gather: Callable[..., jax.Array | tuple[jax.Array, jax.Array]]
        if tier_format == "full":
            scatter, gather = scatter_full, gather_full
        else:
            scatter, gather = scatter_quantized, gather_quantized

        _JITTED[key] = _jit_pair(scatter, gather, sharding, tier_format)
    return _JITTED[key]


def _jit_pair(
    scatter: Callable[..., Any], gather: Callable[..., Any], sharding: NamedSharding | None, tier_format: str
) -> tuple[Wrapped, Wrapped]:
    """``scatter`` (pool donated) and ``gather`` jitted, placed by ``sharding`` when there is one:
    pool, staging and gathered pages on it, page ids replicated, scales on their own axis."""
    import jax

    if sharding is None:
        return jax.jit(scatter, donate_argnums=0), jax.jit(gather)
    ids = jax.sharding.NamedSharding(sharding.mesh, _partition_spec())
    if tier_format == "full":
        return (
            jax.jit(scatter, donate_argnums=0, in_shardings=(sharding, sharding, ids), out_shardings=sharding),
            jax.jit(gather, in_shardings=(sharding, ids), out_shardings=sharding),
        )
    scales = scale_sharding(sharding)
    return (
        jax.jit(scatter, donate_argnums=0, in_shardings=(sharding, sharding, scales, ids), out_shardings=sharding),
        jax.jit(gather, in_shardings=(sharding, ids), out_shardings=(sharding, scales)),
    )


def _partition_spec(*parts: str | None) -> PartitionSpec:
    """``jax.sharding.PartitionSpec(*parts)`` (``None``: that axis is not split)."""
    import jax

    return jax.sharding.PartitionSpec(*parts)  # type: ignore[no-untyped-call]  # jax leaves P.__new__ unannotated


def scale_sharding(pool_sharding: NamedSharding) -> NamedSharding:
    """Sharding of page-first scales ``[n, L, 2, H]`` matching a pool sharded on its head axis 4."""
    import jax

    spec = tuple(pool_sharding.spec) + (None,) * (6 - len(pool_sharding.spec))
    return jax.sharding.NamedSharding(pool_sharding.mesh, _partition_spec(None, None, None, spec[4]))


class DevicePool:
    """Layer-first L1 pool ``kv[L, 2, num_pages, S, H, D]`` with donated page transfers;
    with ``grouped`` (``GroupedPoolLayout``) the pool has layer groups,
    ``kv[1, 2, rows, S, H, D]``, and the same page-first moves (``pallas_kernels.grouped``).

    ``device``: a device, or a sharding; a ``NamedSharding`` splitting axis 4 (the KV
    heads) over a ``tp`` mesh axis (``strata_jax.runtime.sharding.pool_sharding``)
    makes a tensor-parallel pool: each device holds its heads of every page, a load
    ``device_put``s a whole-page staging buffer with the same sharding (each device
    receives its heads' bytes only) and a backup's gather comes back as whole pages.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: jax.Device | jax.sharding.Sharding | None = None,
        *,
        kernel_backend: str = "auto",
        tier_format: TierFormat | None = None,
        grouped: GroupedPoolLayout | None = None,
    ) -> None:
        import jax
        import jax.numpy as jnp

        import pallas_kernels

        self.layout = layout
        self.num_pages = num_pages
        self._device = device
        if grouped is not None and (grouped.layout != layout or grouped.global_pages != num_pages):
            raise ValueError(f"grouped layout {grouped} does not match {layout} with {num_pages} pages")
        self.grouped = grouped
        # local-layer pages of a grouped pool: they follow the global pages' allocator (controller)
        self.local = DeviceLocalPages(num_pages, grouped.local_pages) if grouped is not None else None
        shape = grouped.pool_shape() if grouped is not None else layout.device_pool_shape(num_pages)
        self.kv: jax.Array
        if isinstance(device, jax.sharding.Sharding):  # allocated in place, shard by shard
            self.kv = jax.jit(lambda: jnp.zeros(shape, dtype=layout.dtype), out_shardings=device)()
        else:
            kv = jnp.zeros(shape, dtype=layout.dtype)
            self.kv = jax.device_put(kv, device) if device is not None else kv

        # Resolved now (argument, then $STRATA_KERNEL_BACKEND, then platform) and fixed for the pool's life.
        self.kernel_backend = pallas_kernels.resolve_backend(kernel_backend)
        head_sharded = isinstance(device, jax.sharding.NamedSharding) and len(device.mesh.devices.flat) > 1
        sharding = device if isinstance(device, jax.sharding.NamedSharding) and head_sharded else None
        is_grouped = grouped is not None
        self._scatter, self._gather = _jitted_transfers(self.kernel_backend, sharding, grouped=is_grouped)
        # The format of L2/L3 (what backups produce and loads consume); full width: the plain moves.
        self.tier_format = tier_format or TierFormat.resolve("full", layout.dtype)
        if self.tier_format.quantized:
            self._scatter_tier, self._gather_tier = _jitted_transfers(
                self.kernel_backend, sharding, self.tier_format.name, grouped=is_grouped
            )
            self._scale_device: jax.Device | jax.sharding.Sharding | None = (
                scale_sharding(device) if isinstance(device, jax.sharding.NamedSharding) else device
            )
        else:
            self._scatter_tier, self._gather_tier = self._scatter, self._gather
        # What crossed the host<->device link in the tier format (values + scales of the pages
        # named; bucket padding rows not counted): load_from_host in, gather_tier out.
        self.moved = {"loaded_pages": 0, "loaded_bytes": 0, "backed_up_pages": 0, "backed_up_bytes": 0}

    def _ids(
        self, page_ids: Sequence[int], size: int, padding: int | None = None, layers: np.ndarray | None = None
    ) -> np.ndarray:
        """The scatter's / gather's targets of ``page_ids`` padded to ``size`` (default padding:
        out of range, dropped by a scatter): page ids, or with layer groups rows ``[size, L]``
        (local layers at the pages' local ids; ``layers``: those columns only)."""
        ids = np.full((size,), self.num_pages if padding is None else padding, dtype=np.int32)
        ids[: len(page_ids)] = page_ids
        if self.grouped is None or self.local is None:  # grouped and local are set together
            return ids
        rows = self.grouped.rows(ids, self.local.local_ids(ids))
        return rows if layers is None else np.ascontiguousarray(rows[:, layers])

    def load_pages(self, staging: np.ndarray, page_ids: Sequence[int], layers: np.ndarray | None = None) -> jax.Array:
        """One ``device_put`` of page-first ``staging`` (rows beyond ``len(page_ids)`` are padding), then scatter.

        ``staging`` must have a bucketed row count (``bucket(len(page_ids))``) and
        must not be modified afterwards (the copy may still be reading it).
        Returns the device staging array: ready means the link transfer landed.
        ``layers`` (a pool with layer groups): ``staging`` holds those layers only.
        """
        import jax

        dev_staging: jax.Array = (
            jax.device_put(staging, self._device) if self._device is not None else jax.device_put(staging)
        )
        ids = self._ids(page_ids, staging.shape[0], layers=layers)
        self.kv = self._scatter(self.kv, dev_staging, ids)
        return dev_staging

    def load_tier(
        self, staging: np.ndarray, scales: np.ndarray | None, page_ids: Sequence[int], layers: np.ndarray | None = None
    ) -> jax.Array:
        """``load_pages`` in the tier format: one ``device_put`` of the page-first values (and,
        quantized, their scales ``[n, L, 2, H]``), then one scatter that dequantizes to the
        pool's dtype as it writes.  Returns the device values array (ready: landed)."""
        if not self.tier_format.quantized:
            return self.load_pages(staging, page_ids, layers)
        import jax

        dev_staging: jax.Array
        dev_scales: jax.Array
        if self._device is not None:
            dev_staging, dev_scales = jax.device_put((staging, scales), (self._device, self._scale_device))
        else:
            dev_staging, dev_scales = jax.device_put((staging, scales))
        ids = self._ids(page_ids, staging.shape[0], layers=layers)
        self.kv = self._scatter_tier(self.kv, dev_staging, dev_scales, ids)
        return dev_staging

    @property
    def compile_count(self) -> int:
        """Programs compiled so far by this pool's (backend-shared) scatter and gather."""
        fns = {id(f): f for f in (self._scatter, self._gather, self._scatter_tier, self._gather_tier)}
        return sum(f._cache_size() for f in fns.values())  # type: ignore[attr-defined]  # jit's private counter

    def warmup(self, chunk_pages: int) -> int:
        """Compile every transfer shape serving can hit: scatters and gathers of 1 ..
        ``chunk_pages`` pages in powers of two (loads and backups go in such chunks), in the
        tier format.  Touches no page: the scattered ids are out of range.  Returns programs compiled."""
        before = self.compile_count
        moved = dict(self.moved)  # warm-up moves no real page
        fmt = self.tier_format
        # a pool with layer groups loads and backs up its global and its local layers apart
        # (load_from_host; an L2 with layer groups), when it has local layers
        groups: list[np.ndarray | None] = [None]
        if self.grouped is not None and any(self.grouped.local_layers):
            local = np.asarray(self.grouped.local_layers)
            groups = [g for g in (np.flatnonzero(~local), np.flatnonzero(local)) if len(g)]
        n = 1
        while n <= chunk_pages:
            shape = self.layout.page_first_shape(n)
            for layers in groups:
                num_layers = self.layout.num_layers if layers is None else len(layers)
                values = np.zeros((n, num_layers, *shape[2:]), numpy_dtype(fmt.element_dtype))
                scales = np.ones((n, num_layers, 2, self.layout.num_kv_heads), np.float32) if fmt.quantized else None
                self.load_tier(values, scales, [], layers).block_until_ready()
            for layers in groups:
                for array in self.gather_tier([0] * n, layers):
                    array.block_until_ready()
            n *= 2
        self.kv.block_until_ready()
        self.moved = moved
        return self.compile_count - before

    def load_from_host(
        self,
        host: HostPool | GroupedHostPool,
        host_pages: Sequence[int],
        page_ids: Sequence[int],
        *,
        chunk_pages: int,
        with_local: Sequence[bool] | None = None,
    ) -> list[jax.Array]:
        """Pipelined coalesced load of host pages ``host_pages`` into device pages ``page_ids``.

        The pages go in chunks of ``chunk_pages`` (a power of two, so staging shapes
        stay bucketed): chunk i is gathered into its own page-first staging buffer,
        handed to ``device_put`` (asynchronous: on XLA:CPU it returns in ~0.5 ms for
        4 MiB) and scattered; gathering chunk i + 1 then overlaps the copy of chunk i,
        instead of the whole host gather preceding the whole transfer.  Returns the
        device staging arrays: when all are ready the transfer has landed.

        A pool with layer groups moves the global layers' KV of every page and the local
        layers' KV of the pages ``with_local`` names (default: those with a local page):
        the window a match end needs, not the whole prefix (local layers attend only inside it).
        """
        if len(host_pages) != len(page_ids):
            raise ValueError(f"{len(host_pages)} host pages but {len(page_ids)} device pages")
        if chunk_pages < 1 or chunk_pages & (chunk_pages - 1):
            raise ValueError(f"chunk_pages must be a power of two, got {chunk_pages}")
        if host.format != self.tier_format:
            raise ValueError(
                f"host pool format {host.format.describe()} != device pool tier format {self.tier_format.describe()}"
            )
        if self.grouped is None or self.local is None:  # grouped and local are set together
            if with_local is not None:
                raise ValueError("with_local is for a pool with layer groups")
            return self._load_layers(host, list(host_pages), list(page_ids), None, chunk_pages)
        if with_local is None:
            with_local = [self.local.has(p) for p in page_ids]
        local = np.asarray(self.grouped.local_layers)
        global_layers, local_layers = np.flatnonzero(~local), np.flatnonzero(local)
        arrays: list[jax.Array] = []
        if len(global_layers):
            arrays += self._load_layers(host, list(host_pages), list(page_ids), global_layers, chunk_pages)
        picked = [i for i, keep in enumerate(with_local) if keep]
        if len(local_layers) and picked:
            arrays += self._load_layers(
                host,
                [host_pages[i] for i in picked],
                [page_ids[i] for i in picked],
                local_layers,
                chunk_pages,
                count_pages=False,
            )
        return arrays

    def _load_layers(
        self,
        host: HostPool | GroupedHostPool,
        host_pages: list[int],
        page_ids: list[int],
        layers: np.ndarray | None,
        chunk_pages: int,
        *,
        count_pages: bool = True,
    ) -> list[jax.Array]:
        """``load_from_host``'s chunks, of every layer or (a pool with layer groups) of ``layers`` only."""
        quantized = self.tier_format.quantized
        arrays: list[jax.Array] = []
        num_layers = self.layout.num_layers if layers is None else len(layers)
        for start in range(0, len(page_ids), chunk_pages):
            rows = min(chunk_pages, len(page_ids) - start)
            size = bucket(rows)
            shape = self.layout.page_first_shape(size)
            staging = np.empty((size, num_layers, *shape[2:]), dtype=host.dtype)
            pages = host_pages[start : start + rows]
            if layers is None:
                host.read(pages, out=staging)  # type: ignore[call-arg]  # no layer groups: a HostPool
            else:
                host.read_layers(pages, layers, out=staging)
            staging[rows:] = 0
            scales = None
            if quantized:  # a few bytes per page: one small copy beside the values
                scales = np.ones((size, num_layers, 2, self.layout.num_kv_heads), np.float32)
                if layers is None:
                    host.read_scales(pages, out=scales)  # type: ignore[call-arg]  # no layer groups: a HostPool
                else:
                    host.read_layer_scales(pages, layers, out=scales)
            arrays.append(self.load_tier(staging, scales, page_ids[start : start + rows], layers))
            self.moved["loaded_pages"] += rows if count_pages else 0
            self.moved["loaded_bytes"] += rows * (staging.nbytes + (scales.nbytes if scales is not None else 0)) // size
        return arrays

    def gather_pages(self, page_ids: Sequence[int], layers: np.ndarray | None = None) -> jax.Array:
        """Dispatch a gather of ``page_ids`` into a page-first device array (bucketed rows; extra rows junk).
        ``layers`` (a pool with layer groups): those layers only.

        Starts the device->host copy asynchronously; ``np.asarray(result)[:n]`` waits for it.
        """
        out: jax.Array = self._gather(self.kv, self._ids(page_ids, bucket(len(page_ids)), padding=0, layers=layers))
        try:
            out.copy_to_host_async()
        except Exception:  # pragma: no cover - optional on some backends
            pass
        return out

    def gather_tier(
        self, page_ids: Sequence[int], layers: np.ndarray | None = None, *, count_pages: bool = True
    ) -> tuple[jax.Array, ...]:
        """A backup's gather in the tier format: ``(values,)`` for full width, ``(q, scales)``
        quantized on the device right after the gather, so the device->host copy (started
        here, asynchronously) moves the small format.  Bucketed rows; extra rows junk.
        ``layers`` (a pool with layer groups): those layers only (an L2 with layer groups
        backs up a page's global layers, and its local ones only where it keeps them)."""
        share = 1.0 if layers is None else len(layers) / self.layout.num_layers
        self.moved["backed_up_pages"] += len(page_ids) if count_pages else 0
        self.moved["backed_up_bytes"] += round(len(page_ids) * self.tier_format.page_bytes(self.layout) * share)
        if not self.tier_format.quantized:
            return (self.gather_pages(page_ids, layers),)
        out: tuple[jax.Array, jax.Array] = self._gather_tier(
            self.kv, self._ids(page_ids, bucket(len(page_ids)), padding=0, layers=layers)
        )
        for array in out:
            try:
                array.copy_to_host_async()
            except Exception:  # pragma: no cover - optional on some backends
                pass
        return tuple(out)
