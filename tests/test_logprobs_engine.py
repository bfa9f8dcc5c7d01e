"""Logprobs, prompt logprobs (echo scoring), penalties and min_tokens through the whole
engine, against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_logits, make_hf_model
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    hf = make_hf_model("qwen2", folder)
    engine = Engine(
        EngineConfig(
            model=str(folder),
            warmup=False,
            show_progress=False,
            page_size=4,
            max_batch_tokens=32,
            max_batch_size=2,
            device_tokens=1024,
            tiers="L1",
        )
    )
    yield hf, engine
    engine.shutdown()


def _hf_logprobs(hf, ids):
    return torch.log_softmax(hf_logits(hf, ids), dim=-1).numpy()


def test_prompt_logprobs_match_hf_even_when_the_prompt_is_cached(setup):
    hf, engine = setup
    ids = np.random.default_rng(0).integers(0, 96, 45).tolist()  # > max_batch_tokens: chunked
    ref = _hf_logprobs(hf, ids)
    engine.generate([ids], SamplingParams(max_tokens=2))  # the prompt is now in the cache
    warm = engine.generate([ids], SamplingParams(max_tokens=1))[0]
    assert warm.num_cached_tokens > 0  # a plain request hits the cache ...
    out = engine.generate([ids], SamplingParams(max_tokens=3, prompt_logprobs=5, logprobs=3))[0]
    assert out.num_cached_tokens == 0  # ... a prompt-logprobs one recomputes (bypasses the read)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    got = np.asarray([p.logprob for p in out.prompt_logprobs[1:]])
    assert [p.token_id for p in out.prompt_logprobs[1:]] == ids[1:]
    assert np.abs(got - ref[np.arange(len(ids) - 1), ids[1:]]).max() <= 2e-3
    top = out.prompt_logprobs[7].top
    assert [t for t, _ in top] == np.argsort(-ref[6], kind="stable")[:5].tolist()
    # generated tokens: greedy, with their logprobs under HF's distribution
    full = _hf_logprobs(hf, ids + out.token_ids)
    for i, lp in enumerate(out.logprobs):
        pos = len(ids) - 1 + i
        assert lp.token_id == out.token_ids[i] == int(full[pos].argmax())
        assert abs(lp.logprob - full[pos, lp.token_id]) <= 2e-3 and len(lp.top) == 3
    assert engine.check_accounting()["locked_nodes"] == 0


def test_echo_scoring_with_max_tokens_zero(setup):
    hf, engine = setup
    ids = np.random.default_rng(1).integers(0, 96, 11).tolist()
    out = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
    ref = _hf_logprobs(hf, ids)
    got = np.asarray([p.logprob for p in out.prompt_logprobs[1:]])
    assert np.abs(got - ref[np.arange(10), ids[1:]]).max() <= 2e-3


def _reference(hf, prompt, steps, rep, freq, pres, bias):
    out: list[int] = []
    for _ in range(steps):
        x = hf_logits(hf, prompt + out)[-1:].clone()
        for t, v in bias.items():
            x[0, t] += v
        x = RepetitionPenaltyLogitsProcessor(penalty=rep)(torch.tensor([prompt + out]), x)[0].double().numpy()
        counts = np.bincount(np.asarray(out, np.int64), minlength=x.shape[0])
        out.append(int(np.argmax(x - counts * freq - (counts > 0) * pres)))
    return out


def test_penalised_greedy_matches_reference_with_slots_scarce(setup):
    """Six penalised requests at once for two state slots (max_batch_size 2): the rest
    park and run as slots free; each output equals the plain formula loop."""
    hf, engine = setup
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 96, 6 + i).tolist() for i in range(6)]
    settings = [dict(rep=1.0 + 0.2 * i, freq=0.3 * (i % 3), pres=0.4 * (i % 2), bias={5: 1.0 * i}) for i in range(6)]
    params = [
        SamplingParams(
            max_tokens=8,
            ignore_eos=True,
            repetition_penalty=s["rep"],
            frequency_penalty=s["freq"],
            presence_penalty=s["pres"],
            logit_bias=s["bias"],
        )
        for s in settings
    ]
    outs = engine.generate(prompts, params)
    for p, s, o in zip(prompts, settings, outs):
        assert o.token_ids == _reference(hf, p, 8, **s)
    plain = [_reference(hf, p, 8, 1.0, 0.0, 0.0, {}) for p in prompts]
    assert sum(o.token_ids != q for o, q in zip(outs, plain)) >= 4  # the penalties did something
    assert engine.runner.sampling.free_slots == engine.runner.sampling.num_slots
    assert engine.check_accounting()["live_requests"] == 0


def test_min_tokens_holds_back_stop_tokens(setup):
    hf, engine = setup
    ids = np.random.default_rng(3).integers(0, 96, 7).tolist()
    first = engine.generate([ids], SamplingParams(max_tokens=1))[0].token_ids[0]
    stopped = engine.generate([ids], SamplingParams(max_tokens=6, stop_token_ids=(first,)))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = engine.generate([ids], SamplingParams(max_tokens=6, stop_token_ids=(first,), min_tokens=4))[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_generate_choices_scores_the_prompt_once(setup):
    hf, engine = setup
    ids = np.random.default_rng(4).integers(0, 96, 19).tolist()
    outs = engine.generate_choices(ids, SamplingParams(max_tokens=3, temperature=1.0, seed=2, prompt_logprobs=0), 3)
    assert len(outs) == 3 and all(o.prompt_logprobs is outs[0].prompt_logprobs for o in outs)
    assert outs[0].num_cached_tokens == 0  # the scoring choice computed the prompt ...
    assert all(o.cached_tokens["device"] == 16 for o in outs[1:])  # ... the others hit its 4 pages
    ref = _hf_logprobs(hf, ids)
    got = np.asarray([p.logprob for p in outs[0].prompt_logprobs[1:]])
    assert np.abs(got - ref[np.arange(len(ids) - 1), ids[1:]]).max() <= 2e-3
