"""The simulator's mixture-of-experts model: weights held (memory), multiplied per token
(FLOPs) and read per decode step (the expected union of the experts a batch picks), against
a plain count from the published shapes and the published parameter totals; dense models
priced exactly as before; the scheduler's prefill prior counting active experts."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.sim.cost import SimCostModel
from strata_jax.sim.model_spec import BUILTIN_MODELS, load_model_spec
from strata_jax.sim.profile import load_profile

H200 = load_profile("h200")

# The published shapes, written out again (config.json of Qwen/Qwen3-30B-A3B, openai/gpt-oss-120b)
QWEN3 = dict(
    layers=48, hidden=2048, q_heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, expert_width=768, vocab=151936
)
GPT_OSS = dict(
    layers=36, hidden=2880, q_heads=64, kv_heads=8, head_dim=64, experts=128, top_k=4, expert_width=2880, vocab=201088
)


def plain_counts(s: dict[str, int], qk_norm: bool, qkv_bias: bool, gpt_oss: bool = False) -> tuple[int, int, int]:
    """(total, active, one expert) parameters: per layer q/k/v/o, two RMSNorms (+ q/k norms),
    q/k/v biases, the router and every (or k) gate/up/down experts; untied embedding and LM
    head; the final norm.  ``gpt_oss``: o_proj's bias, a sink per query head, the router's
    bias and every expert's gate/up/down biases too."""
    h, hd = s["hidden"], s["head_dim"]
    q, kv = s["q_heads"] * hd, s["kv_heads"] * hd
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if qkv_bias else 0) + (h + s["q_heads"] if gpt_oss else 0)
    norms = 2 * h + (2 * hd if qk_norm else 0)
    router = h * s["experts"] + (s["experts"] if gpt_oss else 0)
    expert = 3 * h * s["expert_width"] + (2 * s["expert_width"] + h if gpt_oss else 0)
    embed = 2 * s["vocab"] * h
    total = s["layers"] * (attention + norms + router + s["experts"] * expert) + embed + h
    active = s["layers"] * (attention + norms + router + s["top_k"] * expert) + embed + h
    return total, active, expert


def distinct_experts(e: int, k: int, tokens: int) -> float:
    """P(an expert is missed by one token) = C(e-1, k) / C(e, k) = 1 - k/e; tokens independent."""
    return e * (1.0 - (1.0 - k / e) ** tokens)


def test_qwen3_30b_a3b_counts_match_the_formula_and_the_published_totals():
    spec = load_model_spec("qwen3-30b-a3b")
    total, active, expert = plain_counts(QWEN3, qk_norm=True, qkv_bias=False)
    assert (spec.total_params, spec.active_params, spec.expert_params) == (total, active, expert)
    assert spec.tp == 1 and spec.moe_layers == 48
    # Qwen: "30.5B in total and 3.3B activated", "29.9B non-embedding" (both tables counted)
    assert spec.total_params == pytest.approx(30.5e9, rel=0.03)
    assert spec.active_params == pytest.approx(3.3e9, rel=0.03)
    assert spec.total_params - 2 * 151936 * 2048 == pytest.approx(29.9e9, rel=0.03)
    assert spec.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2  # 96 KiB
    assert spec.config.layer_windows == ()


