"""``strata-jax bench twin`` on the embedded tiny model: one trace through the real engine and
the simulator (calibrated from the engine's own steps), side by side.  Plumbing and the
agreement of what does not depend on timing (every request finishes on both sides, the
same tokens hit the cache); the timing agreement on a real model is a benchmark
(docs/study.md, "The simulator against the engine").  ~40 s on 2 cores."""

from __future__ import annotations

import json
import math

from strata_jax.bench import run_benchmark


def test_twin_runs_one_trace_through_the_engine_and_the_simulator(tmp_path, capsys):
    out = tmp_path / "twin.json"
    argv = ["--model", "tiny", "--rates", "2", "--num-requests", "8", "--docs", "2", "--doc-tokens", "192"]
    argv += ["--max-batch-tokens", "64", "--output-tokens", "4", "--tolerance", "1e9", "--json", str(out)]
    assert run_benchmark("twin", argv) == 0
    printed = capsys.readouterr().out
    assert "engine" in printed and "sim" in printed and "TTFT mean" in printed
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    engine, sim = row["engine"], row["sim"]
    assert engine["finished"] == sim["finished"] == 8
    for side in (engine, sim):
        for key in ("ttft_mean", "ttft_p90", "output_tps", "throughput_rps"):
            assert math.isfinite(side[key]) and side[key] > 0, (key, side)
    # What the cache serves does not depend on timing much: the same documents hit on both sides.
    hits_engine, hits_sim = sum(engine["hit_tokens"].values()), sum(sim["hit_tokens"].values())
    assert hits_engine > 0 and abs(hits_sim - hits_engine) <= 0.2 * hits_engine, (engine, sim)
    # The profile came from the engine's own steps, not from the assumed H200.
    profile = doc["profile"]
    assert profile["name"] == "this machine, from the engine's own steps"
    assert profile["matmul_flops_per_s"] < 5e13  # a CPU, not an H200's 989 TFLOP/s


def test_twin_with_kv_layer_groups_turns_on_windows_on_both_sides(tmp_path):
    """``--kv-layer-groups`` on a sliding-window model (a random Gemma 3): the engine's pool holds
    layer groups whose windows move with each request, the simulator loads window-sized pages,
    and both sides still serve the same documents from the cache."""
    from hf_reference import make_hf_model

    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    out = tmp_path / "twin.json"
    argv = ["--model", str(tmp_path / "model"), "--kv-layer-groups", "--rates", "2", "--num-requests", "6"]
    argv += ["--docs", "2", "--doc-tokens", "192", "--max-batch-tokens", "64", "--output-tokens", "4"]
    argv += ["--tolerance", "1e9", "--json", str(out)]
    assert run_benchmark("twin", argv) == 0
    doc = json.loads(out.read_text())
    assert doc["windows"] == {
        "engine_moves_windows": True,
        "sim_window_loads": True,
        "sim_storage_window_reads": False,  # the engine's L3 objects hold every layer
        "sim_cached_share": 1.0,
    }
    (row,) = doc["rows"]
    engine, sim = row["engine"], row["sim"]
    assert engine["finished"] == sim["finished"] == 6
    # each measured question on both sides, in arrival order: its TTFT and what each tier gave it
    assert len(engine["per_request"]) == len(sim["per_request"]) == 6
    for side in (engine, sim):
        for r in side["per_request"]:
            assert r["ttft_s"] > 0 and set(r["cached_tokens"]) >= {"device", "host", "storage"}
    hits_engine, hits_sim = sum(engine["hit_tokens"].values()), sum(sim["hit_tokens"].values())
    assert hits_engine > 0 and abs(hits_sim - hits_engine) <= 0.2 * hits_engine, (engine, sim)
