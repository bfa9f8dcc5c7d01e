"""``strata-jax bench mixed`` on the tiny model: both settings run, the table and JSON come out,
the tokens are compared, bad flags are one-line errors."""

from __future__ import annotations

import json

import pytest

from strata_jax.bench import run_benchmark


def test_bench_mixed_runs_both_settings_and_compares_their_tokens(tmp_path, capsys):
    out = tmp_path / "mixed.json"
    argv = ["--streams", "2", "--stream-tokens", "48", "--docs", "2", "--doc-tokens", "300"]
    argv += ["--max-batch-tokens", "64", "--repeats", "1", "--json", str(out)]
    assert run_benchmark("mixed", argv) == 0
    printed = capsys.readouterr().out
    assert "mixed=off" in printed and "mixed=on" in printed
    assert "greedy tokens identical in every run: yes" in printed
    data = json.loads(out.read_text())
    assert data["identical"] is True and data["mixed_steps_on"] > 0  # (else the comparison proves nothing)
    for metric in ("itl_mean_ms", "itl_p99_ms", "doc_ttft_mean_s", "output_tok_s"):
        m = data["summary"][metric]
        assert m["off"] > 0 and m["on"] > 0 and m["ratio"] == pytest.approx(m["on"] / m["off"])


def test_bench_mixed_refuses_a_bad_count():
    with pytest.raises(SystemExit, match="--streams must be at least 1"):
        run_benchmark("mixed", ["--streams", "0"])
