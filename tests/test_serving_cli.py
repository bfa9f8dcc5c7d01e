"""``strata-jax serve`` as a process (SIGTERM), API keys, config checks and metric export units."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import httpx
import pytest
from serving_harness import fake_engine_factory, real_engine_available

from serving.config import ServerConfig
from serving.grpc_client import StrataClient
from serving.metrics import build_metrics, flatten_stats
from serving.server import ThreadedServer
from serving.server_cli import add_serve_arguments, server_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_config_rules():
    with pytest.raises(ValueError, match="api_key"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", api_key="k").api_key == "k"
    assert ServerConfig(host="::1").host == "::1"
    with pytest.raises(ValueError):
        ServerConfig(port=70000)
    with pytest.raises(ValueError):
        ServerConfig(profile_on_start=True)


def test_cli_flags_have_help_and_build_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for action in parser._actions:  # noqa: SLF001
        if action.dest != "help":
            assert action.help, action.dest
    args = parser.parse_args(["--port", "0", "--grpc-port", "0", "--profile-dir", "/tmp/p"])
    cfg = server_config(args)
    assert cfg.host == "127.0.0.1" and cfg.profile_dir == "/tmp/p"


def test_flatten_stats_labels_tiers():
    stats = {
        "device_pool": {"used_pages": 3, "total_pages": 10},
        "hit_tokens": {"device": 5, "host": 2, "storage": 0},
        "transfer": {"load": {"bytes": 100, "gbps": 1.5}},
        "transfers": {"loaded_pages": 3, "backed_up_pages": 1, "page_bytes": 10, "link_bandwidth_bytes_per_s": 5e9},
        "compiles": 4,
        "note": "text is skipped",
    }
    flat = set(flatten_stats(stats))
    assert ("device_pool_used_pages", None, 3.0) in flat
    assert ("hit_tokens", "host", 2.0) in flat
    assert ("transfer_load_bytes", None, 100.0) in flat
    assert ("compiles", None, 4.0) in flat

    class E:
        def cache_stats(self):
            return stats

    body = build_metrics(lambda: E()).render().decode()
    assert 'strata_engine_hit_tokens_total{tier="host"} 2.0' in body
    assert "strata_engine_device_pool_used_pages 3.0" in body
    assert "# TYPE strata_engine_transfer_load_gbps gauge" in body
    assert 'strata_engine_transfer_bytes_total{kind="loaded"} 30.0' in body
    assert "strata_engine_transfers_loaded_pages_total 3.0" in body and "counter" in body
    assert "# TYPE strata_engine_transfers_link_bandwidth_bytes_per_s gauge" in body
    assert "# TYPE strata_engine_transfers_page_bytes gauge" in body


def test_api_key_required_on_both_faces():
    cfg = ServerConfig(port=0, grpc_port=0, api_key="s3cret", grace_s=2.0)
    srv = ThreadedServer(cfg, fake_engine_factory()).start()  # the faces alone: no need to warm the real engine
    try:
        model = srv.frontend.model_name
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(srv.http_url + "/v1/completions", json=body).status_code == 401
        r = httpx.post(srv.http_url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.http_url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.text
        assert httpx.get(srv.http_url + "/health").status_code == 200  # probes need no key
        with StrataClient(srv.grpc_target) as anon:
            assert anon.health() == "SERVING"
            with pytest.raises(grpc.RpcError) as err:
                list(anon.generate("hi", max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with StrataClient(srv.grpc_target, api_key="s3cret") as client:
            assert client.complete("hi", max_tokens=2)[1].finished
    finally:
        srv.stop()


def test_unavailable_while_warming_up():
    gate = threading.Event()
    build = fake_engine_factory()

    def slow_build():
        gate.wait(60)
        return build()

    srv = ThreadedServer(ServerConfig(port=0, grpc_port=0, grace_s=2.0), slow_build)
    srv.start_nowait()
    assert srv.server.bound.wait(30)
    try:
        r = httpx.post(srv.http_url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        assert httpx.get(srv.http_url + "/health").status_code == 503
        with StrataClient(srv.grpc_target) as client:
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate("hi", max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        assert srv.server.ready.wait(600)
        with StrataClient(srv.grpc_target) as client:
            assert client.health() == "SERVING"
    finally:
        gate.set()
        srv.stop()


def test_serve_process_sigterm_finishes_in_flight_and_exits_zero():
    """`strata-jax serve` under SIGTERM: the in-flight request completes, the process exits 0.

    Runs the real CLI with ``STRATA_SERVING_SLOW=1`` (a second engine warm-up), otherwise
    the same ``StrataServer`` over the fake engine (tests/serving_fake_serve.py).
    """
    port, grpc_port = _free_port(), _free_port()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    )
    if real_engine_available() and os.environ.get("STRATA_SERVING_SLOW"):  # ~2 min more: a second warm-up
        cmd = [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "serving.cli",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--grace-s",
            "20",
            "--log-level",
            "warning",
            "--max-context-tokens",
            "512",
            "--device-tokens",
            "8192",
            "--max-batch-tokens",
            "256",
            "--max-batch-size",
            "8",
            "--show-progress",
            "false",
            "--compilation-cache-dir",
            os.path.join(tempfile.gettempdir(), "strata_serving_tests_xla_cache"),
        ]
    else:
        cmd = [
            sys.executable,
            os.path.join(ROOT, "tests", "serving_fake_serve.py"),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--grace-s",
            "20",
        ]
    log_file = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="serve-")  # a pipe could fill and block it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, open(log_file.name).read()[-3000:]
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        result: dict = {}

        def in_flight():
            body = {"model": model, "prompt": "finish me", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
            result["r"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        t = threading.Thread(target=in_flight)
        grpc_client = StrataClient(f"127.0.0.1:{grpc_port}")
        assert grpc_client.health() == "SERVING"  # the channel is connected before the signal
        t.start()
        time.sleep(0.3)  # let it be admitted
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        # draining: new work is refused while the in-flight request finishes
        with pytest.raises(grpc.RpcError) as err:
            list(grpc_client.generate("too late", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        grpc_client.close()
        try:
            late = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "too late"}, timeout=10)
            assert late.status_code == 503, late.text
        except httpx.TransportError:
            pass  # the listening socket is already closed
        t.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "abort")
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler dumps the stacks into the log
            time.sleep(2)
            raise AssertionError("no exit 60 s after SIGTERM:\n" + open(log_file.name).read()[-6000:]) from None
        assert rc == 0, open(log_file.name).read()[-3000:]
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)  # no longer accepting
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_file.close()
