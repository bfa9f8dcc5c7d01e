"""Smoke tests of ``strata-jax bench transfer`` / ``attention``: they run on tiny shapes and
write JSON with the documented keys (the figures themselves are benchmarks, not tests)."""

from __future__ import annotations

import json

from strata_jax.bench import run_benchmark


def test_transfer_bench_json_schema(tmp_path):
    path = tmp_path / "transfer.json"
    argv = [
        "--layers",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--page-sizes",
        "1,4",
        "--total-mb",
        "0.0625",
        "--repeats",
        "1",
        "--pool-growth",
        "2",
        "--chunk-mb",
        "0.0078125",
        "--json",
        str(path),
    ]
    assert run_benchmark("transfer", argv) == 0
    report = json.loads(path.read_text())
    assert report["platform"] == "cpu" and report["memcpy_gbps"] > 0
    assert set(report["page_sizes"]) == {"1", "4"}
    for row in report["page_sizes"].values():
        for key in ("naive_gbps", "coalesced_gbps", "pipelined_gbps", "contiguous_gbps"):
            assert row[key] > 0
        assert (
            row["pipelined_chunk_pages"] * row["page_bytes"]
            <= 8192
            < 2 * row["pipelined_chunk_pages"] * row["page_bytes"]
        )
        assert set(row["split_ms"]) == {"gather", "transfer", "scatter"}
        assert row["bytes"] == 64 * 1024  # same bytes at every page size
    assert "donated_ratio" in report["pool_growth"]
    assert "coalesced_ge_5x_naive_at_page_1" in report["targets"]


def test_attention_bench_json(tmp_path):
    path = tmp_path / "attention.json"
    argv = [
        "--batch",
        "2",
        "--context",
        "20",
        "--extend-seqs",
        "1",
        "--extend-tokens",
        "3",
        "--q-heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--page-size",
        "4",
        "--repeats",
        "1",
        "--json",
        str(path),
    ]
    assert run_benchmark("attention", argv) == 0
    report = json.loads(path.read_text())
    assert report["kernel"] == "interpret"
    for name in ("decode", "extend"):
        assert report[name]["max_abs_err"] < 1e-4
        assert report[name]["kernel_ms"] > 0
