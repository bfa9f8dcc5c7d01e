"""Rotary position embeddings, including Llama-3 and linear frequency scaling, and per-layer
frequencies for models whose local and global layers use different rope bases (Gemma 3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies (float32, ``[head_dim // 2]``), matching HF."""
    return _scaled(_base_frequencies(config.rope_theta, config.head_dim), config)


def layer_inverse_frequencies(config: ModelConfig) -> np.ndarray | None:
    """``[num_layers, head_dim // 2]`` frequencies when layers differ (``rope_local_theta``
    set: sliding-window layers use that base, unscaled), else None (one table for all)."""
    if config.rope_local_theta is None or not config.has_sliding_window:
        return None
    local = _base_frequencies(config.rope_local_theta, config.head_dim)
    table = [local if window else inverse_frequencies(config) for window in config.layer_windows]
    return np.stack(table).astype(np.float32)


def _base_frequencies(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)


def _scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x[T, heads, head_dim]`` by its token positions (HF rotate-half convention)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    cos = jnp.cos(freqs)[:, None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
