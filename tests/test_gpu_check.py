"""``scripts/gpu_check.sh --dry-run``: every step of the GPU check runs on the CPU with tiny
shapes, so the script (its steps, flags, result files and summary) cannot rot before the
first GPU run.  ~2-2.5 min on 2 cores.  The MoE step's comparison logic is also checked
without jax (``compare_moe`` on made-up logits)."""

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
STEPS = ("devices", "tests", "transfer", "roofline", "calibrate", "moe", "summary")
FILES = {
    "summary.txt",
    "devices.txt",
    "log.txt",
    "tests.xml",
    "transfer.json",
    "roofline.json",
    "calibrated_profile.json",
    "moe.json",
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
        "MoE",
        "greedy tokens equal",
        "grouped/dense",
        "verification of 4 x 8 tokens",
        "speculation pays above",
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
    # the speculative verification beside the decode at the batches asked for
    verified = {b for b, row in r["decode"]["batches"].items() if "verify_step_s" in row}
    assert verified == {"1", "4"}
    for batch in verified:
        _finite_positive(r, f"decode.batches.{batch}.verify_step_s", f"decode.batches.{batch}.verify_over_decode")
        assert r["decode"]["batches"][batch]["verify_tokens"] == 8
    # the mixed step (a chunk with the decode rows in its program) against the two programs, at every batch
    # whose rows fit beside the chunk in its program (the largest batch is the engine's max_batch_size)
    mixed = {b for b, row in r["decode"]["batches"].items() if "mixed_step_s" in row}
    assert mixed == {"1", "2"}
    for batch in mixed:
        row = f"decode.batches.{batch}."
        _finite_positive(r, *(row + k for k in ("mixed_step_s", "chunk_alone_s", "mixed_over_separate")))
        assert r["decode"]["batches"][batch]["mixed_chunk_tokens"] == 256 - int(batch)


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


def test_moe_step_serves_the_tiny_moe_model_and_compares_it_with_the_cpu(dry_run) -> None:
    """On the CPU both sides are the CPU: the engine's tokens equal the child process's (the
    reference path runs, as it will beside a GPU), the logits exactly; step times and the
    layer comparison's rates are there."""
    _, out = dry_run
    r = json.loads((out / "moe.json").read_text())
    assert r["errors"] == {} and r["phases"] == ["engine", "layer", "compare"]
    assert r["model"]["model_type"] == "qwen2_moe" and r["model"]["shared_expert_width"] > 0
    assert r["compare"]["ok"] and r["compare"]["tokens_equal"]
    assert [p["prompt_tokens"] for p in r["compare"]["prompts"]] == r["engine"]["prompt_tokens"]
    assert r["compare"]["max_abs_logit_diff"] <= 1e-4 * r["compare"]["max_abs_logit"]
    assert r["reference"]["device"]["platform"] == "cpu"
    _finite_positive(r, "engine.decode_step_ms", "engine.prefill_step_ms", "compare.max_abs_logit", "seconds")
    assert all(len(tokens) == r["engine"]["new_tokens"] for tokens in r["engine"]["tokens"])
    layer = r["layer"]
    # token counts past the step's time box are skipped, not failed (a loaded CPU may get there)
    assert layer["points"] and [p["tokens"] for p in layer["points"]] + layer["skipped"] == [8, 64]
    for point in layer["points"]:
        _finite_positive(
            point,
            *("expert_gflops." + path for path in ("grouped", "dense", "loop", "block")),
            "ratios.grouped_vs_dense",
            "ratios.grouped_vs_loop",
        )
        assert point["rel_err"]["grouped_vs_loop"] < 1e-5


def _greedy(tokens: list[list[int]], logits: list[list[float]]) -> dict:
    return {"prompt_tokens": [2], "tokens": tokens, "logits": [logits]}


def test_compare_moe_fails_a_different_token_unless_it_is_a_near_tie() -> None:
    from strata_jax.bench.gpu_check import MOE_NEAR_TIE, compare_moe

    # prompt of 2 tokens, 3 generated: teacher-forced rows 0..3; row 1 predicts generated token 0
    logits = [[0.0, 1.0, 5.0], [4.0, 0.0, 1.0], [0.0, 3.0, 1.0], [1.0, 1.0, 2.0]]
    same = compare_moe(_greedy([[0, 1, 2]], logits), _greedy([[0, 1, 2]], logits))
    assert same["ok"] and same["tokens_equal"] and same["max_abs_logit_diff"] == 0.0
    # token 1 differs where the CPU's best two logits are 3 apart: a failure, the rows up to it compared
    moved = [row[:] for row in logits]
    moved[3] = [9.0, 9.0, 9.0]  # past the first difference: not compared
    diff = compare_moe(_greedy([[0, 2, 2]], moved), _greedy([[0, 1, 2]], logits))
    assert not diff["ok"] and diff["prompts"][0]["first_mismatch"] == 1
    assert diff["prompts"][0]["ref_top2_gap"] == 2.0 and not diff["prompts"][0]["near_tie"]
    assert diff["max_abs_logit_diff"] == 0.0
    # the same difference at a near tie of the CPU's logits passes, reported
    tied = [row[:] for row in logits]
    tied[2] = [0.0, 3.0, 3.0 - MOE_NEAR_TIE / 2]
    near = compare_moe(_greedy([[0, 2, 2]], tied), _greedy([[0, 1, 2]], tied))
    assert near["ok"] and not near["tokens_equal"] and near["prompts"][0]["near_tie"]
    # equal tokens but logits off by more than the tolerance: a failure
    off = [[v + 1.0 for v in row] for row in logits]
    assert not compare_moe(_greedy([[0, 1, 2]], off), _greedy([[0, 1, 2]], logits))["ok"]


def test_summary_reports_a_missing_moe_result(tmp_path) -> None:
    from strata_jax.bench.gpu_check import summarize

    assert "moe: moe.json: missing" in summarize(tmp_path)
