"""The target's token after every position of a speculative verification, drawn as decoding
would have drawn it.

A verification is an extend chunk of a row's last token and its proposed tokens
``d1 .. dk``; position ``j`` predicts the row's token number ``sampled + j``.  Decoding
would have picked that token from the logits at that position after the same processors
(bias, min_tokens, penalties counted over the tokens generated so far, which by then
include ``d1 .. dj``), with the same PRNG key (``fold_in(base, sampled + j)``).  This
module picks exactly that token at every position, so a row emits picks while they equal
its proposals (and the first that does not): for a proposal that is one token rather than
a distribution (prompt lookup) this *is* Leviathan et al.'s rejection sampling -- ``dj``
is kept with probability ``p(dj)``, and when it is not, the emitted token follows ``p``
without ``dj`` renormalised -- and more: the tokens equal those of decoding without
speculation under the same seed.  Greedy rows get ``argmax`` (temperature 0).

The picks that decoding will have emitted are counted in the row's penalty flags here
(the chunk's own sample is not kept: ``COUNT_SAMPLE`` is off for verifications), so the
flags on the device stay what decoding would have left.

The work is ``[P, V]`` for ``P`` = the program's rows x tokens per verification (at most
its tokens), not ``[T, V]``: a prefill program that carries a verification does not pay
processors over every prompt position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.runtime.logits_processors import process_logits, record_sampled
from strata_jax.runtime.sampling import sample_tokens
from strata_jax.runtime.sampling_state import gather_rows
from strata_jax.runtime.seq_state import step_keys


def verify_picks(
    logits: jax.Array,
    inputs: dict,
    flags_table: jax.Array,
    bias_table: jax.Array,
    num_picks: int,
) -> tuple[jax.Array, jax.Array]:
    """(picks ``[T]`` int32, the flags table with the emitted picks counted).

    ``logits``: ``[T, V]`` raw logits of every packed token; ``inputs``: the step's
    sampling inputs (``step_inputs.model_inputs``): ``verify [T]`` (the token belongs to a
    verification), ``row_of_token``, ``token_offset`` (position within its row's chunk),
    ``input_ids`` and the per-row sampling parameters.  Tokens outside verifications get
    0.  ``num_picks`` (static): at most this many verification tokens per step."""
    num_tokens, vocab = logits.shape
    verify = inputs["verify"]
    index = jnp.nonzero(verify, size=num_picks, fill_value=num_tokens)[0]
    valid = index < num_tokens
    at = jnp.minimum(index, num_tokens - 1)
    row = inputs["row_of_token"][at]
    offset = jnp.where(valid, inputs["token_offset"][at], 0)
    ids = inputs["input_ids"]
    no_slot = flags_table.shape[0]
    slot = jnp.where(valid, inputs["slot"][row], no_slot)
    # The row's first verification token in ``index``: chunks are whole and in order.
    first = jnp.maximum(jnp.arange(num_picks) - offset, 0)

    # Penalties see the proposed tokens before each position as generated (position j
    # follows d1 .. dj; position 0's input, the last token, is counted already).  Only
    # penalties read the counts: without them the [P, V] count of proposals is skipped.
    penalties = inputs["penalties"][row]
    penalised = valid & ((penalties[:, 0] != 1) | (penalties[:, 1] != 0) | (penalties[:, 2] != 0))

    def with_proposals(flags: jax.Array) -> jax.Array:
        proposed = jax.nn.one_hot(ids[at], vocab, dtype=flags.dtype) * (valid & (offset > 0))[:, None]
        seen = jnp.cumsum(proposed, axis=0)
        return flags + (seen - seen[first])

    flags = gather_rows(flags_table, slot)
    flags = jax.lax.cond(jnp.any(penalised), with_proposals, lambda f: f, flags)
    count = inputs["sampled"][row] + offset  # the token's number: its PRNG step, its min_tokens test
    processed = process_logits(
        logits[at],
        flags,
        gather_rows(bias_table, slot),
        penalties[:, 0],
        penalties[:, 1],
        penalties[:, 2],
        count < inputs["min_tokens"][row],
    )
    keys = step_keys(inputs["rng_base"][row], count)
    temperature = jnp.where(valid, inputs["temperature"][row], 0.0)
    picks = sample_tokens(processed, temperature, inputs["top_k"][row], inputs["top_p"][row], keys)

    # Decoding emits a pick when every pick before it in the row equalled its proposal.
    follows = ids[jnp.minimum(at + 1, num_tokens - 1)]
    missed = (picks != follows).astype(jnp.int32)
    missed_before = jnp.cumsum(missed) - missed
    emitted = valid & (missed_before == missed_before[first])
    flags_table = record_sampled(flags_table, slot, picks, emitted & (slot < no_slot))
    return jnp.zeros(num_tokens, jnp.int32).at[index].set(picks, mode="drop"), flags_table
