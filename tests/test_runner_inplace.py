"""The jitted steps update the donated KV pool in place: no full-pool copy in the compiled program."""

from __future__ import annotations

import re

import pytest

from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import random_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("tokens", [1, 5])  # decode bucket (T == B) and extend bucket
def test_step_program_never_copies_the_pool(tokens):
    runner = ModelRunner(random_model(CONFIG), RunnerConfig(page_size=4, num_device_pages=97, max_batch_tokens=32, max_batch_size=2, max_context_tokens=128))
    seq = SeqInput(list(range(tokens)), 8, list(range(4)))
    inputs = runner._pack([seq])  # noqa: SLF001
    hlo = runner._step.lower(runner.state, runner.pool.kv, inputs, all_logits=False).compile().as_text()  # noqa: SLF001
    pool_shapes = {"3,2,97,4,2,16", "3,2,388,2,16"}  # the pool and its flat-slot view
    copies = [line for line in hlo.splitlines() if re.search(r"\bcopy\(", line) and any(f"[{s}]" in line for s in pool_shapes)]
    assert not copies, copies[:3]
    assert "input_output_alias" in hlo or "must-alias" in hlo or "may-alias" in hlo
