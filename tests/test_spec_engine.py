"""Speculative decoding by prompt lookup inside the engine (issue 38): greedy tokens identical
to decoding without it, stop rules inside an accepted run, clean accounting."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.engine import Engine, EngineConfig

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def _engine(spec: str | None, **overrides) -> Engine:
    settings = dict(
        model="tiny",
        warmup=False,
        show_progress=False,
        page_size=16,
        device_tokens=4096,
        max_batch_tokens=128,
        max_batch_size=4,
        speculative_config=spec,
    )
    return Engine(EngineConfig(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def engines():
    plain, spec = _engine(None), _engine(SPEC)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # repeated spans: the lookup finds them, as in an answer quoting its document
    return [rng.integers(0, 256, size=24).tolist() * 4 + rng.integers(0, 256, size=5).tolist() for _ in range(n)]


def _clean(engine: Engine) -> None:
    acc = engine.check_accounting()
    assert acc["locked_nodes"] == 0 and acc["transient_nodes"] == 0
    assert acc["device_request_pages"] == 0 and acc["live_requests"] == 0


def test_greedy_tokens_identical_and_drafts_accepted(engines, monkeypatch):
    plain, spec = engines
    _always_verify(monkeypatch, spec)
    params = SamplingParams(max_tokens=37, ignore_eos=True)
    prompts = _prompts(0)
    before = spec.core.speculator.counters.accepted_tokens
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 37 and o.finish_reason == "length" for o in got)
    c = spec.core.speculator.counters
    assert c.accepted_tokens > before  # speculation happened and was right
    assert c.accepted_tokens <= c.draft_tokens and sum(c.accepted_per_position) == c.accepted_tokens
    _clean(spec)
    # from the tree (L1) the same again
    again = spec.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    assert all(o.cached_tokens["device"] > 0 for o in again)
    _clean(spec)


def test_mixed_batch_and_stop_rules_inside_an_accepted_run(engines):
    plain, spec = engines
    prompts = _prompts(1, 3)
    free = plain.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    # a stop id that greedy decoding reaches mid-way: the output ends there, as without speculation
    stop = free[0].token_ids[11]
    cases = [
        SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(max_tokens=13, ignore_eos=True),  # the length inside a run
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),  # decodes as before, same batch
    ]
    want = [plain.generate([p], c)[0] for p, c in zip(prompts, cases)]
    with ThreadPoolExecutor(len(cases)) as pool:  # submitted together: one batch of both kinds of row
        got = list(pool.map(lambda pc: spec.generate([pc[0]], pc[1])[0], zip(prompts, cases)))
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    assert len(got[1].token_ids) == 13
    _clean(spec)


def test_bad_speculative_config_names_the_field():
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EngineConfig(model="tiny", speculative_config='{"num_speculative_tokens": 0}')
    with pytest.raises(InvalidRequestError, match="draft_tensor_parallel_size"):
        EngineConfig(model="tiny", speculative_config='{"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}')


def test_rows_asking_for_logprobs_speculate_with_the_same_logprobs(engines, monkeypatch):
    plain, spec = engines
    _always_verify(monkeypatch, spec)
    params = SamplingParams(max_tokens=29, ignore_eos=True, logprobs=3)
    prompts = _prompts(7)
    before = spec.core.speculator.counters.accepted_tokens
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert spec.core.speculator.counters.accepted_tokens > before  # they did speculate, and kept tokens
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs) == 29
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id
            # another program (an extend, not a decode) over the same logits: equal within rounding
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
    _clean(spec)


def _always_verify(monkeypatch: pytest.MonkeyPatch, spec: Engine) -> None:
    """Every row with a proposal verifies: these tests are about what a verification emits,
    and the cost decision (tested in test_spec_choice) reads step times a loaded machine
    can tip against verifying at all."""
    speculator = spec.core.speculator
    monkeypatch.setattr(speculator, "break_even", lambda: 0.0)
    monkeypatch.setattr(speculator, "choose", lambda plain, candidates: [True] * len(candidates))


def _spent(spec: Engine) -> tuple[int, int]:
    c = spec.core.speculator.counters
    return c.accepted_tokens, c.draft_tokens


@pytest.mark.parametrize(
    "params",
    [
        # low temperatures: the tiny random model's draws follow its copying often, not always
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.2, seed=5),
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.15, top_k=8, top_p=0.9, seed=6, logprobs=2),
        SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            temperature=0.1,
            seed=7,
            frequency_penalty=0.05,
            presence_penalty=0.02,
            repetition_penalty=1.05,
            logit_bias={3: 1.5, 17: -2.0},
        ),
    ],
    ids=["temperature", "top-k-top-p-logprobs", "penalties-and-bias"],
)
def test_sampled_rows_speculate_and_draw_what_decoding_draws_under_a_seed(engines, params, monkeypatch):
    """A verification draws each position's token as decoding would (the row's processors over
    the tokens before it, the PRNG key of that token's number): with a seed, the tokens equal
    decoding's without speculation, while drafts are accepted and rejected."""
    plain, spec = engines
    _always_verify(monkeypatch, spec)
    prompts = _prompts(3, 3)
    accepted, drafted = _spent(spec)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    accepted, drafted = _spent(spec)[0] - accepted, _spent(spec)[1] - drafted
    assert 0 < accepted < drafted  # both branches of the acceptance ran
    if params.logprobs:
        for g, w in zip(got, want):
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # the same seed again: the same tokens (the draws do not depend on how many were accepted)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in want]
    _clean(spec)


def test_min_tokens_holds_a_stop_id_back_until_its_own_position_inside_a_run(engines, monkeypatch):
    """A stop id the bias makes every position's favourite is masked at each verified
    position below min_tokens (by that position's own count) and picked at the first one
    past it, inside a verification: the request stops at exactly min_tokens + 1 tokens, as
    decoding does."""
    plain, spec = engines
    _always_verify(monkeypatch, spec)
    prompts = _prompts(1, 1)
    stop = 5
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop], min_tokens=30, logit_bias={stop: 50.0})
    verified: list[list[int]] = []
    accepted_by = spec.core.speculator.accepted

    def record(proposal, picks, request_id=None):
        verified.append(list(picks))
        return accepted_by(proposal, picks, request_id)

    monkeypatch.setattr(spec.core.speculator, "accepted", record)
    want = plain.generate(prompts, params)[0]
    got = spec.generate(prompts, params)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert len(want.token_ids) == 31 and want.token_ids[-1] == stop and stop not in want.token_ids[:-1]
    # the stop was picked at a verification's later position, the ones before it were not
    assert any(stop in picks and picks.index(stop) > 0 for picks in verified), verified
    _clean(spec)


def test_speculating_rows_beside_mixed_steps_keep_every_token(engines, monkeypatch):
    """Verifying rows run their own program while plain decode rows ride in the prefill chunks'
    (mixed steps): the tokens are those of the plain engine."""
    plain = engines[0]
    mixed_spec = _engine(SPEC, mixed_steps=True)
    try:
        _always_verify(monkeypatch, mixed_spec)
        rng = np.random.default_rng(21)
        prompts = _prompts(5, 2) + [rng.integers(0, 256, size=n).tolist() for n in (7, 700)]
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        want = plain.generate(prompts, params)
        got = mixed_spec.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert mixed_spec.counters["mixed_steps"] > 0 and _spent(mixed_spec)[0] > 0
        _clean(mixed_spec)
    finally:
        mixed_spec.shutdown()
