"""Mixed steps (``EngineConfig.mixed_steps``, issue 41): a step that prefills and decodes runs as
one extend program, each decode row a one-token row whose token and position the device supplies.
Every emitted token (and logprob) must be what the separate extend + decode steps give (against
transformers on the same weights: tests/test_engine.py's concurrent-requests test, mixed_steps=True)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.structured import StructuredOutput


@pytest.fixture(scope="module")
def engines():
    made = {}
    for mixed, pipeline in ((False, True), (True, True), (True, False)):
        made[mixed, pipeline] = Engine(
            EngineConfig(
                model="tiny",
                warmup=False,
                show_progress=False,
                max_batch_tokens=64,
                max_batch_size=8,
                device_tokens=8192,
                max_context_tokens=1024,
                mixed_steps=mixed,
                pipeline=pipeline,
            )
        )
    yield made
    for e in made.values():
        e.shutdown()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, size=n).tolist() for n in (6, 12, 400, 9, 650, 20)]


PARAMS = [
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3, logprobs=3),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=4),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(max_tokens=24, ignore_eos=True, logit_bias={5: 4.0, 7: -100.0}, logprobs=0),
    SamplingParams(max_tokens=24, min_tokens=10, stop_token_ids=(1, 2, 3, 4, 5, 6, 7, 8), temperature=1.0, seed=9),
]


def test_every_sampling_feature_gives_the_same_tokens_mixed_or_not(engines):
    prompts = _prompts()
    results = {key: e.generate(prompts, PARAMS) for key, e in engines.items()}
    plain = results[False, True]
    for key in ((True, True), (True, False)):
        for a, b in zip(results[key], plain):
            assert a.token_ids == b.token_ids, key
            assert a.finish_reason == b.finish_reason
            if b.logprobs is not None:
                assert a.logprobs is not None
                for x, y in zip(a.logprobs, b.logprobs):  # another program: equal within float rounding
                    assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert engines[True, True].counters["mixed_steps"] > 0 and engines[True, False].counters["mixed_steps"] > 0
    assert engines[False, True].counters["mixed_steps"] == 0
    for e in engines.values():
        assert e.check_accounting()["live_requests"] == 0


def test_a_constrained_row_decodes_inside_mixed_steps(engines):
    long_prompt = np.random.default_rng(12).integers(0, 256, size=500).tolist()  # not cached by the test before
    params = [
        SamplingParams(max_tokens=30, structured=StructuredOutput("regex", "[0-9]{12}")),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.7, seed=1),
    ]
    prompts = ["digits: ", long_prompt, "free text"]
    mixed = engines[True, True]
    before = mixed.counters["mixed_steps"]
    outs = mixed.generate(prompts, params)
    assert re.fullmatch("[0-9]{12}", outs[0].text), outs[0].text
    assert mixed.counters["mixed_steps"] > before
    plain = engines[False, True].generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
