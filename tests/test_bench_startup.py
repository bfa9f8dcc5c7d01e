"""bench startup's pieces: the random HF folders it writes load as HF checkpoints (and
transformers agrees on the logits), and its ratios are the issue's."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from strata_jax.bench.startup import ratios, write_random_model
from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

SMALL = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def test_random_model_folder_loads_and_matches_transformers(tmp_path):
    folder = write_random_model(tmp_path / "m", 3, width=SMALL)
    loaded = load_model(str(folder))
    assert loaded.config.num_layers == 3 and loaded.model.model.layers.mlp.up_proj.kernel.shape == (3, 32, 48)
    ids = [5, 9, 2, 77, 31, 8]
    runner = ModelRunner(
        loaded.model,
        RunnerConfig(page_size=4, num_device_pages=4, max_batch_tokens=16, max_batch_size=2, max_context_tokens=16),
    )
    ours = runner.step([SeqInput(ids, 0, [0, 1])], all_logits=True).logits[: len(ids)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_ratios():
    rows = [
        {"name": "2L", "mode": "cold", "ready_s": 10.0},
        {"name": "2L", "mode": "warm", "ready_s": 2.0},
        {"name": "32L", "mode": "cold", "ready_s": 15.0},
        {"name": "32L", "mode": "warm", "ready_s": 3.0},
    ]
    assert ratios(rows) == {"2L warm/cold": 0.2, "32L warm/cold": 0.2, "32L/2L cold": 1.5}
    # repeats: the ratios are of the medians
    rows += [
        {"name": "2L", "mode": "cold", "ready_s": 30.0},
        {"name": "2L", "mode": "cold", "ready_s": 20.0},
        {"name": "2L", "mode": "warm", "ready_s": 5.0},
        {"name": "2L", "mode": "warm", "ready_s": 4.0},
    ]
    assert ratios(rows) == {"2L warm/cold": 4.0 / 20.0, "32L warm/cold": 0.2, "32L/2L cold": 15.0 / 20.0}
