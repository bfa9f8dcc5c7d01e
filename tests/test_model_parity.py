"""The model matches Hugging Face transformers on the same weights (float32, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import CONFIGS, hf_logits, make_hf_model

from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Saved random HF models by kind, built on first use."""
    built: dict[str, tuple[str, Path, torch.nn.Module]] = {}

    def get(kind: str):
        if kind not in built:
            folder = tmp_path_factory.mktemp(kind)
            built[kind] = (kind, folder, make_hf_model(kind, folder))
        return built[kind]

    return get


def _runner(model, page_size: int, pages: int = 96, context: int = 512) -> ModelRunner:
    return ModelRunner(
        model,
        RunnerConfig(
            page_size=page_size,
            num_device_pages=pages,
            max_batch_tokens=256,
            max_batch_size=4,
            max_context_tokens=context,
        ),
    )


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_full_forward_logits_match_hf(hf_models, kind):
    kind, folder, hf = hf_models(kind)
    loaded = load_model(str(folder))
    # 100 tokens: past llama3_scaled's original_max_position_embeddings (32)
    ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=100).tolist()
    ours = _runner(loaded.model, 16).step([SeqInput(ids, 0, list(range(7)))], all_logits=True).logits
    ref = hf_logits(hf, ids).numpy()
    assert np.abs(ours - ref).max() <= 1e-4, kind
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), kind


@pytest.mark.parametrize("kind", ["llama3_scaled", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_incremental_paged_decode_matches_hf(hf_models, kind, page_size):
    kind, folder, hf = hf_models(kind)
    loaded = load_model(str(folder))
    rng = np.random.default_rng(2)
    ids = rng.integers(0, loaded.config.vocab_size, size=70).tolist()
    num_pages = 160
    runner = _runner(loaded.model, page_size, pages=num_pages)
    # scattered, non-contiguous pages, in a shuffled order
    pages = rng.permutation(num_pages)[: -(-len(ids) // page_size)].tolist()
    prefix = 40
    got = [runner.step([SeqInput(ids[:prefix], 0, pages)], all_logits=True).logits[-1]]
    for pos in range(prefix, len(ids) - 1):
        got.append(runner.step([SeqInput([ids[pos]], pos, pages)], all_logits=True).logits[-1])
    ref = hf_logits(hf, ids).numpy()[prefix - 1 : len(ids) - 1]
    got = np.stack(got)
    assert np.abs(got - ref).max() <= 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_ragged_batch_of_extends_and_decodes_matches_hf(hf_models):
    kind, folder, hf = hf_models("qwen2")
    loaded = load_model(str(folder))
    rng = np.random.default_rng(3)
    runner = _runner(loaded.model, 4, pages=128)
    seqs = [rng.integers(0, loaded.config.vocab_size, size=n).tolist() for n in (23, 9, 31)]
    page_sets = np.split(rng.permutation(120)[:36], 3)
    # prefill the first 20 / 8 / 30 tokens, then one step that extends seq 0 by 3 and decodes seqs 1 and 2
    for ids, pages, done in zip(seqs, page_sets, (20, 8, 30)):
        runner.step([SeqInput(ids[:done], 0, pages.tolist())])
    batch = [
        SeqInput(seqs[0][20:23], 20, page_sets[0].tolist()),
        SeqInput(seqs[1][8:9], 8, page_sets[1].tolist()),
        SeqInput(seqs[2][30:31], 30, page_sets[2].tolist()),
    ]
    logits = runner.step(batch, all_logits=True).logits
    expected = np.concatenate(
        [
            hf_logits(hf, seqs[0]).numpy()[20:23],
            hf_logits(hf, seqs[1]).numpy()[8:9],
            hf_logits(hf, seqs[2]).numpy()[30:31],
        ]
    )
    assert np.abs(logits - expected).max() <= 1e-4


def test_generate_cli_json_matches_hf_greedy(tmp_path):
    folder = tmp_path / "llama"
    hf = make_hf_model("llama3_scaled", folder, seed=5)
    prompt = [5, 17, 33, 2 + 1, 60, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = ref[0, len(prompt) :].tolist()
    cmd = [
        sys.executable,
        "-m",
        "serving.cli",
        "generate",
        "--model",
        str(folder),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    assert out["token_ids"] == expected
