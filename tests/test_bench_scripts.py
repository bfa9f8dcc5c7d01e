"""``scripts/bench_ttft_ab.py``: two checkouts' engines in alternating subprocesses (here the
same checkout twice, on the tiny model), each run's TTFTs and the medians' ratio printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.heavy
def test_ttft_side_by_side_runs_each_tree_and_prints_the_ratio():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_ttft_ab.py"),
            "--before",
            str(ROOT),
            "--model",
            "tiny",
            "--tokens",
            "96",
            "--chunk",
            "32",
            "--prompts",
            "1",
            "--rounds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    runs = [line for line in lines if line.startswith("round ")]
    assert [line.split(":")[0] for line in runs] == [
        "round 0 before",
        "round 0 after",
        "round 1 after",
        "round 1 before",
    ]
    summary = re.fullmatch(
        r"96 tokens, chunk 32: before ([\d.]+) s, after ([\d.]+) s \(medians of 2\); after / before ([\d.]+)", lines[-1]
    )
    assert summary, lines
    before, after, ratio = (float(x) for x in summary.groups())
    assert before > 0.005 and after > 0.005
    # the medians are printed to 0.01 s, the ratio from the unrounded ones
    assert (after - 0.005) / (before + 0.005) - 0.001 <= ratio <= (after + 0.005) / (before - 0.005) + 0.001
