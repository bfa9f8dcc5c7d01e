"""Log-probabilities on device: the chosen token's logprob and the top-K alternatives.

Logprobs are of the model's own distribution (log-softmax of the raw logits, before
penalties, bias and temperature), as vLLM reports them by default and as eval
harnesses expect.  Only ``[N]`` and ``[N, K]`` arrays leave the device, never a
vocabulary row, and the work runs under ``lax.cond`` so a batch in which no row
asked pays only the predicate.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs / completions logprobs


class TokenLogprobs(NamedTuple):
    chosen: jax.Array  # [N] float32: logprob of tokens[n]
    top_ids: jax.Array  # [N, K] int32, best first by raw logit (ties: lowest id first; [:, 0] is the argmax)
    top_logprobs: jax.Array  # [N, K] float32


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int = MAX_TOP_LOGPROBS) -> TokenLogprobs:
    """Logprob of ``tokens[N]`` under ``logits[N, V]`` and the top-``k`` (static) per row."""
    raw = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    # Ranked by the raw logits, not by their log-softmax: subtracting the normaliser can round
    # two close logits to one value and reorder them, and speculative decoding reads
    # ``top_ids[:, 0]`` as the greedy token, which must be ``argmax`` of the logits exactly.
    _, top_ids = jax.lax.top_k(raw, min(k, logits.shape[-1]))
    top_lp = jnp.take_along_axis(logp, top_ids, axis=-1)
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top_lp)


def empty_logprobs(n: int, k: int) -> TokenLogprobs:
    return TokenLogprobs(jnp.zeros(n, jnp.float32), jnp.zeros((n, k), jnp.int32), jnp.zeros((n, k), jnp.float32))


def token_logprobs_if(
    wanted: jax.Array, logits: jax.Array, tokens: jax.Array, k: int = MAX_TOP_LOGPROBS
) -> TokenLogprobs:
    """``token_logprobs`` when any of ``wanted[N]`` is set, zeros (at the cost of the
    predicate) otherwise.  Rows that did not ask get values too; callers ignore them."""
    k = min(k, logits.shape[-1])
    return jax.lax.cond(
        jnp.any(wanted),
        lambda: token_logprobs(logits, tokens, k),
        lambda: empty_logprobs(logits.shape[0], k),
    )


def hidden_logprobs_if(wanted: jax.Array, hidden: jax.Array, head, targets: jax.Array, k: int) -> TokenLogprobs:
    """Like ``token_logprobs_if`` from hidden states ``[N, H]``: the LM head ``head``
    (hidden -> logits) runs inside the branch, so a batch without prompt-logprob
    rows never computes logits for every position."""
    n = hidden.shape[0]
    return jax.lax.cond(
        jnp.any(wanted),
        lambda: token_logprobs(head(hidden), targets, k),
        lambda: empty_logprobs(n, k),
    )
