"""scripts/fleet.sh end to end: two `strata-jax serve` replicas of the tiny model (one CPU each),
one redis-server as their shared L3, and SGLang's model gateway (sglang-router 0.3.2, from its
own virtualenv) in front; everything on loopback, started and stopped by the script.

Skipped, saying why, without redis-server, taskset or two CPUs, or when sglang-router cannot be
installed (no network and no virtualenv from an earlier run).  Marked heavy (left out of the
default run): `python -m pytest -q -m heavy tests/test_fleet.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLEET = ROOT / "scripts" / "fleet.sh"
NAME = "tiny-fleet"
# 4 LooGLE (or synthetic) documents of 600 bytes = ~650 tiny-model tokens, 3 questions each
BENCH_FLAGS = "--docs 4 --questions 3 --doc-chars 600 --concurrency 2"
SERVE_FLAGS = "--max-context-tokens 2048"


def test_fleet_scripts_parse():
    for name in ("fleet.sh", "fleet_bench.py"):
        path = str(ROOT / "scripts" / name)
        cmd = ["bash", "-n", path] if name.endswith(".sh") else [sys.executable, "-m", "py_compile", path]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr


def _fleet_env(tmp_path: Path) -> dict[str, str]:
    for tool in ("redis-server", "redis-cli", "taskset"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install redis-server util-linux)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two replicas on a CPU each need two CPUs")
    env = dict(
        os.environ,
        MODEL="tiny",
        SERVED_MODEL_NAME=NAME,
        REPLICAS="2",
        CPUS_PER_REPLICA="1",
        SERVE_FLAGS=SERVE_FLAGS,
        BENCH_FLAGS=BENCH_FLAGS,
        OUT=str(tmp_path),
        FLEET_TIMEOUT_S="240",
    )
    router_venv(env)
    return env


def router_venv(env: dict[str, str]) -> Path:
    """sglang-router 0.3.2's virtualenv (created once, as the scripts do); no network and no
    virtualenv from an earlier run -> the test is skipped, saying why."""
    install = subprocess.run(
        [
            "bash",
            "-c",
            f'source "{ROOT}/scripts/chat_clients_common.sh" && client_venv sglang-router "sglang-router==0.3.2"',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    if install.returncode != 0:
        pytest.skip(f"sglang-router 0.3.2 could not be installed into its virtualenv: {install.stderr.strip()[-400:]}")
    return Path(install.stdout.strip().splitlines()[-1])


def _run(mode: str, env: dict[str, str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", str(FLEET), mode], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    (tmp_path / f"{mode}.stdout").write_text(proc.stdout)
    (tmp_path / f"{mode}.stderr").write_text(proc.stderr)
    return proc


@pytest.mark.slow
@pytest.mark.heavy  # servers and a router for ~40 s (2 min with a cold XLA cache): `pytest -m heavy`
@pytest.mark.timeout(300)
def test_fleet_bench_routes_and_shares_l3(tmp_path):
    env = _fleet_env(tmp_path)
    proc = _run("bench", env, tmp_path, timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "fleet_bench.json").read_text())
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"cache_aware", "round_robin"}
    for run in runs.values():
        # the router registered both replicas under the served name, and routes completions and chat
        assert run["router_probe"]["models"] == [NAME]
        assert run["router_probe"]["completions"]["status"] == 200
        answers = run["answers"]
        assert len(answers) == 12 and all(a["error"] is None for a in answers)
        assert all(a["replica"] in (0, 1) for a in answers)  # every answer came from a known replica
        # each replica's own /metrics agree with what the clients saw
        for i, rep in enumerate(run["replicas"]):
            mine = [a for a in answers if a["replica"] == i]
            assert rep["requests"] == rep["client_requests"] == len(mine)
            assert rep["failed"] == 0
            for tier in ("device", "host", "storage"):
                assert rep["hit_tokens"][tier] == sum(a["cached"][tier] for a in mine)
    # cache_aware: after a document's first question, all its questions go where it was computed
    # (an L1 hit there, nothing from L3); two streams in flight spread the documents over both replicas
    ca = runs["cache_aware"]
    by_doc = defaultdict(set)
    for a in ca["answers"]:
        by_doc[a["doc"]].add(a["replica"])
    assert all(len(r) == 1 for r in by_doc.values()), dict(by_doc)
    assert {next(iter(r)) for r in by_doc.values()} == {0, 1}
    later = [a for a in ca["answers"] if a["question"] > 0]
    assert all(a["cached"]["device"] >= a["prompt_tokens"] // 2 and a["cached"]["storage"] == 0 for a in later)
    # round_robin: strictly alternating, so documents meet the other replica; there they come from L3
    rr = runs["round_robin"]
    assert sorted(r["requests"] for r in rr["replicas"]) == [6, 6]
    foreign = [a for a in rr["answers"] if a["foreign_first"]]
    assert foreign and all(a["cached"]["storage"] > 0 for a in foreign)
    assert sum(r["hit_tokens"]["storage"] for r in rr["replicas"]) >= sum(a["cached"]["storage"] for a in foreign) > 0
    reference = {(a["doc"], a["question"]): a for a in ca["answers"]}
    for a in foreign:  # the same greedy tokens as where the document was computed (or found in L1)
        ref = reference[(a["doc"], a["question"])]
        assert len(a["tokens"]) == a["completion_tokens"] > 0 and a["tokens"] == ref["tokens"]
        assert a["logprobs"] == pytest.approx(ref["logprobs"], abs=0.05)  # byte tokens all print as U+FFFD


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_fleet_failover_kills_a_replica_under_load(tmp_path):
    env = _fleet_env(tmp_path)
    env["BENCH_FLAGS"] = "--docs 4 --questions 3 --doc-chars 600 --concurrency 4 --before-s 10 --after-s 12"
    proc = _run("failover", env, tmp_path, timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    failover = json.loads((tmp_path / "failover.json").read_text())
    checks = {c["name"]: c for c in failover["checks"]}
    assert all(c["passed"] for c in checks.values()), checks
    assert failover["noticed_s"] - failover["kill_s"] < 5.0  # health checks every second, 2 failures
    answers = failover["answers"]
    survivor_after = [a for a in answers if a["start_s"] > failover["noticed_s"]]
    assert survivor_after and all(a["error"] is None and a["replica"] == 0 for a in survivor_after)
    verify = json.loads((tmp_path / "verify-l3.json").read_text())
    assert all(c["passed"] for c in verify["checks"]), verify["checks"]
    assert all(a["cached"]["storage"] > 0 and a["error"] is None for a in verify["answers"])


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_fleet_pd_bench_compares_disaggregated_with_colocated(tmp_path):
    """TOPOLOGY=pd: replica 0 prefill, replica 1 decode, the router in PD mode, then the same
    replicas colocated: every request answered in every layout, the same greedy text, and the
    decode replica's handoffs complete (its prompts came from Redis, the shared L3)."""
    env = _fleet_env(tmp_path)
    env["TOPOLOGY"] = "pd"
    env["POLICIES"] = "round_robin"
    env["BENCH_FLAGS"] = (
        "--streams 2 --stream-tokens 16 --docs 3 --doc-chars 1500 --doc-tokens 4 --doc-interval-s 2 "
        "--doc-start-s 0.5 --duration-s 8"
    )
    proc = _run("bench", env, tmp_path, timeout=390)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 differ" in proc.stdout and "streams' inter-token p99" in proc.stdout
    pd_run = json.loads((tmp_path / "pd-pd.json").read_text())
    colocated = json.loads((tmp_path / "pd-round_robin.json").read_text())
    assert pd_run["errors"] == [] and colocated["errors"] == []
    assert pd_run["docs_answered"] == colocated["docs_answered"] == 3
    # the decode replica's prompts came from the shared L3 (counted from its own metrics)
    assert pd_run["decode_handoffs"].get("complete", 0) >= 3 and pd_run["decode_prompt_tokens"]["storage"] > 0
    decode_log = (tmp_path / "replica1.log").read_text()
    assert "handoff deadline" not in decode_log and "handoff stalled" not in decode_log


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_fleet_pd_failover_answers_every_request(tmp_path):
    """TOPOLOGY=pd with two prefill replicas: prefill replica 0 is killed (SIGKILL) while it
    prefills under load; the router retries its prompts on the other prefill replica, so every
    request is answered, and the decode replica computed the prompt it was waiting for itself
    (it asked the dead replica how the room stood: ``prefill_lost``)."""
    env = _fleet_env(tmp_path)
    env |= {"TOPOLOGY": "pd", "REPLICAS": "3", "SHARE_CPUS": "1"}
    env["BENCH_FLAGS"] = (
        "--streams 2 --stream-tokens 16 --docs 6 --doc-chars 1500 --doc-tokens 4 --doc-interval-s 1.5 "
        "--doc-start-s 0.5 --duration-s 12 --kill-after-s 2 --kill-min-tokens 800"
    )
    proc = _run("failover", env, tmp_path, timeout=390)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / "pd-failover.json").read_text())
    assert run["killed"] is not None and run["errors"] == []
    assert run["docs_answered"] >= 5
    assert sum(v for k, v in run["decode_handoffs"].items() if k not in ("complete", "local")) >= 1
    assert "prefill/decode handoff prefill_lost" in (tmp_path / "replica2.log").read_text()
