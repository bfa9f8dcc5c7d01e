"""Cache benchmarks: hit-rate shapes the issue predicts, on small but proportional workloads."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from strata_jax.bench import load_benchmark, run_benchmark

TRACE = "/work/shared/data/mooncake/conversation_trace.jsonl"


def _multiturn(tmp_path, *extra: str) -> dict:
    out = tmp_path / "mt.json"
    argv = [
        "--clients",
        "6",
        "--rounds",
        "14",
        "--request-length",
        "64",
        "--output-length",
        "16",
        "--page-size",
        "16",
        "--device-rounds",
        "3",
        "--json",
        str(out),
        *extra,
    ]
    assert run_benchmark("multiturn", argv) == 0
    return json.loads(out.read_text())


def _collapse_round(rounds: list[dict]) -> int:
    """First round (after round 0) whose hit rate falls below half of the ceiling."""
    return next(r["round"] for r in rounds if r["round"] > 0 and r["hit_rate"] < 0.5 * r["ceiling"])


def test_multiturn_l1_collapses_near_k(tmp_path) -> None:
    res = _multiturn(tmp_path, "--no-model", "--tiers", "L1")
    rounds = res["rounds"]
    assert all(abs(r["hit_rate"] - r["ceiling"]) < 1e-9 for r in rounds[:3])  # fits: ceiling
    assert 3 <= _collapse_round(rounds) <= 5  # k = 3
    assert rounds[-1]["hit_rate"] == 0.0  # cyclic LRU: every history evicted just before reuse


def test_multiturn_l2_write_through_moves_collapse_to_2k(tmp_path) -> None:
    res = _multiturn(tmp_path, "--no-model", "--tiers", "L1+L2", "--hicache-ratio", "2")
    assert 6 <= _collapse_round(res["rounds"]) <= 8  # about 2k
    assert any(r["host"] > 0.5 for r in res["rounds"])


def test_multiturn_l3_tracks_reuse_ceiling(tmp_path) -> None:
    res = _multiturn(tmp_path, "--no-model", "--tiers", "L1+L2+L3")
    for r in res["rounds"]:
        assert r["hit_rate"] == pytest.approx(r["ceiling"], abs=1e-9)
    assert res["rounds"][-1]["storage"] > 0.5


def test_multiturn_with_real_arrays_verifies_every_hit(tmp_path) -> None:
    res = _multiturn(
        tmp_path,
        "--tiers",
        "L1+L2+L3",
        "--verify",
        "--storage",
        "file",
        "--storage-dir",
        str(tmp_path / "kv"),
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "8",
    )
    assert res["verified_pages"] > 0
    for r in res["rounds"]:
        assert r["hit_rate"] == pytest.approx(r["ceiling"], abs=1e-9)


@pytest.mark.skipif(not os.path.exists(TRACE), reason="needs the shared Mooncake trace")
def test_trace_unlimited_equals_ideal_and_bounded_is_monotone(tmp_path) -> None:
    out = tmp_path / "trace.json"
    argv = [
        "--trace",
        TRACE,
        "--limit",
        "250",
        "--no-model",
        "--tiers",
        "L1",
        "--page-size",
        "16",
        "--sweep",
        "0.05,0.15,0.4,1.0",
        "--json",
        str(out),
    ]
    assert run_benchmark("trace", argv) == 0
    res = json.loads(out.read_text())
    assert res["requests"] == 250
    assert res["hit_rate"] == pytest.approx(res["ideal_hit_rate"], abs=1e-12)
    rates = [s["hit_rate"] for s in res["sweep"]]
    assert all(a <= b + 1e-12 for a, b in zip(rates, rates[1:])), rates
    assert rates[0] < rates[-1]


def test_trace_block_tokens_follow_the_spec() -> None:
    from strata_jax.bench.trace import prompt_tokens

    toks = prompt_tokens({"input_length": 600, "hash_ids": [7, 3]})
    assert len(toks) == 600 and toks[0] == 7 * 512 and toks[512] == 3 * 512 and toks[-1] == 3 * 512 + 87


def test_match_bench_runs_small() -> None:
    argv = [
        "--tree-tokens",
        "60000",
        "--prompt-tokens",
        "8192",
        "--turn-tokens",
        "1024",
        "--queries",
        "5",
        "--target-ms",
        "1000",
    ]
    assert run_benchmark("match", argv) == 0


def test_probe_bench_runs_small(tmp_path) -> None:
    out = tmp_path / "probe.json"
    argv = ["--waiting", "20", "--prompt-tokens", "256", "--rounds", "2", "--json", str(out)]
    assert run_benchmark("probe", argv) == 0
    report = json.loads(out.read_text())
    assert report["memo_off_round_ms"] > 0 and report["memo_on_round_ms"] > 0 and report["waiting"] == 20


@pytest.mark.parametrize("name", ["multiturn", "trace", "match", "probe"])
def test_every_flag_has_help(name: str) -> None:
    parser = argparse.ArgumentParser()
    load_benchmark(name).add_arguments(parser)
    for action in parser._actions:
        assert action.help, f"{name}: flag {action.option_strings} has no help text"
