"""Logprobs and prompt logprobs on the real model (SmolLM2-135M-Instruct, Q4_1 GGUF) equal
Hugging Face transformers' log-softmax on the same file, float32, within 2e-3; penalised
greedy output equals a plain loop over transformers' logits with the published formulas.
Skips when the model cannot be fetched (tests/real_model.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_model_from_gguf
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    """transformers' model from the same GGUF file."""
    return hf_model_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    engine = Engine(
        EngineConfig(
            model=smollm2_gguf,
            warmup=False,
            show_progress=False,
            tiers="L1",
            page_size=16,
            device_tokens=2048,
            max_batch_tokens=128,
            max_batch_size=4,
            max_context_tokens=1024,
            dtype="float32",
        )
    )
    yield engine
    engine.shutdown()


def _log_softmax(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()


@pytest.mark.slow
def test_prompt_and_token_logprobs_match_transformers(engine, hf_model):
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
    ids = engine.tokenizer.encode(text)
    engine.generate([ids], SamplingParams(max_tokens=1))  # cached now: the scoring request must bypass it
    out = engine.generate([ids], SamplingParams(max_tokens=4, prompt_logprobs=5, logprobs=5))[0]
    full = _log_softmax(hf_model, ids + out.token_ids)
    got = np.asarray([p.logprob for p in out.prompt_logprobs[1:]])
    assert np.abs(got - full[np.arange(len(ids) - 1), ids[1:]]).max() <= 2e-3
    for i, lp in enumerate(out.logprobs):
        pos = len(ids) - 1 + i
        assert lp.token_id == int(full[pos].argmax())
        assert abs(lp.logprob - full[pos, lp.token_id]) <= 2e-3
        ref_top = np.argsort(-full[pos], kind="stable")[:5]
        np.testing.assert_allclose([v for _, v in lp.top], full[pos, ref_top], atol=2e-3)


@pytest.mark.slow
def test_penalised_greedy_matches_a_plain_reference(engine, hf_model):
    ids = engine.tokenizer.encode("List the colours: red, blue, red, blue,")
    steps, rep, freq, pres = 8, 1.3, 0.7, 0.4
    got = engine.generate(
        [ids],
        SamplingParams(
            max_tokens=steps, ignore_eos=True, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
        ),
    )[0].token_ids
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            x = hf_model(torch.tensor([ids + out])).logits[0, -1:].float()
        x = RepetitionPenaltyLogitsProcessor(penalty=rep)(torch.tensor([ids + out]), x)[0].double().numpy()
        counts = np.bincount(np.asarray(out, np.int64), minlength=x.shape[0])
        out.append(int(np.argmax(x - counts * freq - (counts > 0) * pres)))
    assert got == out
