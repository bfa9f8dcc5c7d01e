"""Rotary position embeddings: frequencies of every ``rope_type`` the config reads (default,
linear, llama3, yarn, longrope, dynamic NTK), the cos/sin factor of yarn and longrope, and
per-layer frequencies for models whose local and global layers use different rope bases
(Gemma 3).

Frequencies are computed as transformers computes them in float32 (``modeling_rope_utils``):
each float32 operation of theirs is one here, and the power ``theta ** e``, whose float32
result is not pinned down by IEEE, is taken in float64 and rounded once (torch's float32
``pow`` is correctly rounded almost everywhere; numpy's float32 one is not).

Everything is a function of a token's *position* alone, never of the length of the
sequence it is in, so a K computed once (and cached on any tier) is the K of that position
in every longer sequence: ``docs/models.md``, "Rope scaling", says where that departs from
transformers (``dynamic`` beyond the original length, ``longrope``'s short/long choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models.config import ModelConfig


@dataclass(frozen=True)
class RopeApplication:
    """What ``apply_rope`` does besides rotating by ``positions * inv_freq`` (static, hashable).

    ``attention_factor``: cos and sin are multiplied by it (yarn's mscale, longrope's
    attention factor), where transformers applies it.  ``dynamic``: ``(theta, factor,
    original_length, head_dim)`` of dynamic NTK scaling: a token at position ``p`` with
    ``p + 1 > original_length`` is rotated with the NTK base transformers uses for a sequence
    of ``p + 1`` tokens (``inv_freq`` then only serves the positions below).
    """

    attention_factor: float = 1.0
    dynamic: tuple[float, float, int, int] | None = None


def rope_application(config: ModelConfig) -> RopeApplication:
    scaling = config.rope_scaling
    dynamic = None
    if scaling.rope_type == "dynamic":
        dynamic = (config.rope_theta, scaling.factor, config.max_position_embeddings, config.head_dim)
    return RopeApplication(attention_factor=float(scaling.attention_factor), dynamic=dynamic)


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies (float32, ``[head_dim // 2]``), matching HF.  For
    ``dynamic`` these are the unscaled ones (positions below the original length)."""
    scaling = config.rope_scaling
    if scaling.rope_type == "yarn":
        return _yarn(config.rope_theta, config.head_dim, scaling)
    if scaling.rope_type == "longrope":
        return _longrope(config.rope_theta, config.head_dim, longrope_factors(config))
    return _scaled(_base_frequencies(config.rope_theta, config.head_dim), config)


def longrope_factors(config: ModelConfig) -> tuple[float, ...]:
    """The longrope divisors this model uses at every position: ``long_factor`` when the model's
    context (``max_position_embeddings``) exceeds ``original_max_position_embeddings``, else
    ``short_factor`` (vLLM's choice; transformers switches per sequence length)."""
    scaling = config.rope_scaling
    if config.max_position_embeddings > scaling.original_max_position_embeddings:
        return scaling.long_factor
    return scaling.short_factor


def layer_inverse_frequencies(config: ModelConfig) -> np.ndarray | None:
    """``[num_layers, head_dim // 2]`` frequencies when layers differ (``rope_local_theta``
    set: sliding-window layers use that base, unscaled), else None (one table for all)."""
    if config.rope_local_theta is None or not config.has_sliding_window:
        return None
    local = _base_frequencies(config.rope_local_theta, config.head_dim)
    table = [local if window else inverse_frequencies(config) for window in config.layer_windows]
    return np.stack(table).astype(np.float32)


def _exponents(dim: int) -> np.ndarray:
    """``arange(0, dim, 2).float() / dim`` in float32."""
    return np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)


def _power(theta: float, exponents: np.ndarray) -> np.ndarray:
    """float32 ``theta ** exponents`` (theta rounded to float32 first, as torch does), rounded once."""
    return (np.float64(np.float32(theta)) ** exponents.astype(np.float64)).astype(np.float32)


def _base_frequencies(theta: float, dim: int) -> np.ndarray:
    return np.float32(1.0) / _power(theta, _exponents(dim))


def _yarn(theta: float, dim: int, scaling) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters``: interpolate the low frequencies by
    ``factor``, keep the high ones, blend linearly between the correction dims of
    ``beta_fast`` / ``beta_slow`` rotations over the original length (floored / ceiled when
    ``truncate``)."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    pos_freqs = _power(theta, _exponents(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = np.float32(1.0) - ramp
    inv_freq = interpolation * (np.float32(1.0) - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32)


def _longrope(theta: float, dim: int, factors: tuple[float, ...]) -> np.ndarray:
    """transformers' ``_compute_longrope_parameters``: the base frequencies divided per pair."""
    return np.float32(1.0) / (np.asarray(factors, np.float32) * _power(theta, _exponents(dim)))


def _scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
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


def dynamic_inverse_frequencies(
    positions: jax.Array, inv_freq: jax.Array, dynamic: tuple[float, float, int, int]
) -> jax.Array:
    """``[T, head_dim // 2]`` frequencies of dynamic NTK scaling, one row per token: the
    unscaled ``inv_freq`` up to the original length, beyond it transformers' NTK base for a
    sequence ending at the token (``seq_len = position + 1``), in float32 as transformers
    computes it (``_compute_dynamic_ntk_parameters``)."""
    theta, factor, original, dim = dynamic
    seq_len = jnp.maximum(positions.astype(jnp.int32) + 1, original).astype(jnp.float32)
    ratio = (jnp.float32(factor) * seq_len) / jnp.float32(original) - jnp.float32(factor - 1)
    base = jnp.float32(theta) * ratio ** jnp.float32(dim / (dim - 2))  # [T]
    scaled = 1.0 / (base[:, None] ** jnp.asarray(_exponents(dim))[None, :])
    beyond = (positions.astype(jnp.int32) + 1 > original)[:, None]
    return jnp.where(beyond, scaled, inv_freq[None, :])


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: jax.Array, rope: RopeApplication = RopeApplication()
) -> jax.Array:
    """Rotate ``x[T, heads, head_dim]`` by its token positions (HF rotate-half convention);
    cos and sin carry ``rope.attention_factor`` as transformers' do."""
    if rope.dynamic is not None:
        freqs = positions.astype(jnp.float32)[:, None] * dynamic_inverse_frequencies(positions, inv_freq, rope.dynamic)
    else:
        freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if rope.attention_factor != 1.0:
        cos, sin = cos * jnp.float32(rope.attention_factor), sin * jnp.float32(rope.attention_factor)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
