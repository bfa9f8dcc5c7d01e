"""``CacheConfig``: sizes and policies of the three KV tiers (frozen, validated).

Every default, and why:

* ``page_size = 16`` tokens: small enough that prefixes are reused at fine
  granularity, large enough that one page is a sizeable transfer (page-first, all
  layers: ~2 MiB per page for an 8B model in bf16).
* ``device_pages``/``device_tokens``: L1 size; one of them must be set (the engine
  derives it from free HBM); ``device_tokens`` is rounded down to whole pages.
* ``hicache_ratio = 2.0``: L2 holds twice as many pages as L1 (SGLang HiCache's
  default); ``host_bytes`` (needs ``page_bytes``) overrides it.
* ``tiers = "L1+L2"``: host DRAM is always there; L3 is opt-in.
* ``write_policy = "write_through"``: back up to L2 on insert (cheap on an idle
  link, and device eviction then never waits for a copy);
  ``write_through_threshold = 2`` for ``write_through_selective``.
* ``prefetch_policy = "best_effort"``: never delay a request for storage; ``cost``
  (the engine's default): the same here, the scheduler holding the request back while
  the cost model says the rest of its prefetch lands sooner than recomputing it
  (``SchedulerConfig.wait_for_prefetch``);
  ``timeout`` waits ``prefetch_timeout_base_s + pages * prefetch_timeout_per_page_s``
  (defaults 1.0 s and 2 ms/page = ~0.125 s per 1K tokens at page 16).
* ``prefetch_min_tokens = 256``: shorter storage hits are recomputed, not fetched.
* ``storage_backend = "file"`` in ``storage_dir`` (default
  ``$XDG_CACHE_HOME/strata-jax/kv`` or ``~/.cache/strata-jax/kv``),
  ``storage_capacity_bytes = 64 GiB``; ``storage_url`` for ``redis``.
* ``storage_secret = None``: the fleet's L3 secret (at least 16 bytes).  With one, L3
  objects carry an HMAC-SHA256 tag and only tagged objects that verify are read, so a
  party that can write the directory or the Redis but lacks the secret cannot inject
  KV (``storage.py``).  None takes ``$STRATA_STORAGE_SECRET`` when the backend is
  built; prefer that variable to setting this field from a command-line flag, which
  every user sees in ``ps``.  Left out of ``repr`` (configs get logged).
* ``initial_bandwidth_bytes_per_s = 16e9`` (PCIe 4 x16 in practice) until the
  first measured load; ``bandwidth_ema = 0.2`` weight of each new measurement.
* ``io_threads = 2`` worker threads for storage reads and writes.
* ``storage_probe_ttl_s = 0.5``: how long an L3 existence probe of a waiting
  request's pages is reused (each round re-matches every waiting request; with
  Redis a probe is a network round trip).  0 probes every time.
* ``transfer_chunk_bytes = 4 MiB``: L2->L1 loads and L1->L2 backups move in chunks
  of about this size as staged (a power of two of pages, at least one; counted in the
  tier format, so a quantized chunk holds more pages and writes more into L1): the host gather of
  load chunk i + 1 overlaps the link copy of chunk i (``DevicePool.load_from_host``),
  a long node's backup never stages the whole node on the device at once, and the
  transfer programs come from a small set that warm-up compiles.
* ``kv_tier_format = "full"``: how L2 pages and L3 objects hold KV: ``full`` (the L1
  dtype, bit-identical round trips), ``fp8`` (float8 e4m3fn) or ``int8``, both with a
  float32 scale per (page, layer, K/V, KV head): about half the bytes of bf16 and a
  quarter of float32 per token in L2, on the link and in L3, at a small accuracy cost
  (outputs from a quantized tier are close to, not bit-identical with, full width;
  ``strata_jax.cache.tier_format``, docs/cache.md).  The L2 *byte* budget is the same
  whatever the format: with ``hicache_ratio`` L2 holds ratio x L1's bytes, so a
  quantized L2 holds more pages.
* ``kernel_backend = "auto"``: which ``pallas_kernels`` backend the L1 pool's page
  scatter/gather use (``auto``: Pallas on GPU, reference on CPU; see
  ``pallas_kernels.dispatch``); resolved when the pool is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # only the type: importing the config needs no jax
    from pallas_kernels.dispatch import KernelBackend

Tiers = Literal["L1", "L1+L2", "L1+L2+L3"]
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout", "cost"]
KVTierFormat = Literal["full", "fp8", "int8"]
TIERS: tuple[Tiers, ...] = get_args(Tiers)
WRITE_POLICIES: tuple[WritePolicy, ...] = get_args(WritePolicy)
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = get_args(PrefetchPolicy)
KV_TIER_FORMATS: tuple[KVTierFormat, ...] = get_args(KVTierFormat)
MIN_STORAGE_SECRET_BYTES = 16  # 128 bits: HMAC keys shorter than that are guessable


class CacheConfigError(ValueError):
    """An invalid cache setting (the message names the field)."""


def default_storage_dir() -> str:
    """``$XDG_CACHE_HOME/strata-jax/kv``, else ``~/.cache/strata-jax/kv``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "strata-jax", "kv")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    device_pages: int | None = None
    device_tokens: int | None = None
    hicache_ratio: float = 2.0
    host_bytes: int | None = None
    tiers: Tiers = "L1+L2"
    write_policy: WritePolicy = "write_through"
    write_through_threshold: int = 2
    prefetch_policy: PrefetchPolicy = "best_effort"
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_page_s: float = 0.002
    prefetch_min_tokens: int = 256
    storage_backend: str = "file"
    storage_dir: str | None = None
    storage_capacity_bytes: int = 64 << 30
    storage_url: str = "redis://127.0.0.1:6379/0"
    storage_fsync: bool = False
    # L3 authentication key; None: $STRATA_STORAGE_SECRET (preferred: a flag shows in `ps`), else none
    storage_secret: str | None = field(default=None, repr=False)
    initial_bandwidth_bytes_per_s: float = 16e9
    bandwidth_ema: float = 0.2
    io_threads: int = 2
    kv_identity: str = ""  # what the KV depends on besides tokens (the engine: weights, dtype, layout); seeds L3 keys
    transfer_chunk_bytes: int = 4 << 20
    storage_probe_ttl_s: float = 0.5
    kernel_backend: KernelBackend = "auto"
    kv_tier_format: KVTierFormat = "full"

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> CacheConfigError:
            return CacheConfigError(f"CacheConfig.{field}: {why} (got {getattr(self, field)!r})")

        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise bad("page_size", "must be a positive int")
        if self.device_pages is None and self.device_tokens is None:
            raise CacheConfigError("CacheConfig: set device_pages or device_tokens (the L1 size)")
        if self.device_pages is not None and (not isinstance(self.device_pages, int) or self.device_pages <= 0):
            raise bad("device_pages", "must be a positive int")
        if self.device_tokens is not None and (
            not isinstance(self.device_tokens, int) or self.device_tokens < self.page_size
        ):
            raise bad("device_tokens", "must be an int of at least one page")
        if self.tiers not in TIERS:
            raise bad("tiers", f"must be one of {TIERS}")
        if self.write_policy not in WRITE_POLICIES:
            raise bad("write_policy", f"must be one of {WRITE_POLICIES}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise bad("prefetch_policy", f"must be one of {PREFETCH_POLICIES}")
        if not self.hicache_ratio > 0:
            raise bad("hicache_ratio", "must be > 0")
        if self.host_bytes is not None and self.host_bytes <= 0:
            raise bad("host_bytes", "must be > 0")
        if not isinstance(self.write_through_threshold, int) or self.write_through_threshold < 1:
            raise bad("write_through_threshold", "must be an int >= 1")
        for f in ("prefetch_timeout_base_s", "prefetch_timeout_per_page_s", "prefetch_min_tokens"):
            if getattr(self, f) < 0:
                raise bad(f, "must be >= 0")
        if self.storage_capacity_bytes <= 0:
            raise bad("storage_capacity_bytes", "must be > 0")
        if not 0 < self.bandwidth_ema <= 1:
            raise bad("bandwidth_ema", "must be in (0, 1]")
        if self.initial_bandwidth_bytes_per_s <= 0:
            raise bad("initial_bandwidth_bytes_per_s", "must be > 0")
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise bad("io_threads", "must be an int >= 1")
        if not isinstance(self.transfer_chunk_bytes, int) or self.transfer_chunk_bytes < 1:
            raise bad("transfer_chunk_bytes", "must be a positive int")
        if not self.storage_probe_ttl_s >= 0:
            raise bad("storage_probe_ttl_s", "must be >= 0")
        if self.kv_tier_format not in KV_TIER_FORMATS:
            raise bad("kv_tier_format", f"must be one of {KV_TIER_FORMATS}")
        if self.storage_secret is not None and (
            not isinstance(self.storage_secret, str) or len(self.storage_secret.encode()) < MIN_STORAGE_SECRET_BYTES
        ):  # not `bad()`: the message must not echo the secret
            raise CacheConfigError(
                f"CacheConfig.storage_secret: must be a string of at least {MIN_STORAGE_SECRET_BYTES} bytes "
                "(e.g. `openssl rand -hex 32`), or None to use $STRATA_STORAGE_SECRET / run unauthenticated"
            )

    @property
    def num_device_pages(self) -> int:
        if self.device_pages is not None:
            return self.device_pages
        return self.device_tokens // self.page_size  # type: ignore[operator]  # __post_init__ requires it here

    def num_host_pages(self, page_bytes: int | None = None, device_page_bytes: int | None = None) -> int:
        """L2 pages: ``host_bytes // page_bytes`` if both known, else ratio x L1's bytes over
        ``page_bytes`` (ratio x L1's pages when the sizes are unknown or equal); 0 without L2.

        ``page_bytes``: one page in L2 (the tier format's); ``device_page_bytes``: one in L1."""
        if not self.has_host:
            return 0
        if self.host_bytes is not None:
            if page_bytes is None:
                raise CacheConfigError("CacheConfig.host_bytes needs the KV layout's page_bytes")
            return self.host_bytes // page_bytes
        if page_bytes and device_page_bytes and page_bytes != device_page_bytes:
            return int(self.num_device_pages * self.hicache_ratio * device_page_bytes // page_bytes)
        return int(self.num_device_pages * self.hicache_ratio)

    @property
    def has_host(self) -> bool:
        return self.tiers != "L1"

    @property
    def has_storage(self) -> bool:
        return self.tiers == "L1+L2+L3"

    @property
    def resolved_storage_dir(self) -> str:
        return self.storage_dir or default_storage_dir()
