"""Logprobs and penalties through the runner's one jitted step, against Hugging Face
transformers on the same (random) weights: log_softmax of HF's logits, and a plain
greedy loop over HF's logits with HF's repetition processor and OpenAI's formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_logits, make_hf_model
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from strata_jax.models.loader import load_model
from strata_jax.runtime import logits_processors as lp
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

PAGE = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = make_hf_model("llama_tied", folder)
    return hf, load_model(str(folder))


def _runner(loaded) -> ModelRunner:
    cfg = RunnerConfig(
        page_size=PAGE, num_device_pages=64, max_batch_tokens=64, max_batch_size=4, max_context_tokens=256
    )
    return ModelRunner(loaded.model, cfg)


def test_prompt_and_sample_logprobs_match_hf_log_softmax(models):
    hf, loaded = models
    runner = _runner(loaded)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 96, 21).tolist()
    b = rng.integers(0, 96, 9).tolist()
    # a is split over two chunks (prompt logprobs across a chunk boundary); b asks for nothing
    targets_a1 = a[1:12]
    seqs = [
        SeqInput(a[:11], 0, list(range(0, 4)), prompt_logprob_targets=targets_a1, keep_sample=False),
        SeqInput(b, 0, list(range(8, 10))),
    ]
    first = runner.step(seqs)
    targets_a2 = a[12:] + [-1]
    second = runner.step([SeqInput(a[11:], 11, list(range(0, 4)), prompt_logprob_targets=targets_a2, logprobs=True)])
    ref = torch.log_softmax(hf_logits(hf, a), dim=-1).numpy()
    chosen = np.concatenate([first.prompt_logprobs[0][:11], second.prompt_logprobs[0][: len(a) - 12]])
    expected = ref[np.arange(len(a) - 1), a[1:]]
    assert np.abs(chosen - expected).max() <= 2e-3
    # top-20 of the first position, best first
    top_ref = np.argsort(-ref[0], kind="stable")[:20]
    assert first.prompt_logprobs[1][0].tolist() == top_ref.tolist()
    np.testing.assert_allclose(first.prompt_logprobs[2][0], ref[0][top_ref], atol=2e-3)
    # the sampled (greedy) token's logprob at the last position
    token = int(second.next_tokens[0])
    assert token == int(ref[-1].argmax())
    assert abs(second.sample_logprobs[0][0] - ref[-1, token]) <= 2e-3
    assert first.sample_logprobs is None  # nobody asked in the first step: nothing fetched


def _reference_penalised_greedy(hf, prompt, steps, rep, freq, pres, bias, min_tokens, eos):
    out: list[int] = []
    processor = RepetitionPenaltyLogitsProcessor(penalty=rep)
    for _ in range(steps):
        x = hf_logits(hf, prompt + out)[-1:].clone()
        for t, v in bias.items():
            x[0, t] += v
        if len(out) < min_tokens:
            x[0, eos] = -float("inf")
        x = processor(torch.tensor([prompt + out]), x)[0].double().numpy()
        counts = np.bincount(np.asarray(out, np.int64), minlength=x.shape[0])
        x = x - counts * freq - (counts > 0) * pres
        out.append(int(np.argmax(x)))
    return out


def test_penalised_greedy_through_the_runner_matches_reference(models):
    hf, loaded = models
    runner = _runner(loaded)
    V = loaded.config.vocab_size
    prompt = np.random.default_rng(1).integers(0, V, 12).tolist()
    eos, steps = 3, 10
    settings = dict(rep=1.5, freq=0.8, pres=0.5, bias={7: 2.0, 8: -100.0}, min_tokens=4)
    slot = runner.sampling.acquire()
    runner.sampling.seed(slot, lp.initial_flags(V, prompt, [eos]), lp.initial_bias(V, settings["bias"]))
    pages = list(range(4))
    extras = dict(sampling_slot=slot, repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5)
    # an unpenalised neighbour in the same batches must stay plain greedy
    other = np.random.default_rng(2).integers(0, V, 5).tolist()
    res = runner.step([SeqInput(prompt, 0, pages, min_tokens_active=True, **extras), SeqInput(other, 0, [10, 11])])
    got, plain = [int(res.next_tokens[0])], [int(res.next_tokens[1])]
    for i in range(1, steps):
        res = runner.step(
            [
                SeqInput([got[-1]], len(prompt) + i - 1, pages, min_tokens_active=i < settings["min_tokens"], **extras),
                SeqInput([plain[-1]], len(other) + i - 1, [10, 11]),
            ]
        )
        got.append(int(res.next_tokens[0]))
        plain.append(int(res.next_tokens[1]))
    assert got == _reference_penalised_greedy(hf, prompt, steps, eos=eos, **settings)
    assert got != _reference_penalised_greedy(hf, prompt, steps, 1.0, 0.0, 0.0, {}, 0, eos)
    assert plain == _reference_penalised_greedy(hf, other, steps, 1.0, 0.0, 0.0, {}, 0, eos)
    counts = np.asarray(runner.sampling.flags)[slot] & lp.COUNT_MASK
    assert counts.sum() == steps and counts[got].min() >= 1
