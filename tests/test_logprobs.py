"""On-device logprobs and top-K against torch's log_softmax / topk (an independent reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from strata_jax.runtime.logprobs import hidden_logprobs_if, token_logprobs, token_logprobs_if


def test_token_logprobs_match_torch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32) * 5
    tokens = rng.integers(0, 300, 5)
    out = jax.jit(lambda x, t: token_logprobs(x, t, 7))(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32))
    ref = torch.log_softmax(torch.tensor(logits), dim=-1)
    np.testing.assert_allclose(np.asarray(out.chosen), ref[np.arange(5), tokens].numpy(), atol=1e-5)
    top = torch.topk(ref, 7, dim=-1)
    np.testing.assert_array_equal(np.asarray(out.top_ids), top.indices.numpy())
    np.testing.assert_allclose(np.asarray(out.top_logprobs), top.values.numpy(), atol=1e-5)


def test_rows_that_did_not_ask_skip_the_work():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 50)).astype(np.float32))
    tokens = jnp.zeros(4, jnp.int32)
    f = jax.jit(lambda w: token_logprobs_if(w, logits, tokens, 3))
    skipped = f(jnp.zeros(4, bool))
    assert not np.asarray(skipped.chosen).any() and not np.asarray(skipped.top_logprobs).any()
    asked = f(jnp.asarray([False, True, False, False]))
    full = token_logprobs(logits, tokens, 3)
    np.testing.assert_allclose(np.asarray(asked.chosen), np.asarray(full.chosen))
    # the skip is a real branch in the program, not a mask over computed values
    hlo = f.lower(jnp.zeros(4, bool)).as_text()
    assert "conditional" in hlo or "case" in hlo


def test_hidden_variant_runs_the_head_inside_the_branch():
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.standard_normal((6, 8)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((8, 40)).astype(np.float32))
    targets = jnp.asarray(rng.integers(0, 40, 6), jnp.int32)
    out = hidden_logprobs_if(jnp.ones(6, bool), hidden, lambda h: h @ w, targets, 4)
    ref = torch.log_softmax(torch.tensor(np.array(hidden @ w)), dim=-1)
    np.testing.assert_allclose(np.asarray(out.chosen), ref[np.arange(6), np.array(targets)].numpy(), atol=1e-5)
