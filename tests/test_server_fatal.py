"""An engine that stops for good takes the server down: health 503 first, then a non-zero exit.

The unrecoverable error is injected by wrapping the real engine's executor (test code
only): a step dispatch raising ``MemoryError``, which ``unrecoverable_step_error`` counts
as fatal.  A recoverable one (``ZeroDivisionError``) fails its request with a 500 that
names the cause, and the server serves on.
"""

from __future__ import annotations

import time

import httpx
import pytest
from serving_harness import engine_factory, real_engine_available

from serving.config import ServerConfig
from serving.server import EXIT_ENGINE_FAILED, ThreadedServer

pytestmark = pytest.mark.skipif(not real_engine_available(), reason="needs the real engine")

PROMPT = [(i * 7919) % 250 + 3 for i in range(64)]


def _server() -> ThreadedServer:
    config = ServerConfig(port=0, grpc_port=0, grace_s=2.0)
    return ThreadedServer(config, engine_factory(max_context_tokens=512)).start()


def _complete(client: httpx.Client, url: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return client.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_recoverable_step_error_is_a_500_naming_it_and_the_server_serves_on_then_a_fatal_one_exits_non_zero():
    srv = _server()
    url = f"http://127.0.0.1:{srv.server.http_port}"
    engine = srv.frontend.engine()
    real = engine.executor.dispatch_extend
    try:
        with httpx.Client() as client:
            good = _complete(client, url)
            assert good.status_code == 200
            engine.flush_cache("all")

            fails = {"n": 1}

            def once(work, loads):
                if fails["n"]:
                    fails["n"] -= 1
                    raise ZeroDivisionError("float division by zero")
                return real(work, loads)

            engine.executor.dispatch_extend = once
            bad = _complete(client, url)
            assert bad.status_code == 500
            message = bad.json()["error"]["message"]
            assert "ZeroDivisionError" in message and "float division by zero" in message
            again = _complete(client, url)
            assert again.status_code == 200
            assert again.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]
            assert client.get(f"{url}/health").status_code == 200

            def lost(work, loads):
                raise MemoryError("injected: the host ran out of memory mid-step")

            engine.executor.dispatch_extend = lost
            engine.flush_cache("all")
            dead = _complete(client, url)
            assert dead.status_code == 503
            assert "unrecoverable" in dead.json()["error"]["message"]
            try:
                assert client.get(f"{url}/health", timeout=5).status_code == 503
            except httpx.TransportError:
                pass  # already closed: the shutdown is under way
    finally:
        engine.executor.dispatch_extend = real
    assert srv.join(60), "the server did not stop after its engine died"
    assert srv.server.exit_code == EXIT_ENGINE_FAILED != 0
    assert isinstance(engine.fatal_error, MemoryError)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the HTTP server is still listening after the engine stopped")
