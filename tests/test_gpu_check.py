"""``scripts/gpu_check.sh --dry-run``: every step of the GPU check runs on the CPU with tiny
shapes, so the script (its steps, flags, result files and summary) cannot rot before the
first GPU run.  ~1-1.5 min on 2 cores."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("devices", "tests", "transfer", "roofline", "calibrate", "summary")
FILES = {
    "summary.txt",
    "devices.txt",
    "log.txt",
    "tests.xml",
    "transfer.json",
    "roofline.json",
    "calibrated_profile.json",
}


def _get(doc: dict, path: str) -> object:
    for key in path.split("."):
        assert isinstance(doc, dict) and key in doc, f"missing {path!r} (at {key!r})"
        doc = doc[key]
    return doc


def _finite_positive(doc: dict, *paths: str) -> None:
    for path in paths:
        value = _get(doc, path)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        assert ok, f"{path} = {value!r} is not a finite positive number"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "STRATA_TEST_GPU")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    return proc, out


def test_every_step_passes_and_writes_at_most_8_files(dry_run) -> None:
    proc, out = dry_run
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, f"{summary}\n--- log tail\n{(out / 'log.txt').read_text()[-6000:]}"
    for step in STEPS:
        assert f"step {step}: ok" in summary, summary
    assert "FAILED" not in summary and "gpu_check: every step passed" in summary
    names = {p.name for p in out.iterdir()}
    assert names == FILES and len(names) <= 8
    # the numbers a human wants are in the summary
    for text in (
        "link peak",
        "staging",
        "pinned pages",
        "per-page",
        "TTFT",
        "L1",
        "L2",
        "prefill MFU",
        "decode batch",
        "HBM",
    ):
        assert text in summary, text


def test_the_gpu_tests_were_collected(dry_run) -> None:
    _, out = dry_run
    root = ET.parse(out / "tests.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    assert sum(int(s.get("tests", 0)) for s in suites) > 0
    assert sum(int(s.get("errors", 0)) + int(s.get("failures", 0)) for s in suites) == 0


def test_transfer_results_have_every_path_at_every_page_size(dry_run) -> None:
    _, out = dry_run
    report = json.loads((out / "transfer.json").read_text())
    assert set(report["page_sizes"]) == {"1", "16"}
    assert report["pinned"]["memory_kind"] == "pinned_host"  # offered by jax's CPU client too
    _finite_positive(report, "link_peak.gbps", "link_peak.pageable_gbps", "link_peak.pinned_gbps")
    for size in report["page_sizes"]:
        row = f"page_sizes.{size}."
        _finite_positive(
            report,
            *(
                row + k
                for k in ("coalesced_gbps", "pinned_pages_gbps", "pinned_staging_gbps", "pinned_contiguous_gbps")
            ),
            *(
                row + k
                for k in (
                    "naive_gbps",
                    "pipelined_gbps",
                    "contiguous_gbps",
                    "split_ms.transfer",
                    "pinned_split_ms.transfer",
                )
            ),
        )


def test_roofline_results_have_ttft_per_tier_decode_per_batch_and_mfu(dry_run) -> None:
    _, out = dry_run
    r = json.loads((out / "roofline.json").read_text())
    assert r["errors"] == {}
    _finite_positive(
        r, "peaks.hbm_bytes_per_s", "peaks.matmul_flops_per_s", "model.weight_bytes", "model.kv_bytes_per_token"
    )
    _finite_positive(
        r, "ttft.cold_s", "ttft.l1_s", "ttft.l2_s", "prefill.ttft_mfu", "prefill.chunk_mfu", "prefill.chunk_s"
    )
    assert (
        r["ttft"]["l1_served_by_device"] and r["ttft"]["l2_served_by_host"]
    )  # each tier timed is the tier that served
    assert set(r["decode"]["batches"]) == {"1", "2", "4"}
    for batch in r["decode"]["batches"]:
        row = f"decode.batches.{batch}."
        _finite_positive(
            r,
            *(row + k for k in ("step_s", "pipelined_step_s", "bytes_per_step", "hbm_bytes_per_s", "hbm_utilisation")),
        )


def test_calibrated_profile_is_a_profile_the_simulator_loads(dry_run) -> None:
    from strata_jax.sim.profile import load_profile

    _, out = dry_run
    path = out / "calibrated_profile.json"
    _finite_positive(
        json.loads(path.read_text()),
        "link_peak_bytes_per_s",
        "hbm_bytes_per_s",
        "matmul_flops_per_s",
        "coalesced_efficiency",
    )
    assert load_profile(str(path)).name.startswith("calibrated:")
