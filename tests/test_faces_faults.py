"""Faults injected at the faces, against one real server (tiny engine) for the whole file.

Each test injects a fault a client can cause (a body sent a byte a second, a body one byte
over the limit, invalid UTF-8, 100k levels of nesting, 200 clients hanging up at random
points) and then checks, through the ``healthy`` fixture, that the server still answers
(``/health`` 200 and a real completion), that no request ended as a server error (HTTP 5xx,
gRPC ``INTERNAL``: ``strata_requests_total{status="error"}`` unchanged) and that no page
or tree lock leaked (``assert_no_leaks``).

Also covered elsewhere: a gRPC client cancelling mid-stream frees its pages
(``tests/test_serving_api.py::test_grpc_cancel_mid_stream_frees_pages``; here gRPC
cancels are one of the random hang-ups); a hundred HTTP hang-ups do not slow the other
streams (``tests/test_serving_hangups.py``, heavy).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import grpc
import httpx
import pytest
from serving_harness import assert_no_leaks, engine_factory, with_baseline

from serving.config import ServerConfig
from serving.protos import strata_pb2, strata_pb2_grpc
from serving.server import ThreadedServer

MAX_BODY = 256 << 10  # room for 100k levels of [[...]] (200 KB)
BODY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(port=0, grpc_port=0, max_body_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT_S, grace_s=5.0)
    factory = engine_factory(max_waiting=256, max_running=8, max_context_tokens=512)
    srv = with_baseline(ThreadedServer(config, factory).start())
    yield srv
    srv.stop(30.0)


def _errors(srv: ThreadedServer) -> float:
    registry = srv.frontend.metrics.registry
    return sum(
        registry.get_sample_value("strata_requests_total", {"api": api, "status": "error"}) or 0.0
        for api in ("http", "grpc")
    )


@pytest.fixture()
def healthy(server):
    """After the test: alive, no request ended as a server error, no leaked page."""
    before = _errors(server)
    yield server
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post(
            "/v1/completions", json={"model": server.frontend.model_name, "prompt": "still there?", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
    assert _errors(server) == before
    assert_no_leaks(server.frontend.engine(), server.baseline_used)


def _port(srv: ThreadedServer) -> int:
    return int(srv.server.http_port)  # type: ignore[arg-type]


def _head(path: str, length: int | None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{size}\r\n".encode()


def _status(raw: bytes) -> int | None:
    try:
        return int(raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def _json_of(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


# ---- slow bodies ------------------------------------------------------------
async def _slow_sender(port: int, body: bytes, interval_s: float) -> tuple[bytes, float, bool]:
    """Send ``body`` a byte every ``interval_s``; the response, when it came, and whether the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head("/v1/completions", len(body)))
    t0, raw = time.monotonic(), b""
    try:
        for i in range(len(body)):
            writer.write(body[i : i + 1])
            await writer.drain()
            try:
                raw = await asyncio.wait_for(reader.read(65536), interval_s)
                break
            except TimeoutError:
                continue
        elapsed = time.monotonic() - t0
        try:  # after its answer the server drops the connection (it cannot carry another request)
            while chunk := await asyncio.wait_for(reader.read(65536), 5.0):
                raw += chunk
        except TimeoutError:
            return raw, elapsed, False
        except ConnectionError:  # a reset: the server closed with our unread bytes in its buffer
            pass
        return raw, elapsed, True
    finally:
        writer.close()


async def _timed_completions(url: str, model: str, until: asyncio.Event) -> list[float]:
    """Ordinary requests, one after another, until ``until`` is set: their latencies."""
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while not until.is_set():
            t0 = time.monotonic()
            r = await http.post("/v1/completions", json={"model": model, "prompt": "a quick one", "max_tokens": 2})
            assert r.status_code == 200, r.text
            latencies.append(time.monotonic() - t0)
    return latencies


