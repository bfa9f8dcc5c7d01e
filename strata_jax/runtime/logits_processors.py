"""Batched logits processors on device: penalties, logit bias, min_tokens EOS masking.

Every function is pure JAX over a batch of rows ``logits[B, V]`` (float32) and the
rows' per-token *flags* ``flags[B, V]`` (int32), one word per (row, token id)::

    bits  0..23  how many times the token was generated so far (OpenAI's c[j])
    bit   24     the token occurs in the prompt (HF's repetition penalty looks at it)
    bit   25     the token is suppressed while the row is below min_tokens (EOS, stop ids)

The flags live on the device, one row per sequence that asked for any of these
(``strata_jax.runtime.sampling_state``): a step reads the rows of its batch, and
adds one to the count of each token it samples, so no ``[B, V]`` array ever
crosses the host<->device link after a request starts.

Order (as vLLM's sampler): logit bias, min_tokens masking, repetition penalty,
frequency/presence penalties; temperature/top-k/top-p come after (``sampling.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

COUNT_MASK = (1 << 24) - 1
PROMPT_BIT = 1 << 24
SUPPRESS_BIT = 1 << 25


def generated_counts(flags: jax.Array) -> jax.Array:
    return jnp.bitwise_and(flags, COUNT_MASK)


def apply_repetition_penalty(logits: jax.Array, flags: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF's ``RepetitionPenaltyLogitsProcessor``: for every token seen in the prompt or
    the output, a positive logit is divided by ``penalty[B]``, a negative one multiplied."""
    seen = (jnp.bitwise_and(flags, PROMPT_BIT | COUNT_MASK)) != 0
    p = penalty[:, None]
    penalised = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen, penalised, logits)


def apply_frequency_presence(
    logits: jax.Array, flags: jax.Array, frequency: jax.Array, presence: jax.Array
) -> jax.Array:
    """OpenAI's definition over generated tokens: mu[j] - c[j] * a_f - (c[j] > 0) * a_p."""
    counts = generated_counts(flags).astype(logits.dtype)
    return logits - counts * frequency[:, None] - (counts > 0).astype(logits.dtype) * presence[:, None]


def suppress_below_min_tokens(logits: jax.Array, flags: jax.Array, active: jax.Array) -> jax.Array:
    """Rows with ``active[B]`` (fewer than min_tokens generated) can't pick a suppressed id."""
    suppressed = (jnp.bitwise_and(flags, SUPPRESS_BIT) != 0) & active[:, None]
    return jnp.where(suppressed, -jnp.inf, logits)


def process_logits(
    logits: jax.Array,
    flags: jax.Array,
    bias: jax.Array,
    repetition: jax.Array,
    frequency: jax.Array,
    presence: jax.Array,
    min_tokens_active: jax.Array,
) -> jax.Array:
    """All processors in order.  Neutral values (bias 0, flags 0, repetition 1,
    frequency/presence 0, inactive) leave a row bit-identical."""
    logits = logits + bias
    logits = suppress_below_min_tokens(logits, flags, min_tokens_active)
    logits = apply_repetition_penalty(logits, flags, repetition)
    return apply_frequency_presence(logits, flags, frequency, presence)


def record_sampled(flags_table: jax.Array, slots: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
    """Add one to ``flags_table[slots[b], tokens[b]]`` where ``count[b]``.

    Rows that don't count point at a slot beyond the table (dropped), so the
    update is B scatter elements whatever the batch asked for."""
    rows = jnp.where(count, slots, flags_table.shape[0])
    return flags_table.at[rows, tokens].add(1, mode="drop")


def initial_flags(vocab_size: int, prompt_ids, suppressed_ids=(), generated_ids=()) -> np.ndarray:
    """Host-side first value of a sequence's flags row (``[V]`` int32).

    ``generated_ids`` are output tokens that already exist (a retracted request
    that comes back), counted like sampled ones."""
    row = np.zeros(vocab_size, np.int32)
    if len(prompt_ids):
        row[np.asarray(prompt_ids, np.int64)] |= PROMPT_BIT
    if len(suppressed_ids):
        row[np.asarray(suppressed_ids, np.int64)] |= SUPPRESS_BIT
    if len(generated_ids):
        np.add.at(row, np.asarray(generated_ids, np.int64), 1)
    return row


def initial_bias(vocab_size: int, logit_bias: dict[int, float]) -> np.ndarray:
    row = np.zeros(vocab_size, np.float32)
    for token, value in logit_bias.items():
        row[token] = value
    return row
