"""The scheduler's starting estimate of prefill time, from the model's shape and this device.

The cost model (``strata_jax.scheduler.cost_model``) fits ``extend = a + b * tokens +
c * tokens * context`` online from measured steps, but a fresh server decides with its
prior before any step ran (whether to wait for an L3 prefetch, to load or recompute).
A fixed prior is off by orders of magnitude between an H200 and a CPU, so the engine
measures the device's matmul rate once at start-up (a few square products, ~0.1 s on a
CPU) and derives the prior from the FLOPs of the model:

* ``b``: 2 FLOPs per weight per token (attention projections and MLP, all layers);
* ``c``: 4 FLOPs per head dimension per head per layer per (token, context token) pair
  (scores and the weighted sum);
* ``a``: the LM head of one sampled row plus a millisecond of launch and host work.

It is a prior: real steps run below the matmul peak and replace it as they are observed.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from strata_jax.models.config import ModelConfig


def matmul_flops_per_s(dtype: jnp.dtype, n: int | None = None, device: jax.Device | None = None) -> float:
    """FLOP/s of an ``n x n`` matmul in ``dtype`` on ``device`` (median of 3 after a warm run)."""
    device = device or jax.devices()[0]
    n = n or (1024 if device.platform == "cpu" else 4096)
    x = jax.device_put(jnp.ones((n, n), dtype), device)
    product = jax.jit(lambda a, b: a @ b)
    product(x, x).block_until_ready()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        product(x, x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / max(statistics.median(times), 1e-9)


def extend_prior(config: ModelConfig, flops_per_s: float, tp: int = 1) -> tuple[float, float, float]:
    """``(a, b, c)`` of the extend model for ``config`` at ``flops_per_s`` per device, ``tp`` devices."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    rate = flops_per_s * max(1, tp)
    b = 2.0 * config.num_layers * per_layer / rate
    c = 4.0 * config.num_layers * q / rate
    a = 1e-3 + 2.0 * h * config.vocab_size / rate
    return a, b, c
