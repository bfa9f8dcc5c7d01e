"""The scheduler's starting estimate of prefill time, from the model's shape and this device.

The cost model (``strata_jax.scheduler.cost_model``) fits ``extend = a + b * tokens +
c * tokens * context`` online from measured steps, but a fresh server decides with its
prior before any step ran (whether to wait for an L3 prefetch, to load or recompute).
A fixed prior is off by orders of magnitude between an H200 and a CPU, so the first
engine of a process measures the device's matmul rate (a few square products, ~0.1 s on
a CPU; later engines reuse it) and derives the prior from the model's FLOPs, counted by
the functions below (``bench prefill`` counts with them too):

* ``b``: 2 FLOPs per weight per token (attention projections and MLP, all layers); of a
  mixture-of-experts MLP the weights a token multiplies: the router, its
  ``num_experts_per_tok`` experts and the shared expert with its gate, not the experts it
  did not pick (the engine's ``MoEBlock`` runs a token through its own experts only);
* ``c``: 4 FLOPs per head dimension per head per layer per (token, context token) pair
  (scores and the weighted sum);
* ``a``: the LM head of one sampled row plus a millisecond of launch and host work.

It is a prior: real steps run below the matmul peak and replace it as they are observed.
"""

from __future__ import annotations

import functools
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


@functools.cache
def device_matmul_rate(dtype_name: str) -> float:
    """``matmul_flops_per_s`` on the first device, measured once per process and dtype (a
    property of the machine: every engine of a process starts from the same figure)."""
    return matmul_flops_per_s(jnp.dtype(dtype_name))


# ---------------------------------------------------------------------------- model FLOPs
def projection_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of the linear projections of every layer over ``tokens`` tokens: q, k, v, o and
    gate, up, down (2 per multiply-add; no attention scores, no LM head, no biases).  A
    mixture-of-experts MLP (``config.moe``) counts what a token multiplies (``mlp_macs``), on
    its sparse layers (``layer_is_sparse``; the others are dense MLPs)."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sparse = sum(config.layer_is_sparse)
    dense_macs = 3 * h * config.intermediate_size
    mlps = sparse * mlp_macs(config) + (config.num_layers - sparse) * dense_macs
    return 2.0 * tokens * (config.num_layers * (h * q + 2 * h * kv + q * h) + mlps)


def mlp_macs(config: ModelConfig) -> int:
    """Multiply-adds of one (sparse, if the model has experts) layer's MLP for one token:
    ``3 h I`` dense; with experts the router (``h E``), the ``k`` picked experts (``3 h F``
    each) and the shared expert and its gate (``3 h S + h`` when ``S > 0``)."""
    h, m = config.hidden_size, config.moe
    if m is None:
        return 3 * h * config.intermediate_size
    shared = 3 * h * m.shared_expert_intermediate_size + (h if m.shared_expert_intermediate_size else 0)
    return h * m.num_experts + m.num_experts_per_tok * 3 * h * m.expert_intermediate_size + shared


def attention_flops(config: ModelConfig, start: int, tokens: int) -> float:
    """Causal attention FLOPs of ``tokens`` new tokens after ``start`` cached ones, every layer:
    token ``i`` scores and weights ``i + 1`` keys (QK^T and PV, 2 FLOPs per multiply-add per
    head dimension of every query head).  The work any implementation must do; the reference
    also scores the keys a token cannot see (masked), which this does not count."""
    pairs = tokens * start + tokens * (tokens + 1) // 2
    return 4.0 * pairs * config.num_heads * config.head_dim * config.num_layers


def lm_head_flops(config: ModelConfig, rows: int) -> float:
    return 2.0 * rows * config.hidden_size * config.vocab_size


def extend_prior(config: ModelConfig, flops_per_s: float, tp: int = 1) -> tuple[float, float, float]:
    """``(a, b, c)`` of the extend model for ``config`` at ``flops_per_s`` per device, ``tp`` devices."""
    rate = flops_per_s * max(1, tp)
    b = projection_flops(config, 1) / rate
    c = attention_flops(config, 0, 1) / rate  # one (token, context token) pair
    a = 1e-3 + lm_head_flops(config, 1) / rate
    return a, b, c