def test_slow_body_gets_408_and_blocks_no_one(healthy):
    srv, model = healthy, healthy.frontend.model_name
    body = json.dumps({"model": model, "prompt": "slow " * 40, "max_tokens": 2}).encode()

    async def main() -> tuple[list[tuple[bytes, float, bool]], list[float]]:
        done = asyncio.Event()
        others = asyncio.create_task(_timed_completions(srv.http_url, model, done))
        slow = await asyncio.gather(*(_slow_sender(_port(srv), body, 1.0) for _ in range(8)))
        done.set()
        return slow, await others

    slow, latencies = asyncio.run(main())
    for raw, elapsed, closed in slow:
        assert _status(raw) == 408, raw[:300]
        assert "not received within" in _json_of(raw)["error"]["message"]
        assert BODY_TIMEOUT_S - 0.5 <= elapsed <= BODY_TIMEOUT_S + 3.0, elapsed
        assert closed, "the server kept the connection of a timed-out body"
    # the others were served all along: many requests, none waiting on the slow senders
    assert len(latencies) >= 5 and max(latencies) < BODY_TIMEOUT_S, latencies


# ---- body size -------------------------------------------------------------
def _padded_body(model: str, size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON whitespace as padding)."""
    body = json.dumps({"model": model, "prompt": "limit", "max_tokens": 1}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_body_at_the_limit_passes_one_byte_over_is_413(healthy):
    srv, model = healthy, healthy.frontend.model_name
    with httpx.Client(base_url=srv.http_url, timeout=60) as http:
        at = _padded_body(model, MAX_BODY)
        assert len(at) == MAX_BODY
        r = http.post("/v1/completions", content=at, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        over = _padded_body(model, MAX_BODY + 1)
        r = http.post("/v1/completions", content=over, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "body_too_large" and f"exceeds {MAX_BODY} bytes" in err["message"], err
        assert r.headers.get("connection") == "close"

        def chunks(body: bytes):  # no Content-Length: counted as it arrives
            for i in range(0, len(body), 50_000):
                yield body[i : i + 50_000]

        r = http.post("/v1/completions", content=chunks(at), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", content=chunks(over), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text

    # gRPC: a message at --max-body-bytes passes the size gate (and is then judged on its content), one over does not
    with grpc.insecure_channel(srv.grpc_target) as channel:
        generate = channel.unary_stream("/strata.v1.Strata/Generate")
        for extra, code in ((0, grpc.StatusCode.INVALID_ARGUMENT), (1, grpc.StatusCode.RESOURCE_EXHAUSTED)):
            msg = strata_pb2.GenerateRequest(text="x")
            msg.text = "x" * (
                len(msg.text) + MAX_BODY + extra - msg.ByteSize() - 2
            )  # the length prefix grows by 2 bytes
            assert msg.ByteSize() == MAX_BODY + extra
            with pytest.raises(grpc.RpcError) as err:
                list(generate(msg.SerializeToString(), timeout=60))
            assert err.value.code() == code, (extra, err.value.code(), err.value.details())


# ---- malformed JSON ---------------------------------------------------------
def test_invalid_utf8_and_deep_nesting_are_400_naming_the_problem(healthy):
    srv, model = healthy, healthy.frontend.model_name
    m = model.encode()
    cases = [  # (body, param, words in the message)
        (b'{"model": "' + m + b'", "prompt": "\xff\xfe bad"}', "body", "UTF-8"),
        (b'{"model": "' + m + b'", "prompt": "\\ud800"}', "prompt", "UTF-8"),
        (b'{"model": "' + m + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body", "nested"),
        (
            b'{"model": "' + m + b'", "prompt": "x", "guided_json": ' + b'{"a":' * 150 + b"1" + b"}" * 150 + b"}",
            "guided_json",
            "nested",
        ),
        (
            b'{"model": "' + m + b'", "prompt": "x", "response_format": ' + b"[" * 500 + b"]" * 500 + b"}",
            "response_format",
            "nested",
        ),
    ]
    with httpx.Client(base_url=srv.http_url, timeout=60) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body, param, words in cases:
                if path.endswith("chat/completions"):
                    body = body.replace(b'"prompt": ', b'"messages": [{"role": "user", "content": "x"}], "prompt": ')
                r = http.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, body[:60], r.status_code, r.text[:300])
                err = r.json()["error"]
                assert err["param"] == param and words in err["message"], (path, body[:60], err)
        # chat: deep nesting where a template would recurse over it
        chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        deep: Any = []
        for _ in range(500):
            deep = [deep]
        r = http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"x": deep}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text[:300]


# ---- many clients hanging up at random points ---------------------------------
HANGUPS = 200
SPREAD_S = 4.0  # the clients start over this many seconds
TOKENS = 48


async def _hang_up_mid_body(port: int, body: bytes, rng: random.Random) -> int | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head("/v1/completions", len(body)) + body[: rng.randrange(1, len(body))])
    await writer.drain()
    await asyncio.sleep(rng.uniform(0, 0.3))
    writer.close()
    return None


async def _hang_up_before_reading(port: int, body: bytes, rng: random.Random) -> int | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head("/v1/chat/completions" if b"messages" in body else "/v1/completions", len(body)) + body)
    await writer.drain()
    await asyncio.sleep(rng.uniform(0, 0.5))  # gone before, during or after admission
    writer.close()
    return None


async def _hang_up_mid_stream(http: httpx.AsyncClient, path: str, body: dict, rng: random.Random) -> int | None:
    cut = rng.randrange(0, 6)
    async with http.stream("POST", path, json=body) as r:
        got = 0
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                assert '"internal_error"' not in line, line
                got += 1
                if got > cut:
                    break
        return r.status_code


async def _hang_up_non_streamed(http: httpx.AsyncClient, path: str, body: dict, rng: random.Random) -> int | None:
    try:
        r = await http.post(path, json={**body, "stream": False}, timeout=rng.uniform(0.05, 1.0))
    except httpx.TimeoutException:
        return None  # the client gave up and closed the connection
    return r.status_code


async def _grpc_cancel(stub: Any, rng: random.Random, i: int) -> int | None:
    call = stub.Generate(
        strata_pb2.GenerateRequest(
            text=f"grpc hang-up {i}", params=strata_pb2.SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        )
    )
    cut = rng.randrange(0, 6)
    try:
        got = 0
        async for _msg in call:
            got += 1
            if got > cut:
                break
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED), exc
        return None
    finally:
        call.cancel()
    return None


async def _hang_ups(srv: ThreadedServer, seed: int) -> list[int | None]:
    rng, model, port = random.Random(seed), srv.frontend.model_name, _port(srv)
    limits = httpx.Limits(max_connections=HANGUPS, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=srv.http_url, timeout=120, limits=limits) as http,
        grpc.aio.insecure_channel(srv.grpc_target) as channel,
    ):
        stub = strata_pb2_grpc.StrataStub(channel)

        async def one(i: int) -> int | None:
            await asyncio.sleep(rng.uniform(0, SPREAD_S))
            chat = rng.random() < 0.5
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body: dict[str, Any] = {"model": model, "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
            body.update(
                {"messages": [{"role": "user", "content": f"hang-up {i}"}]} if chat else {"prompt": f"hang-up {i}"}
            )
            kind = i % 5
            if kind == 0:
                return await _hang_up_mid_body(port, json.dumps(body).encode(), rng)
            if kind == 1:
                return await _hang_up_before_reading(port, json.dumps(body).encode(), rng)
            if kind == 2:
                return await _hang_up_mid_stream(http, path, body, rng)
            if kind == 3:
                return await _hang_up_non_streamed(http, path, body, rng)
            return await _grpc_cancel(stub, rng, i)

        return list(await asyncio.gather(*(one(i) for i in range(HANGUPS))))


def test_200_clients_hanging_up_at_random_points(healthy):
    srv = healthy
    statuses = asyncio.run(_hang_ups(srv, seed=1234))
    seen = [s for s in statuses if s is not None]
    assert seen and all(s < 500 for s in seen), sorted(set(seen))
    cancelled = srv.frontend.metrics.registry.get_sample_value(
        "strata_requests_total", {"api": "http", "status": "cancelled"}
    )
    assert cancelled and cancelled > 0


# ---- the wrong key on an admin route (--admin-api-key) --------------------------
# The faces alone, on the contract fake (no engine warm-up): which key each route takes.
API_KEY, ADMIN_KEY = "inference-key", "admin-key"
ADMIN_HTTP = [
    ("GET", "/admin/cache_stats", None),
    ("POST", "/admin/flush_cache", {"tier": "device"}),
    ("POST", "/flush_cache", None),
]


@pytest.fixture(scope="module")
def keyed_server():
    from serving_harness import fake_engine_factory

    config = ServerConfig(port=0, grpc_port=0, api_key=API_KEY, admin_api_key=ADMIN_KEY, grace_s=2.0)
    srv = ThreadedServer(config, fake_engine_factory()).start()
    yield srv
    srv.stop()


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_admin_key_guards_the_admin_routes_over_http(keyed_server, tmp_path):
    srv, model = keyed_server, keyed_server.frontend.model_name
    with httpx.Client(base_url=srv.http_url, timeout=30) as http:
        for method, path, body in ADMIN_HTTP:
            assert http.request(method, path, json=body, headers=_bearer(ADMIN_KEY)).status_code == 200, path
            r = http.request(method, path, json=body, headers=_bearer(API_KEY))  # a valid key, the wrong scope
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "insufficient_permissions" and "--admin-api-key" in err["message"], err
            for key in (None, "wrong"):
                r = http.request(method, path, json=body, headers=_bearer(key))
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, key, r.text)
        r = http.post("/admin/profile/start", json={"log_dir": str(tmp_path)}, headers=_bearer(ADMIN_KEY))
        assert r.status_code == 200, r.text
        assert http.post("/admin/profile/stop", headers=_bearer(API_KEY)).status_code == 403
        assert http.post("/admin/profile/stop", headers=_bearer(ADMIN_KEY)).status_code == 200
        # inference routes: the API key, not the admin key (a known key of the wrong scope: 403)
        completion = {"model": model, "prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=completion, headers=_bearer(API_KEY)).status_code == 200
        r = http.post("/v1/completions", json=completion, headers=_bearer(ADMIN_KEY))
        assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"], r.text
        for path in ("/v1/models", "/metrics", "/server_info", "/get_load"):
            assert http.get(path, headers=_bearer(API_KEY)).status_code == 200, path
            assert http.get(path, headers=_bearer(ADMIN_KEY)).status_code == 403, path
        assert http.get("/health").status_code == 200  # probes need no key
        assert http.get("/openapi.json").status_code == 200  # nor does the schema


def test_admin_key_guards_the_admin_rpcs_over_grpc(keyed_server, tmp_path):
    from serving.grpc_client import StrataClient

    srv = keyed_server
    with (
        StrataClient(srv.grpc_target, api_key=ADMIN_KEY) as admin,
        StrataClient(srv.grpc_target, api_key=API_KEY) as user,
    ):
        admin.flush_cache("device")
        assert "device_pool" in admin.cache_stats()
        admin.start_profile(str(tmp_path))
        admin.stop_profile()
        for call in (
            lambda c: c.flush_cache(),
            lambda c: c.cache_stats(),
            lambda c: c.start_profile(str(tmp_path)),
            lambda c: c.stop_profile(),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(user)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--admin-api-key" in err.value.details()
        assert user.complete("hi", max_tokens=2)[1].finished
        with pytest.raises(grpc.RpcError) as err:
            list(admin.generate("hi", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert admin.health() == "SERVING"
    with StrataClient(srv.grpc_target, api_key="wrong") as stranger:
        with pytest.raises(grpc.RpcError) as err:
            stranger.flush_cache()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_admin_key_flag_env_and_defaults(monkeypatch):
    import argparse

    from serving import auth
    from serving.server_cli import add_serve_arguments, server_config

    monkeypatch.setenv("STRATA_ADMIN_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert server_config(parser.parse_args([])).admin_api_key == "from-env"
    assert server_config(parser.parse_args(["--admin-api-key", "flag"])).admin_api_key == "flag"
    with pytest.raises(ValueError, match="admin_api_key"):
        ServerConfig(admin_api_key="")
    # unset: the admin routes take the API key, as before
    only_api = ServerConfig(api_key="k")
    assert auth.check(only_api, auth.Scope.ADMIN, "Bearer k") is None
    assert auth.check(only_api, auth.Scope.ADMIN, "Bearer x") == auth.Refusal(False, "missing or wrong API key")
    # an admin key alone: inference stays open (loopback), admin routes need it
    only_admin = ServerConfig(admin_api_key="a")
    assert auth.check(only_admin, auth.Scope.INFERENCE, None) is None
    assert auth.check(only_admin, auth.Scope.ADMIN, None) is not None
    # one key for both: the same value in both flags
    same = ServerConfig(api_key="k", admin_api_key="k")
    assert (
        auth.check(same, auth.Scope.ADMIN, "Bearer k") is None
        and auth.check(same, auth.Scope.INFERENCE, "Bearer k") is None
    )
