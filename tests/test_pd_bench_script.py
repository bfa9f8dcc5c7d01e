"""``scripts/pd_bench.py`` end to end against one in-process tiny replica (the numbers mean
something only through a router over real replicas: docs/serving.md, "Prefill/decode
disaggregation"): streams and documents both answered, gaps recorded, and ``compare`` finds
two runs' greedy answers equal and fails on a run with errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.config import ServerConfig
from serving.server import ThreadedServer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pd_bench.py"


@pytest.fixture(scope="module")
def replica():
    from strata_jax.engine import Engine, EngineConfig

    config = EngineConfig(model="tiny", warmup=False, show_progress=False, max_context_tokens=4096)
    server = ThreadedServer(ServerConfig(port=0, grpc_port=0, grace_s=5.0), lambda: Engine(config)).start()
    yield server
    server.stop()


def _run(replica, tmp_path: Path, label: str) -> dict:
    out = tmp_path / f"{label}.json"
    cmd = [sys.executable, str(SCRIPT), "run", "--router", replica.http_url, "--model", "tiny", "--label", label]
    cmd += ["--streams", "2", "--stream-tokens", "8", "--docs", "2", "--doc-chars", "600", "--doc-tokens", "4"]
    cmd += ["--doc-interval-s", "0.5", "--doc-start-s", "0.2", "--duration-s", "2", "--data-dir", str(tmp_path)]
    cmd += ["--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "synthetic" in proc.stderr  # no LooGLE data under tmp_path: it says so
    return json.loads(out.read_text())


def test_run_and_compare(replica, tmp_path):
    first = _run(replica, tmp_path, "first")
    assert first["errors"] == [] and first["docs_answered"] == 2
    assert {"document 0", "document 1", "stream 0.0", "stream 1.0"} <= set(first["answers"])
    assert first["gaps"] > 0 and 0 < first["itl_p50_s"] <= first["itl_p99_s"] <= first["itl_max_s"]
    stream_tokens = sum(8 for k in first["answers"] if k.startswith("stream"))
    assert first["output_tokens"] >= stream_tokens  # every stream ran its 8 tokens (ignore_eos), documents more
    second = _run(replica, tmp_path, "second")
    compare = [sys.executable, str(SCRIPT), "compare", str(tmp_path / "first.json"), str(tmp_path / "second.json")]
    proc = subprocess.run(compare, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 differ" in proc.stdout and "streams' inter-token p99" in proc.stdout
    # a run whose answers differ, or that had errors, fails the comparison
    second["answers"]["document 0"] += " (changed)"
    second["errors"] = ["stream 9.9: RuntimeError: HTTP 500"]
    (tmp_path / "bad.json").write_text(json.dumps(second))
    bad = [sys.executable, str(SCRIPT), "compare", str(tmp_path / "first.json"), str(tmp_path / "bad.json")]
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and "1 differ" in proc.stdout and "1 errors" in proc.stdout


def test_failover_kills_the_process_while_its_replica_prefills_and_checks_the_fallbacks(replica, tmp_path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        cmd = [sys.executable, str(SCRIPT), "run", "--router", replica.http_url, "--model", "tiny"]
        cmd += ["--streams", "1", "--stream-tokens", "8", "--docs", "4", "--doc-chars", "1500", "--doc-tokens", "4"]
        cmd += ["--doc-interval-s", "0.3", "--doc-start-s", "0.1", "--duration-s", "4", "--data-dir", str(tmp_path)]
        cmd += ["--kill-pid", str(victim.pid), "--kill-url", replica.http_url, "--kill-after-s", "0"]
        cmd += ["--kill-min-tokens", "300", "--decode", replica.http_url, "--json", str(tmp_path / "f.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert victim.wait(timeout=10) == -9  # SIGKILL, while the replica held a document's prompt
        run = json.loads((tmp_path / "f.json").read_text())
        assert run["killed"]["load"]["num_waiting_reqs"] >= 1 and run["killed"]["load"]["num_tokens"] >= 300
        assert run["decode_prompt_tokens"]["prompt"] > 0  # where the (decode) replica's prompt tokens came from
        # a replica that is not a decode replica computed nothing in its place: that check fails the run
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "ok   the prefill replica was killed mid-prefill" in proc.stdout
        assert "ok   every request answered" in proc.stdout
        assert "FAIL the decode replica computed prompts itself" in proc.stdout
    finally:
        victim.kill()
    alone = [sys.executable, str(SCRIPT), "run", "--router", "http://x", "--model", "m", "--kill-pid", "1"]
    proc = subprocess.run(alone, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--kill-pid and --kill-url go together" in proc.stderr
