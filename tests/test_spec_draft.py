"""Speculative decoding with a draft model (issue 38): the draft's greedy continuation is the
proposal; the target's verification keeps the output exactly that of decoding without it.

The draft equal to the target (the embedded tiny model) must have every proposal accepted:
that checks that the draft's KV follows each sequence (catch-up after accepted runs,
rejected positions overwritten).  Another random model as the draft checks exactness when
proposals are wrong; a small draft pool, eviction."""

from __future__ import annotations

import dataclasses

import pytest
from test_spec_engine import _always_verify, _clean, _engine, _prompts, _spent

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.models.checkpoint import save_checkpoint
from strata_jax.models.loader import tiny_config
from strata_jax.models.weights import random_model

SAME = '{"model": "tiny", "num_speculative_tokens": 4}'


def _random_draft(folder, seed: int, **overrides) -> str:
    config = dataclasses.replace(tiny_config(), num_layers=1, **overrides)
    return str(save_checkpoint(random_model(config, seed=seed), folder))


@pytest.fixture(scope="module")
def plain():
    engine = _engine(None)
    yield engine
    engine.shutdown()


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(plain, monkeypatch):
    spec = _engine(SAME)
    try:
        _always_verify(monkeypatch, spec)
        assert spec.draft is not None
        prompts = _prompts(0)
        for params in (
            SamplingParams(max_tokens=37, ignore_eos=True),
            SamplingParams(max_tokens=37, ignore_eos=True, temperature=0.2, seed=4),
        ):
            before = _spent(spec)
            want = plain.generate(prompts, params)
            got = spec.generate(prompts, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            accepted, drafted = (now - then for now, then in zip(_spent(spec), before))
            if params.temperature == 0:  # the draft's greedy tokens are the target's
                assert drafted > 0 and accepted == drafted
            else:  # draws follow them often, not always
                assert 0 < accepted < drafted
        assert spec.draft.steps > 0
        assert not spec.draft._sequences  # every request's draft pages were given back
        _clean(spec)
    finally:
        spec.shutdown()


def test_another_draft_model_keeps_the_output_exact(plain, tmp_path, monkeypatch):
    folder = _random_draft(tmp_path / "draft", seed=5)
    spec = _engine(f'{{"model": "{folder}", "num_speculative_tokens": 3}}')
    try:
        _always_verify(monkeypatch, spec)
        prompts = _prompts(2)
        params = SamplingParams(max_tokens=25, ignore_eos=True)
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert spec.core.speculator.counters.drafts > 0
        _clean(spec)
    finally:
        spec.shutdown()


def test_a_short_draft_pool_evicts_the_least_recent_sequence_and_stays_exact(plain, monkeypatch):
    spec = _engine(
        # 16 pages: one 101-token prompt's sequence and its proposals take 9
        '{"model": "tiny", "num_speculative_tokens": 4, "draft_kv_tokens": 256}',
        max_context_tokens=256,
    )
    try:
        _always_verify(monkeypatch, spec)
        prompts = _prompts(3)
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert spec.draft.evicted_tokens > 0 and spec.core.speculator.counters.accepted_tokens > 0
        _clean(spec)
    finally:
        spec.shutdown()


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    folder = _random_draft(tmp_path / "draft", seed=1, vocab_size=300)
    with pytest.raises(InvalidRequestError, match="vocabulary of 300 tokens"):
        _engine(f'{{"model": "{folder}", "num_speculative_tokens": 2}}')
