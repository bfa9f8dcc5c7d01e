"""Token sampling on device: greedy, temperature, top-k, top-p, per-request PRNG keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array
) -> jax.Array:
    """Pick one token per row of ``logits[B, V]`` (float32).

    temperature[B] == 0 selects argmax; top_k[B] == 0 and top_p[B] == 1 disable
    those filters; keys[B, 2] (uint32 raw PRNG keys) make sampling reproducible per
    request.  Ties in greedy decoding resolve to the lowest id (as ``argmax``).
    A batch with no sampling row skips the filters' vocabulary-wide sort (a
    ``lax.cond``): the same tokens, without the sort's cost on greedy batches.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    any_sampled = jnp.any(temperature > 0)
    return jax.lax.cond(
        any_sampled,
        lambda: jnp.where(temperature > 0, _sample_filtered(logits, temperature, top_k, top_p, keys), greedy),
        lambda: greedy,
    )


def _sample_filtered(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array
) -> jax.Array:
    """Temperature, top-k and top-p filtering, then a Gumbel-max draw per row.

    The filters need the vocabulary sorted (on CPU a sort of a 49K vocabulary costs more
    than a small model's whole decode step), so a batch where no row filters skips it.
    """
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(jax.random.wrap_key_data(key), (vocab,)))(keys)
    any_filter = jnp.any((top_k > 0) & (top_k < vocab)) | jnp.any(top_p < 1.0)
    filtered = jax.lax.cond(any_filter, lambda: _filter_top_k_top_p(scaled, top_k, top_p), lambda: scaled)
    return jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``scaled`` with every logit outside a row's top-k and top-p set to -inf."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_logits, axis=-1)
    cumulative = jnp.cumsum(probs_sorted, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    keep_sorted = (cumulative - probs_sorted) < top_p[:, None]
    cutoff_index = jnp.maximum(jnp.sum(keep_sorted, axis=-1) - 1, 0)
    p_threshold = jnp.take_along_axis(sorted_logits, cutoff_index[:, None], axis=-1)
    threshold = jnp.maximum(kth, p_threshold)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)
