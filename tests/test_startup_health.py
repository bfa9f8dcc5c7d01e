"""While the engine warms up, /health answers 503 with the progress (programs done/total)
and the server logs it; once ready, 200."""

from __future__ import annotations

import logging
import threading

import httpx
from serving_harness import fake_engine_factory

from serving.config import ServerConfig
from serving.server import ThreadedServer
from strata_jax.runtime.warmup_progress import WarmupProgress


def test_health_reports_warmup_progress_until_ready(caplog):
    gate = threading.Event()
    build = fake_engine_factory()
    progress = WarmupProgress(log_progress=True)

    def slow_build():
        progress.phase("compiling")
        progress.programs(3, 11)
        gate.wait(60)
        return build()

    srv = ThreadedServer(ServerConfig(port=0, grpc_port=0, grace_s=2.0), slow_build)
    srv.frontend.warmup_progress = progress
    with caplog.at_level(logging.INFO, logger="strata_jax.startup"):
        srv.start_nowait()
        try:
            assert srv.server.bound.wait(30)
            for _ in range(100):
                body = httpx.get(srv.http_url + "/health")
                if body.json().get("progress", {}).get("programs_done") == 3:
                    break
                threading.Event().wait(0.05)
            assert body.status_code == 503
            got = body.json()
            assert got["status"] == "warming"
            assert got["progress"]["phase"] == "compiling"
            assert (got["progress"]["programs_done"], got["progress"]["programs_total"]) == (3, 11)
            gate.set()
            assert srv.server.ready.wait(600)
            ready = httpx.get(srv.http_url + "/health")
            assert ready.status_code == 200 and "progress" not in ready.json()
        finally:
            gate.set()
            srv.stop()
    assert any("compiled 3/11 programs" in r.getMessage() for r in caplog.records)
