"""``strata-jax bench prefill``: the FLOP count, the chunk plan, the shares, and one small run
on the tiny model (the figures themselves are benchmarks, not tests)."""

from __future__ import annotations

import json

import pytest

from strata_jax.bench import BENCHMARKS, run_benchmark
from strata_jax.bench.prefill import PARTS, ChunkPlan, plan_chunks, split_shares
from strata_jax.models.config import ModelConfig
from strata_jax.runtime.compute_prior import attention_flops, projection_flops


def test_registered():
    assert BENCHMARKS["prefill"] == "strata_jax.bench.prefill"


def test_projection_flops_hand_count():
    config = ModelConfig(
        model_type="llama",
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    # per token and layer, multiply-adds: q 8x8, k 8x4, v 8x4, o 8x8, gate 8x16, up 8x16, down 16x8
    macs = 64 + 32 + 32 + 64 + 128 + 128 + 128
    assert projection_flops(config, 5) == 2 * 5 * 3 * macs == 17280
    assert projection_flops(config, 0) == 0
    # attention: 2 query heads x head_dim 4, 3 layers; QK^T + PV = 4 FLOPs per key, head dim and head
    per_key = 4 * 2 * 4 * 3
    assert attention_flops(config, 0, 2) == (1 + 2) * per_key  # tokens 0 and 1 see 1 and 2 keys
    assert attention_flops(config, 2, 1) == 3 * per_key  # token 2 sees 3 keys
    assert attention_flops(config, 0, 3) == attention_flops(config, 0, 2) + attention_flops(config, 2, 1)


def test_plan_chunks_takes_the_engines_buckets():
    shapes = [(16, 2), (32, 4), (64, 4)]  # (tokens, rows) as ModelRunner.extend_shapes
    assert plan_chunks(100, 64, shapes) == [ChunkPlan(0, 64, 64, 4), ChunkPlan(64, 36, 64, 4)]
    assert plan_chunks(40, 32, shapes) == [ChunkPlan(0, 32, 32, 4), ChunkPlan(32, 8, 16, 2)]
    assert plan_chunks(40, 32, shapes)[1].padding == 8


def test_shares_sum_to_one_with_host_and_remainder():
    parts = {"matmuls": 2.0, "attention": 1.0, "padding": 0.5}
    seconds, shares = split_shares(parts, device_s=4.0, ttft_s=5.0)
    assert seconds["host"] == pytest.approx(1.0) and seconds["other"] == pytest.approx(0.5)
    assert sum(shares.values()) == pytest.approx(1.0)
    seconds, shares = split_shares(parts, device_s=3.0, ttft_s=3.2)  # pieces overlap: a negative remainder
    assert seconds["other"] == pytest.approx(-0.5) and sum(shares.values()) == pytest.approx(1.0)


def test_bench_on_the_tiny_model(tmp_path, capsys):
    path = tmp_path / "prefill.json"
    # 40 tokens in chunks of 32: a full 32-token bucket, then 8 tokens padded to 16.
    argv = ["--tokens", "40", "--chunk", "32", "--max-batch-size", "4", "--repeats", "1", "--json", str(path)]
    assert run_benchmark("prefill", argv) == 0
    printed = capsys.readouterr().out
    assert "other / overlap" in printed and "GFLOP/s" in printed
    report = json.loads(path.read_text())
    (r,) = report["results"]
    assert [(p["tokens"], p["bucket"]) for p in r["plans"]] == [(32, 32), (8, 16)]
    for name in PARTS:
        assert r["parts"][name] > 0, name
    assert r["ttft_s"] > 0 and r["device_s"] > 0
    assert set(r["shares"]) == {*PARTS, "host", "other"}
    assert sum(r["shares"].values()) == pytest.approx(1.0, abs=1e-9)
    assert sum(r["seconds"].values()) == pytest.approx(r["ttft_s"], rel=1e-9)
    assert [s[0] for s in r["engine"]["median"]["steps"]] == [32, 8]  # the engine ran the planned steps
    m = r["matmul"]
    assert m["projection_flops"] == projection_flops_tiny(40)
    assert m["achieved_flops_per_s"] > 0 and m["machine_flops_per_s"] > 0
    assert r["drift"]["ratio"] >= 1.0 and "machine check" in printed
    assert r["attention"]["causal_flops"] == attention_flops_tiny(0, 32) + attention_flops_tiny(32, 8)


def test_a_prompt_past_the_models_context_is_one_line():
    """The tiny model's 16,384 tokens: a 16,384-token prompt and its first token do not fit."""
    argv = ["--tokens", "16384", "--chunk", "32", "--max-batch-size", "4", "--repeats", "1"]
    with pytest.raises(SystemExit, match=r"--tokens 16384: the prompt and its first token need 16385 .*16384"):
        run_benchmark("prefill", argv)


def projection_flops_tiny(tokens: int) -> float:
    from strata_jax.models.loader import tiny_config

    return projection_flops(tiny_config(), tokens)


def attention_flops_tiny(start: int, tokens: int) -> float:
    from strata_jax.models.loader import tiny_config

    return attention_flops(tiny_config(), start, tokens)


def test_prefill_hf_side_by_side_on_a_random_llama(tmp_path, capsys):
    """``bench prefill-hf`` on a small random Llama saved as a HF folder: both sides prefill
    the same prompts in chunks, agree on every greedy first token, and report their ratio."""
    from hf_reference import make_hf_model

    make_hf_model("qwen2", tmp_path / "model")
    out = tmp_path / "r.json"
    argv = ["--model", str(tmp_path / "model"), "--tokens", "70", "--chunk", "32", "--repeats", "2", "--json", str(out)]
    assert run_benchmark("prefill-hf", argv) == 0
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2
    assert all(r["engine_token"] == r["hf_token"] and r["engine_s"] > 0 and r["hf_s"] > 0 for r in report["rounds"])
    assert "strata-jax / transformers" in capsys.readouterr().out
