"""``strata-jax simulate --calibrate PATH``: measure this machine and write a hardware profile.

Measured with jax on the default device (on this project's own code paths where
one exists):

* link, coalesced: ``DevicePool.load_from_host`` (the engine's L2->L1 load) of 256
  scattered pages of a Llama-3.1-8B-shaped layout at page size 32 (layers cut to 8
  to bound memory); ``coalesced_efficiency`` = that over the peak, where the peak is
  one contiguous ``device_put`` of the same bytes;
* link, naive: one ``device_put`` per page per layer of one K (or V) block, the
  naive path's unit; ``naive_copy_overhead_s`` = per-copy time minus bytes / peak;
* matmul: a jitted square matmul (``matmul_efficiency`` = 1: the rate is what the
  kernels reach); HBM: a jitted elementwise pass over a large array.  On a CPU a
  1024^2 float32 product and 64 MiB, one call per timing; on an accelerator an 8192^2
  product and 1 GiB (smaller ones finish in microseconds: launch overhead, and an array
  that fits the GPU's L2 cache), each timing ``ACCEL_CALLS`` calls back to back;
* ``hbm_bytes`` from the device's memory stats when it reports them.

Everything else (attention efficiency, overheads, host and storage sizes) is kept
from the base profile (``--profile``) and named in ``notes``.  On a CPU the
"device" is host memory, so the numbers describe memcpy, not a GPU link.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from strata_jax.sim.profile import HardwareProfile

if TYPE_CHECKING:
    import jax


def _median(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


ACCEL_CALLS = 10  # back-to-back calls per matmul / bandwidth timing off a CPU (launch overhead amortised)


def _calls(fn: Callable[[], jax.Array], n: int) -> Callable[[], None]:
    """``n`` (at least 1) calls of ``fn`` back to back, the last waited for."""

    def run() -> None:
        out = fn()
        for _ in range(n - 1):
            out = fn()
        out.block_until_ready()

    return run


def calibrate(base: HardwareProfile, *, progress: bool = True) -> HardwareProfile:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.layout import KVLayout
    from strata_jax.cache.pools import DevicePool, HostPool, chunk_pages_for

    say = print if progress else (lambda *a, **k: None)
    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    dtype = "float32" if on_cpu else "bfloat16"
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_size=32, dtype=dtype)
    n = 256
    say(f"calibrating on {dev.device_kind} ({dev.platform}): link ...")
    host = HostPool(layout, 2 * n)
    pool = DevicePool(layout, 2 * n, dev)
    rng = np.random.default_rng(0)
    host_pages = sorted(rng.choice(2 * n, n, replace=False).tolist())
    dev_pages = rng.choice(2 * n, n, replace=False).tolist()
    chunk = chunk_pages_for(layout.page_bytes, 4 << 20)
    pool.warmup(chunk)

    def coalesced() -> None:
        for a in pool.load_from_host(host, host_pages, dev_pages, chunk_pages=chunk):
            a.block_until_ready()

    nbytes = n * layout.page_bytes
    flat = np.zeros(nbytes // np.dtype(host.data.dtype).itemsize, host.data.dtype)
    coalesced()
    t_coalesced = _median(coalesced)
    t_peak = _median(lambda: jax.device_put(flat, dev).block_until_ready())
    peak = nbytes / t_peak
    block = np.zeros((layout.page_size, layout.num_kv_heads, layout.head_dim), host.data.dtype)
    copies = 512

    def naive() -> None:
        out = [jax.device_put(block, dev) for _ in range(copies)]
        out[-1].block_until_ready()

    naive()
    t_copy = _median(naive) / copies
    say("matmul ...")
    size, big_bytes, calls = (1024, 64 << 20, 1) if on_cpu else (8192, 1 << 30, ACCEL_CALLS)
    a = jnp.ones((size, size), jnp.dtype(dtype))
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    t_mm = _median(_calls(lambda: mm(a), calls)) / calls
    say("memory bandwidth ...")
    big = jnp.ones(big_bytes // 4, jnp.float32)
    ew = jax.jit(lambda x: x * 2.0 + 1.0)
    ew(big).block_until_ready()
    t_ew = _median(_calls(lambda: ew(big), calls)) / calls
    stats = dev.memory_stats() or {}
    return replace(
        base,
        name=f"calibrated: {dev.device_kind} ({dev.platform})",
        hbm_bytes=float(stats.get("bytes_limit", base.hbm_bytes)),
        hbm_bytes_per_s=2 * big.nbytes / t_ew,
        hbm_efficiency=1.0,
        matmul_flops_per_s=2 * size**3 / t_mm,
        matmul_efficiency=1.0,
        attention_efficiency=min(1.0, base.attention_efficiency / base.matmul_efficiency),
        link_peak_bytes_per_s=peak,
        naive_copy_overhead_s=max(0.0, t_copy - block.nbytes / peak),
        coalesced_efficiency=min(1.0, nbytes / t_coalesced / peak),
        notes=(
            "Measured by strata-jax simulate --calibrate: link peak (one contiguous device_put of "
            f"{nbytes >> 20} MiB), coalesced load (DevicePool.load_from_host, {n} scattered pages), naive copy "
            f"({block.nbytes >> 10} KiB device_puts), {size}^2 {dtype} matmul, elementwise pass over "
            f"{big_bytes >> 20} MiB. Kept from '{base.name}': "
            "attention/matmul ratio, overheads, slowdown, host and storage sizes, TP all-reduce."
        ),
    )
