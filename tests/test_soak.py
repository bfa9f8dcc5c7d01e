"""scripts/soak.py in its 5-minute CI form: mixed traffic against a real `strata-jax serve`
(tiny model, L1+L2+L3 with a temporary storage directory, 127.0.0.1 only) while L3 objects are
corrupted and deleted, L3 writes fail for 10 s at a time, clients hang up and the cache is
flushed every minute.  No 5xx, the greedy probe never changes, RSS flat after the warm-up, the
host pool back to its baseline after every flush, the server exits 0 on SIGTERM.

Marked heavy (left out of the default run): ``python -m pytest -q -p no:xdist -m heavy tests/test_soak.py``.
Takes about 5 minutes plus the server's start-up (one to a few minutes on a shared CPU).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOAK = ROOT / "scripts" / "soak.py"
MINUTES = 5
CI_RSS_GROWTH = 0.5  # the 5-minute form's RSS bound: a gross leak only (see the assertion)


def test_soak_script_parses_and_has_its_flags():
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--minutes", "--json", "--port", "--seed", "--keep-dir"):
        assert flag in proc.stdout


def test_sse_lines_split_only_where_sse_does():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # its dataclasses look their module up
    try:
        spec.loader.exec_module(soak)
    finally:
        del sys.modules["soak"]

    class Response:
        def iter_bytes(self):  # a U+2028 in a token's text, a CR LF split over two chunks
            yield from (b'data: {"t": "a\xe2\x80\xa8b"}\r', b"\ndata: x\n\ndata: [DONE]\n\n")

    assert list(soak.sse_lines(Response())) == ['data: {"t": "a\u2028b"}', "data: x", "", "data: [DONE]", ""]


@pytest.mark.heavy
def test_soak_five_minutes(tmp_path):
    from serving_harness import real_engine_available

    if not real_engine_available():
        pytest.skip("the soak needs the real engine")
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SOAK),
            "--minutes",
            str(MINUTES),
            "--json",
            str(out),
            "--seed",
            "1",
            "--rss-tolerance",
            str(CI_RSS_GROWTH),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=MINUTES * 60 + 1500,
        check=False,
    )
    (tmp_path / "soak.stdout").write_text(proc.stdout)
    tail = (proc.stdout[-6000:] + "\n" + proc.stderr[-3000:]).strip()
    assert out.is_file(), tail
    report = json.loads(out.read_text())
    failed = [c for c in report["checks"] if not c["ok"]]
    requests, memory = report["requests"], report["memory"]

    assert requests["answered"] > 100, tail  # traffic did flow
    assert sum(requests["hangups"].values()) > 0 and report["faults"]["counts"].get("outage", 0) >= 1, tail
    assert report["fives"] == 0, (requests["by_status"], requests["inband_errors"], requests["examples"])
    assert report["probe"]["checks"] >= MINUTES and not [p for p in report["probe"]["all"] if not p.get("match")], tail
    # RSS after the warm-up (first 20%): the 30-minute run holds it within 5% (docs/serving.md, "Soak"), but
    # RSS climbs for the first ~10 minutes (no compiles; cause open), so this 5-minute form ends inside the
    # climb (+6.0-16.1% measured) and cannot judge flatness: it catches a gross leak only (~250 KB per
    # request over its ~3,000 requests would pass 50%).  The exact leak checks here are the page accounting
    # and the host pool's baseline after every flush.
    assert memory["rss_growth_after_warmup"] is not None and memory["rss_growth_after_warmup"] <= CI_RSS_GROWTH, memory
    # the host pool after each drained flush back to its post-flush baseline
    baseline = memory["host_pages_post_flush_baseline"]
    assert baseline is not None and len(memory["host_pages_after_flushes"]) >= MINUTES - 1, memory
    assert all(v == baseline for v in memory["host_pages_after_flushes"]), memory
    assert report["server"]["exit_code"] == 0, tail
    diagnosis = {"failed": failed, "server_errors": report["server"]["error_lines"]}
    assert not failed, json.dumps(diagnosis, indent=1, default=str)[:8000]
    assert proc.returncode == 0, tail
