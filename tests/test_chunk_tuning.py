"""``prefill_chunk="auto"``: the chooser against a brute-force reading of its rule, and the
engine wiring (measured buckets, the scheduler's budget, clear config errors)."""

from __future__ import annotations

import itertools

import pytest

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.runtime.chunk_tuning import choose_prefill_chunk, describe


def brute_force_chunk(step_seconds: dict[int, float], tolerance: float) -> int:
    """Walk the buckets from the smallest; the first one no more than (1 + tolerance) times
    as costly per token as every bucket is the chunk."""
    for tokens in sorted(step_seconds):
        cost = step_seconds[tokens] / tokens
        if all(cost <= (1 + tolerance) * (s / t) for t, s in step_seconds.items()):
            return tokens
    raise AssertionError("unreachable")


def test_chooser_matches_brute_force_on_many_cost_curves():
    buckets = (16, 32, 64, 128, 256)
    per_token_choices = (1.0, 1.05, 1.2, 2.0)
    for per_token in itertools.product(per_token_choices, repeat=len(buckets)):
        seconds = {t: c * t for t, c in zip(buckets, per_token)}
        for tolerance in (0.0, 0.1, 0.5):
            assert choose_prefill_chunk(seconds, tolerance) == brute_force_chunk(seconds, tolerance)


def test_a_longer_bucket_that_is_slower_per_token_is_never_chosen():
    # quadratic work in the chunk: 512 is cheaper per token than 2048
    seconds = {128: 0.5, 256: 0.8, 512: 1.5, 1024: 3.6, 2048: 9.0}
    assert choose_prefill_chunk(seconds, 0.0) == 512
    assert choose_prefill_chunk(seconds) == 256  # within 10% of 512's per-token cost, and shorter
    # fixed per-step overhead amortised: the larger buckets win until within 10%
    seconds = {t: 0.2 + 0.001 * t for t in (64, 128, 256, 512, 1024, 2048)}
    chosen = choose_prefill_chunk(seconds)
    assert chosen == 2048 or seconds[chosen] / chosen <= 1.1 * min(s / t for t, s in seconds.items())
    assert "(chosen)" in describe(seconds, chosen)
    with pytest.raises(ValueError):
        choose_prefill_chunk({})
    with pytest.raises(ValueError):
        choose_prefill_chunk({64: 0.0})


@pytest.mark.heavy  # 20-50 s on 2 cores; the default suite stays near 15 min
def test_engine_auto_chunk_sets_the_scheduler_budget_and_serves():
    engine = Engine(
        EngineConfig(
            model="tiny",
            show_progress=False,
            tiers="L1",
            max_batch_tokens=256,
            max_batch_size=4,
            prefill_chunk="auto",
            device_tokens=4096,
            max_context_tokens=1024,
        )
    )
    try:
        measured = engine.extend_step_seconds
        assert set(measured) == {64, 128, 256}
        assert engine.prefill_chunk == engine.scheduler.config.max_batch_tokens == choose_prefill_chunk(measured)
        assert engine.scheduler.cost._extend.num_samples >= len(measured)  # seeded from the steps
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        out = engine.generate([[3 + i % 250 for i in range(600)]], greedy)[0]
        assert len(out.token_ids) == 4
    finally:
        engine.shutdown()
    reference = Engine(
        EngineConfig(
            model="tiny",
            show_progress=False,
            tiers="L1",
            max_batch_tokens=256,
            max_batch_size=4,
            device_tokens=4096,
            max_context_tokens=1024,
        )
    )
    try:
        assert reference.prefill_chunk == 256 and reference.extend_step_seconds == {}
        assert reference.generate([[3 + i % 250 for i in range(600)]], greedy)[0].token_ids == out.token_ids
    finally:
        reference.shutdown()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(prefill_chunk="auto", warmup=False), "needs warmup=True"),
        (dict(prefill_chunk="4096"), "at most max_batch_tokens"),
        (dict(prefill_chunk="8"), "above max_batch_size"),
        (dict(prefill_chunk="fast"), 'must be "max", "auto" or an integer'),
    ],
)
def test_bad_prefill_chunk_is_a_one_line_config_error(settings, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(model="tiny", max_batch_tokens=512, max_batch_size=16, **settings)


def test_fixed_chunk_is_the_scheduler_budget():
    config = EngineConfig(model="tiny", max_batch_tokens=512, prefill_chunk="128")
    assert config.scheduler_config().max_batch_tokens == 128