def test_gpt_oss_120b_counts_match_the_formula_and_the_published_totals():
    spec = load_model_spec("gpt-oss-120b-tp4")
    total, active, expert = plain_counts(GPT_OSS, qk_norm=False, qkv_bias=True, gpt_oss=True)
    assert (spec.total_params, spec.active_params, spec.expert_params) == (total, active, expert)
    assert spec.tp == 4 and spec.moe_layers == 36
    # OpenAI's model card: 116.83B total, 5.13B active (the input embedding not counted active)
    assert round(spec.total_params / 1e9, 2) == 116.83
    assert spec.active_params - 201088 * 2880 == pytest.approx(5.13e9, rel=0.03)
    windows = spec.config.layer_windows
    assert windows[:4] == (128, 0, 128, 0) and windows.count(128) == windows.count(0) == 18
    # bf16 (dequantized MXFP4) over 4 ranks: 58 GB of weights per H200 rank, L1 after them
    assert spec.weight_bytes == pytest.approx(total * 2 / 4)
    cost = SimCostModel(H200, spec, page_size=32)
    assert cost.device_kv_tokens() == int((141e9 * 0.85 - total * 2 / 4) // (36 * 2 * 2 * 64 * 2))


def test_expected_distinct_experts_is_the_union_formula_and_matches_sampling():
    spec = load_model_spec("qwen3-30b-a3b")
    for tokens in (0, 1, 2, 7, 64, 256, 4096):
        assert spec.expected_experts(tokens) == pytest.approx(distinct_experts(128, 8, tokens) if tokens else 0.0)
    assert spec.expected_experts(1) == pytest.approx(8.0)
    assert spec.expected_experts(4096) == pytest.approx(128.0)
    rng = np.random.default_rng(0)
    for tokens in (4, 16):  # uniform routing: each token picks 8 distinct experts of 128
        picks = np.argsort(rng.random((2000, tokens, 128)), axis=-1)[..., :8].reshape(2000, -1)
        counted = np.mean([len(np.unique(row)) for row in picks])
        assert counted == pytest.approx(distinct_experts(128, 8, tokens), rel=0.02)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b-tp4"])
def test_moe_decode_reads_between_the_active_and_all_experts(name):
    spec = load_model_spec(name)
    cost = SimCostModel(H200, spec, page_size=32)
    hbm = H200.hbm_bytes_per_s * H200.hbm_efficiency
    fixed = H200.step_overhead_s + (H200.tp_allreduce_s_per_layer * 2 * spec.config.num_layers if spec.tp > 1 else 0)
    per_rank = 2 / spec.tp

    def bytes_bound(weights: float, batch: int, context: int) -> float:
        return fixed + (weights * per_rank + context * spec.kv_bytes_per_token) / hbm

    m = spec.config.moe
    assert m is not None
    context = 2_000
    one = cost.decode_seconds(1, context)
    assert one == pytest.approx(bytes_bound(spec.active_params, 1, context), rel=1e-9)  # batch 1 reads k experts
    assert spec.step_weight_bytes(1) == pytest.approx(spec.active_params * per_rank)
    for batch in (2, 8, 32, 128):
        seconds = cost.decode_seconds(batch, batch * context)
        unread = m.num_experts - distinct_experts(m.num_experts, m.num_experts_per_tok, batch)
        union = spec.total_params - spec.moe_layers * unread * spec.expert_params
        assert seconds == pytest.approx(bytes_bound(union, batch, batch * context), rel=1e-9)
        assert bytes_bound(spec.active_params, batch, batch * context) < seconds
        assert seconds < bytes_bound(spec.total_params, batch, batch * context)
    big = cost.decode_seconds(512, 512 * context)  # every expert is read at large batch
    assert big == pytest.approx(bytes_bound(spec.total_params, 512, 512 * context), rel=1e-3)
    assert spec.step_weight_bytes(512) < spec.weight_bytes  # never more than what is held


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b-tp4"])
def test_moe_prefill_flops_are_the_active_parameters(name):
    spec = load_model_spec(name)
    c = spec.config
    cost = SimCostModel(H200, spec, page_size=32)
    embed = 2 * c.vocab_size * c.hidden_size
    assert spec.body_params == spec.active_params - embed
    mm = H200.matmul_flops_per_s * H200.matmul_efficiency
    attention = spec.attention_pairs(1000, 0) * 4 * c.num_layers * (c.num_heads / spec.tp) * c.head_dim
    no_attention = cost.extend_seconds([(1000, 0)]) - attention / (H200.matmul_flops_per_s * H200.attention_efficiency)
    fixed = H200.step_overhead_s + (H200.tp_allreduce_s_per_layer * 2 * c.num_layers if spec.tp > 1 else 0)
    linear = (2 * spec.body_params * 1000 + 2 * c.vocab_size * c.hidden_size) / spec.tp / mm
    assert no_attention == pytest.approx(fixed + linear, rel=1e-9)
    # about a tenth of the all-experts FLOPs for Qwen3-30B-A3B, a twenty-fifth for GPT-OSS
    assert spec.body_params < 0.12 * (spec.total_params - embed)


@pytest.mark.parametrize("name", [n for n, (c, _) in BUILTIN_MODELS.items() if c.moe is None])
def test_dense_models_price_as_before(name):
    spec = load_model_spec(name)
    c = spec.config
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    assert spec.body_params == c.num_parameters - embed
    assert spec.active_params == spec.total_params == c.num_parameters
    assert (spec.moe_layers, spec.expert_params, spec.inactive_params, spec.expected_experts(64)) == (0, 0, 0, 0.0)
    cost = SimCostModel(H200, spec, page_size=32)
    fixed = H200.step_overhead_s + (H200.tp_allreduce_s_per_layer * 2 * c.num_layers if spec.tp > 1 else 0)
    for batch in (1, 64, 512):
        assert spec.step_weight_bytes(batch) == spec.weight_bytes
        read = c.num_parameters * 2 / spec.tp + batch * 1000 * spec.kv_bytes_per_token
        flops = batch * 2 * (spec.body_params + c.vocab_size * c.hidden_size) / spec.tp
        expected = fixed + max(
            read / (H200.hbm_bytes_per_s * H200.hbm_efficiency),
            flops / (H200.matmul_flops_per_s * H200.matmul_efficiency),
        )
        assert cost.decode_seconds(batch, batch * 1000) == pytest.approx(expected, rel=1e-12)


def test_compute_prior_counts_active_experts_as_the_simulator_does():
    from strata_jax.runtime.compute_prior import extend_prior, projection_flops

    for name in ("qwen3-30b-a3b", "gpt-oss-120b-tp4"):
        spec = load_model_spec(name)
        c = spec.config
        # the prior counts matmul weights only: the simulator's body less norms and biases
        norms = c.num_layers * (2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)) + c.hidden_size
        bias = c.num_layers * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim if c.attention_bias else 0
        m = c.moe
        assert m is not None
        if c.model_type == "gpt_oss":  # o_proj's bias, the sinks, the router's bias, the k active experts' biases
            per_expert = 2 * m.expert_intermediate_size + c.hidden_size
            bias += c.num_layers * (c.hidden_size + c.num_heads + m.num_experts + m.num_experts_per_tok * per_expert)
        assert projection_flops(c, 1) == 2 * (spec.body_params - norms - bias)
        assert extend_prior(c, 1e12)[1] == pytest.approx(2 * (spec.body_params - norms - bias) / 1e12)
