"""Speculative sampling keeps the target's distribution (issue 38): at temperature 0.8 on a
small random model (258-token vocabulary), 20,000 verifications of ``[a, d]`` (the last
token ``a`` and one proposed token ``d``), each row with its own PRNG key.

The emitted tokens are: the pick after ``a``, and when it equals ``d`` the pick after ``d``
too.  Their empirical distributions are checked against the exact ones (a softmax of the
model's logits at 0.8, from a plain all-logits step, in numpy) with a chi-square test
(p > 0.01; measured 0.25 and 0.66 over 20,000 and 5,823 samples): the first token's
marginal, and the second's given that the first was ``d`` (the rejection-sampling identity:
accepted with probability p(d), then distributed as decoding after ``d``).  Equality with
decoding under the same seed is tested in test_spec_engine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.engine.executor import ExtendChunk
from strata_jax.models.loader import tiny_config
from strata_jax.models.weights import random_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput
from strata_jax.runtime.seq_state import RowParams

SAMPLES = 20_000
ROWS = 500  # verifications per step
TEMPERATURE = 0.8


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of ``counts`` against ``probs``; categories expected below 5 times are
    pooled into one (the test's usual condition)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(df / 2, stat / 2))


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) / TEMPERATURE
    z -= z.max()
    p = np.exp(z)
    return p / p.sum()


def test_verified_draws_follow_the_target_distribution():
    config = dataclasses.replace(tiny_config(), num_layers=2, hidden_size=64, intermediate_size=128)
    config = dataclasses.replace(config, num_heads=2, num_kv_heads=1, head_dim=32)
    model = random_model(config, seed=3)
    # the final norm's scale multiplies every logit: a random model's near-flat distribution
    # made peaked enough that the proposal is accepted at a rate worth testing
    norm = model.model.norm.weight
    norm[...] = norm[...] * 12.0
    runner = ModelRunner(
        model,
        RunnerConfig(
            page_size=16,
            num_device_pages=4,
            max_batch_tokens=2 * ROWS,
            max_batch_size=ROWS,
            max_context_tokens=64,
            verify_tokens_per_row=2,
            max_running=ROWS,
        ),
    )
    a = 65
    exact = np.asarray(runner.step([SeqInput([a], 0, [0])], all_logits=True).logits)[0]
    p_first = _softmax(exact)
    d = int(np.argmax(p_first))  # the proposal: accepted often enough to test what follows it
    p_second = _softmax(np.asarray(runner.step([SeqInput([a, d], 0, [0])], all_logits=True).logits)[1])
    assert 0.05 < p_first[d] < 0.9, p_first[d]  # a real choice at both outcomes

    first, second = [], []
    for step in range(SAMPLES // ROWS):
        slots = [runner.seqs.acquire() for _ in range(ROWS)]
        params = [RowParams(temperature=TEMPERATURE, rng_base=(step, i)) for i in range(ROWS)]
        # every row's KV is the same two tokens at the same positions: one page serves them all
        runner.seqs.write_rows([(slot, [0], 0, 0, 0, p) for slot, p in zip(slots, params)])
        work = [ExtendChunk(slot, [a, d], 0, False, [0, 0], True) for slot in slots]
        picks = runner.dispatch_extend(work).result().verify_picks.reshape(ROWS, 2)
        for slot in slots:
            runner.seqs.release(slot)
        first.append(picks[:, 0])
        second.append(picks[picks[:, 0] == d, 1])  # emitted only when the proposal was accepted
    first_tokens, second_tokens = np.concatenate(first), np.concatenate(second)
    vocab = config.vocab_size
    assert len(first_tokens) == SAMPLES
    p1 = _chi_square_p(np.bincount(first_tokens, minlength=vocab), p_first)
    p2 = _chi_square_p(np.bincount(second_tokens, minlength=vocab), p_second)
    assert abs(len(second_tokens) / SAMPLES - p_first[d]) < 4 * np.sqrt(p_first[d] * (1 - p_first[d]) / SAMPLES)
    assert p1 > 0.01 and p2 > 0.01, (p1, p2, len(second_tokens))


def test_the_chi_square_check_can_fail():
    """The statistic rejects a distribution that is off (so the test above can fail)."""
    probs = np.full(10, 0.1)
    skewed = np.random.default_rng(0).multinomial(20_000, np.r_[np.full(9, 0.098), 0.118])
    fair = np.random.default_rng(1).multinomial(20_000, probs)
    assert _chi_square_p(skewed, probs) < 0.01 < _chi_square_p(fair, probs)
    assert jnp.isfinite(_chi_square_p(fair, probs))
