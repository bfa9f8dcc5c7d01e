"""The scheduler's prefill prior, derived from the model's FLOPs and the measured matmul
rate, against the engine's own measured prefill on the same machine."""

from __future__ import annotations

import time

import numpy as np
import pytest

from strata_jax.api import SamplingParams
from strata_jax.runtime.compute_prior import extend_prior, matmul_flops_per_s


def test_flops_formula_by_hand():
    from strata_jax.models.config import ModelConfig

    cfg = ModelConfig(
        model_type="llama",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    a, b, c = extend_prior(cfg, 1e9)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256  # q, k+v, o, gate/up/down
    assert b == 2 * 2 * per_layer / 1e9
    assert c == 4 * 2 * 64 / 1e9
    assert a == 1e-3 + 2 * 64 * 1000 / 1e9
    assert extend_prior(cfg, 1e9, tp=2)[1] == b / 2


def test_moe_prior_counts_the_active_experts_not_all_of_them():
    import dataclasses

    from strata_jax.models.config import ModelConfig, MoEConfig

    dense = ModelConfig("qwen2_moe", 1000, 64, 256, 2, 4, 2, 16)
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32, norm_topk_prob=True)
    cfg = dataclasses.replace(dense, moe=moe)
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k+v, o
    mlp = 64 * 8 + 2 * 3 * 64 * 32  # router over 8 experts, 2 picked gate/up/down of width 32
    assert extend_prior(cfg, 1e9)[1] == 2 * 2 * (attn + mlp) / 1e9
    shared = dataclasses.replace(cfg, moe=dataclasses.replace(moe, shared_expert_intermediate_size=128))
    assert extend_prior(shared, 1e9)[1] == 2 * 2 * (attn + mlp + 3 * 64 * 128 + 64) / 1e9  # + shared expert, its gate
    # the intermediate_size of a config whose every layer is sparse is not counted
    assert extend_prior(dataclasses.replace(cfg, intermediate_size=9999), 1e9) == extend_prior(cfg, 1e9)


@pytest.mark.heavy  # a timed real prefill: ~80 s on the 2-core CI machine (`pytest -m heavy` runs it)
@pytest.mark.slow
def test_prior_is_within_an_order_of_magnitude_of_a_measured_prefill():
    import jax.numpy as jnp

    from strata_jax.engine import Engine, EngineConfig

    assert matmul_flops_per_s(jnp.float32, n=256) > 1e8  # any machine that runs the suite
    engine = Engine(
        EngineConfig(model="tiny", show_progress=False, tiers="L1", device_tokens=4096, max_batch_tokens=512)
    )
    try:
        predicted = engine.scheduler.cost.extend_seconds(500)  # before any step was observed
        prompt = np.random.default_rng(0).integers(3, 250, size=500).tolist()
        engine.generate([prompt], SamplingParams(max_tokens=1))  # first run: nothing compiles (warm-up did)
        t0 = time.perf_counter()
        engine.generate([prompt[::-1]], SamplingParams(max_tokens=1))
        measured = time.perf_counter() - t0
    finally:
        engine.shutdown()
    assert measured / 10 < predicted < measured * 10, (predicted, measured)
