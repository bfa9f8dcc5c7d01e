"""The sampling head of the jitted step: processors, sampling, logprobs, state update.

The step reads, per row, a few small arrays next to temperature/top-k/top-p from the
sequence tables (``seq_state``; ``step_inputs.model_inputs`` gathers them) and calls
``sample_with_extras`` inside its one jitted program, so logprobs, penalties, biases
and min_tokens add inputs, not programs:

    slot       [B] int32    the sequence's sampling-state slot, ``no_slot`` when none
    penalties  [B, 3] f32   repetition, frequency, presence (neutral: 1, 0, 0)
    row_bits   [B] int32    MIN_TOKENS_ACTIVE | COUNT_SAMPLE | WANT_LOGPROBS
    targets    [T] int32    per packed token: the id whose prompt logprob is wanted
                            (the next prompt token), -1 when not asked

Each extra sits under a ``lax.cond`` on "any row asked", so a batch that asked for
nothing runs only the predicates and a B-element scatter into a dropped row.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.api import TokenLogprob
from strata_jax.runtime.logits_processors import process_logits, record_sampled
from strata_jax.runtime.logprobs import (
    MAX_TOP_LOGPROBS,
    TokenLogprobs,
    empty_logprobs,
    hidden_logprobs_if,
    token_logprobs,
    token_logprobs_if,
)
from strata_jax.runtime.sampling import sample_tokens
from strata_jax.runtime.sampling_state import gather_rows
from strata_jax.runtime.verify_sampling import verify_picks

MIN_TOKENS_ACTIVE = 1
COUNT_SAMPLE = 2
WANT_LOGPROBS = 4
NO_TARGET = -1


def sample_with_extras(
    last_logits: jax.Array,
    hidden: jax.Array,
    head: Callable[[jax.Array], jax.Array],
    inputs: dict,
    flags_table: jax.Array,
    bias_table: jax.Array,
    token_mask: jax.Array | None = None,
    verify_picks_per_step: int = 0,
) -> tuple[jax.Array, TokenLogprobs, TokenLogprobs, jax.Array, jax.Array]:
    """Next tokens [B], their logprobs [B], per-position logprobs [T] (prompt logprobs; at a
    verification's positions, of its picks), a verification's picks [T] (0 elsewhere), the
    updated flags table.

    ``token_mask`` ([S, ceil(V / 32)] int32, one bit per token id): rows with
    ``inputs["constrained"]`` sample only ids whose bit is set in row
    ``inputs["mask_slot"]`` (structured outputs), after the processors.
    ``verify_picks_per_step`` (static): at most this many verification tokens in a step
    (``verify_sampling``); 0: the program never verifies (no picks are computed).
    """
    slot, bits, pen = inputs["slot"], inputs["row_bits"], inputs["penalties"]
    held = slot < flags_table.shape[0]

    def processed() -> jax.Array:
        flags = gather_rows(flags_table, slot)
        bias = gather_rows(bias_table, slot)
        return process_logits(
            last_logits, flags, bias, pen[:, 0], pen[:, 1], pen[:, 2], (bits & MIN_TOKENS_ACTIVE) != 0
        )

    logits = jax.lax.cond(jnp.any(held), processed, lambda: last_logits)
    if token_mask is not None:
        constrained = inputs["constrained"]
        logits = jax.lax.cond(
            jnp.any(constrained),
            lambda x: apply_token_mask(x, token_mask[inputs["mask_slot"]], constrained),
            lambda x: x,
            logits,
        )
    next_tokens = sample_tokens(logits, inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["rng_keys"])
    sampled_lp = token_logprobs_if((bits & WANT_LOGPROBS) != 0, last_logits, next_tokens, MAX_TOP_LOGPROBS)
    targets = inputs["targets"]
    if verify_picks_per_step:
        prompt_lp, picks, flags_table = _positions_with_picks(
            hidden, head, inputs, flags_table, bias_table, verify_picks_per_step
        )
    else:
        prompt_lp = hidden_logprobs_if(targets >= 0, hidden, head, jnp.maximum(targets, 0), MAX_TOP_LOGPROBS)
        picks = jnp.zeros(targets.shape[0], jnp.int32)
    flags_table = record_sampled(flags_table, slot, next_tokens, held & ((bits & COUNT_SAMPLE) != 0))
    return next_tokens, sampled_lp, prompt_lp, picks, flags_table


def _positions_with_picks(
    hidden: jax.Array,
    head: Callable[[jax.Array], jax.Array],
    inputs: dict,
    flags_table: jax.Array,
    bias_table: jax.Array,
    num_picks: int,
) -> tuple[TokenLogprobs, jax.Array, jax.Array]:
    """Per-position logprobs (prompt logprobs; a verification's picks) and the picks: the
    head runs over every position once, under a ``lax.cond`` on "any position asked",
    and the picks' processors and draws under one on "any verification"."""
    targets = inputs["targets"]
    verify = inputs["verify"]
    n = targets.shape[0]
    k = min(MAX_TOP_LOGPROBS, flags_table.shape[1])

    def positions(flags: jax.Array) -> tuple[TokenLogprobs, jax.Array, jax.Array]:
        logits = head(hidden)
        picks, flags = jax.lax.cond(
            jnp.any(verify),
            lambda f: verify_picks(logits, inputs, f, bias_table, num_picks),
            lambda f: (jnp.zeros(n, jnp.int32), f),
            flags,
        )
        chosen = jnp.where(verify, picks, jnp.maximum(targets, 0))  # a pick's logprob is its own
        return token_logprobs(logits, chosen, k), picks, flags

    def nothing(flags: jax.Array) -> tuple[TokenLogprobs, jax.Array, jax.Array]:
        return empty_logprobs(n, k), jnp.zeros(n, jnp.int32), flags

    return jax.lax.cond(jnp.any((targets >= 0) | verify), positions, nothing, flags_table)


def apply_token_mask(logits: jax.Array, words: jax.Array, rows: jax.Array) -> jax.Array:
    """``logits[B, V]`` with ids whose bit is clear in ``words[B, ceil(V/32)]`` set to -inf, in
    the rows where ``rows[B]`` is True (bit ``i % 32`` of word ``i // 32`` allows id ``i``)."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    allowed = (jnp.right_shift(words[:, ids // 32], ids % 32) & 1) != 0
    return jnp.where(allowed | ~rows[:, None], logits, -jnp.inf)


def fetch_logprobs(
    lp: TokenLogprobs, rows: int, host_copy: Callable[[jax.Array], np.ndarray] = np.asarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return host_copy(lp.chosen)[:rows], host_copy(lp.top_ids)[:rows], host_copy(lp.top_logprobs)[:rows]


def to_token_logprob(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray], row: int, token_id: int, k: int
) -> TokenLogprob:
    chosen, ids, lps = arrays
    top = tuple((int(t), float(v)) for t, v in zip(ids[row, :k], lps[row, :k]))
    return TokenLogprob(token_id=int(token_id), logprob=float(chosen[row]), top=top)
