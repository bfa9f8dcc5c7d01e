"""``scripts/study_rerun.sh --quick``: the study's headline tables re-run with a given
profile (the recipe a first GPU run uses with its calibrated profile), so the script cannot
rot.  ~25 s on 2 cores."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("cold", "warm", "stages-max", "stages-shuffle", "stages-min", "fp8", "windows")


def test_quick_rerun_with_a_given_profile_writes_every_table(tmp_path):
    profile = json.loads((ROOT / "strata_jax/sim/profiles/h200.json").read_text())
    profile["name"] = "slow-matmul test profile"
    profile["matmul_flops_per_s"] /= 2  # a measured profile differs from the assumed one
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(profile))
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/study_rerun.sh"), "--quick", "--profile", str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert f"profile: {path}" in summary and "slow-matmul test profile" in summary
    for name in TABLES:
        runs = json.loads((out / f"{name}.json").read_text())["runs"]
        assert runs, name
        for run in runs:
            assert run["finished"] > 0, (name, run)
            assert all(math.isfinite(run[k]) and run[k] >= 0 for k in ("ttft_mean", "throughput_rps")), (name, run)
        assert f"== {name}:" in summary and "sustained rate" in summary

    # The profile reached the simulator: the cold table equals a direct run with it, and
    # differs from the same run on the study's assumed H200 profile (half its matmul rate).
    def direct(profile_arg: str) -> list[dict]:
        target = tmp_path / f"direct-{Path(profile_arg).stem}.json"
        cmd = [sys.executable, "-m", "serving.cli", "simulate", "--profile", profile_arg, "--rates", "1,2"]
        cmd += ["--num-requests", "30", "--no-progress", "--json", str(target), "--systems", "hicache,strata"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
        return json.loads(target.read_text())["runs"]

    cold = json.loads((out / "cold.json").read_text())["runs"]
    key = ("system", "rate", "ttft_mean", "finished")
    assert [{k: r[k] for k in key} for r in cold] == [{k: r[k] for k in key} for r in direct(str(path))]
    assert [r["ttft_mean"] for r in cold] != [r["ttft_mean"] for r in direct("h200")]
