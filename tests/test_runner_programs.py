"""Fewer programs: one decode program per batch bucket, one extend program per token
bucket; every batch the runner accepts runs one of them (no compile after warm-up)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import random_model
from strata_jax.runtime.buckets import extend_rows
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def test_program_grid_at_the_default_budget():
    runner = ModelRunner(
        random_model(CONFIG), RunnerConfig(max_batch_tokens=512, max_batch_size=16, num_device_pages=8)
    )
    assert runner.decode_shapes == ((1, 1), (2, 2), (4, 4), (8, 8), (16, 16))
    assert runner.extend_shapes == ((16, 2), (32, 4), (64, 8), (128, 16), (256, 16), (512, 16))
    # was every (token bucket, batch bucket) pair: 5 decode + 29 extend programs
    assert len(runner.program_shapes) == 11


def test_speculation_adds_one_verification_program_per_batch_bucket():
    """k + 1 tokens per row for each decode batch bucket (a token bucket's size is not
    repeated), sorted so the smallest program holding a verification batch is picked."""
    runner = ModelRunner(
        random_model(CONFIG),
        RunnerConfig(max_batch_tokens=512, max_batch_size=16, num_device_pages=8, verify_tokens_per_row=8),
    )
    assert runner.extend_shapes == ((8, 1), (16, 2), (32, 4), (64, 8), (128, 16), (256, 16), (512, 16))
    runner = ModelRunner(
        random_model(CONFIG),
        RunnerConfig(max_batch_tokens=64, max_batch_size=16, num_device_pages=8, verify_tokens_per_row=5),
    )
    assert runner.extend_shapes == ((5, 1), (10, 2), (16, 2), (20, 4), (32, 4), (40, 8), (64, 16))
    assert runner._shape_for(5, 1, decode=False) == (5, 1)
    assert runner._shape_for(3 * 5, 3, decode=False) == (20, 4)
    assert runner._shape_for(12, 1, decode=False) == (16, 2)
    with pytest.raises(ValueError, match="verify_tokens_per_row"):
        RunnerConfig(verify_tokens_per_row=1)


@pytest.mark.parametrize(
    "tokens,maximum,batch,rows",
    [(16, 512, 16, 2), (512, 512, 16, 16), (64, 64, 16, 16), (17, 17, 16, 16), (4, 512, 16, 1)],
)
def test_extend_rows(tokens, maximum, batch, rows):
    assert extend_rows(tokens, maximum, batch) == rows
    assert rows < tokens  # T == B is the decode shape


def test_random_batches_after_warmup_compile_nothing_and_match_one_by_one():
    runner = ModelRunner(
        random_model(CONFIG),
        RunnerConfig(page_size=4, num_device_pages=256, max_batch_tokens=32, max_batch_size=4, max_context_tokens=64),
    )
    reports = []
    compiled = runner.warmup(show_progress=False, progress=lambda done, total: reports.append((done, total)))
    assert compiled == len(runner.program_shapes)
    assert reports == [(i, compiled) for i in range(compiled + 1)]
    rng = np.random.default_rng(0)
    next_page = 0
    for _ in range(8):
        n = int(rng.integers(1, 5))
        lens = rng.integers(1, 9, size=n) if rng.random() < 0.7 else np.ones(n, int)
        while lens.sum() > 32:
            lens = lens[:-1]
        seqs = []
        for length in lens:
            pages = list(range(next_page, next_page + 2))
            next_page = (next_page + 2) % 254
            seqs.append(SeqInput(list(rng.integers(0, 64, size=int(length))), 0, pages))
        batched = runner.step(seqs)
        assert runner.compile_count == compiled
        for i, seq in enumerate(seqs):  # each alone (it rewrites its own pages with the same K/V)
            alone = runner.step([seq])
            assert alone.next_tokens[0] == batched.next_tokens[i]
