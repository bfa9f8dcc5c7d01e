"""``strata-jax bench spec`` runs end to end on the tiny model: both engines, every workload,
the tokens compared (the numbers themselves mean something only on a real model)."""

from __future__ import annotations

import json
import math

import pytest

from strata_jax.bench import run_benchmark


def test_bench_spec_runs_every_workload_and_compares_tokens(tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = [
        "--doc-chars",
        "500",
        "--batches",
        "1,2",
        "--burst",
        "3",
        "--tokens",
        "12",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert run_benchmark("spec", argv) == 0
    data = json.loads(out.read_text())
    runs = [r["run"] for r in data["rows"]]
    assert runs == [f"{kind} b{b}" for b in (1, 2) for kind in ("copying", "quoting", "free")] + ["burst 3"]
    assert data["mismatched_requests"] == 0
    for row in data["rows"]:
        assert row["base_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
        assert math.isclose(row["ratio"], row["spec_tokens_per_s"] / row["base_tokens_per_s"])
        assert row["mean_accepted_length"] == 0 or 1 <= row["mean_accepted_length"] <= 8
        assert set(row["idle_dispatches_per_100"]) == {"base", "spec"}
        assert all(0 <= v <= 100 for v in row["idle_dispatches_per_100"].values())
    printed = capsys.readouterr().out
    assert "greedy tokens identical with and without speculation: yes" in printed
    assert "idle dispatches per 100" in printed


@pytest.mark.heavy  # ~1 min; the engine-level sampled checks are in test_spec_engine (default suite)
def test_bench_spec_compares_sampled_tokens_under_a_seed(tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["--doc-chars", "400", "--batches", "2", "--burst", "0", "--tokens", "10", "--repeats", "1"]
    argv += ["--temperature", "0.1", "--seed", "3", "--json", str(out)]
    assert run_benchmark("spec", argv) == 0
    assert json.loads(out.read_text())["mismatched_requests"] == 0
    printed = capsys.readouterr().out
    assert "temperature 0.1 (seed 3)" in printed
    assert "sampled (seed 3) tokens identical with and without speculation: yes" in printed
