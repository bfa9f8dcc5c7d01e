"""/metrics tells the truth: every request is counted once, with its real outcome, on every path.

The outcomes are known by construction (a request read to its end finished with ``length`` or
``stop``; one the client dropped is ``cancelled``; one the server refused is ``rejected`` with the
reason its status code says), so each test sends a known mix and checks the counter deltas
exactly, and that nothing else moved.  The faces are what is under test here, so the servers run
on the contract fake engine (no warm-up): the same frontend code serves the real engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import grpc
import httpx
import pytest
from serving_harness import fake_engine_factory

from serving.config import ServerConfig
from serving.grpc_client import StrataClient
from serving.server import ThreadedServer

CONTEXT = 256


def _samples(server: ThreadedServer) -> Counter:
    """``{(metric, api, status-or-reason): value}`` of the request counters, read from /metrics."""
    body = httpx.get(server.http_url + "/metrics", headers=_auth(server), timeout=30).text
    out: Counter = Counter()
    for line in body.splitlines():
        for metric, label in (("strata_requests_total", "status"), ("strata_requests_rejected_total", "reason")):
            if line.startswith(metric + "{"):
                labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
                key = (
                    metric.removeprefix("strata_").removesuffix("_total"),
                    labels["api"].strip('"'),
                    labels[label].strip('"'),
                )
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def _auth(server: ThreadedServer) -> dict:
    key = server.server.config.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _delta_when(server: ThreadedServer, before: Counter, expected: dict, timeout: float = 20.0) -> dict:
    """The counter deltas once they reach ``expected`` (streams are counted just after they close)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _samples(server)
        delta = {k: now[k] - before[k] for k in now if now[k] != before[k]}
        if delta == expected or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(port=0, grpc_port=0, max_body_bytes=64 << 10, grace_s=2.0)
    srv = ThreadedServer(config, fake_engine_factory(max_context_tokens=CONTEXT, step_s=0.005)).start()
    yield srv
    srv.stop()


def _model(server) -> str:
    return server.frontend.model_name


def _sse_events(response: httpx.Response) -> list:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_http_finished_requests_count_their_finish_reason_streamed_or_not(server):
    """The bug this guards: a stream read to its end was counted `cancelled`."""
    model, before = _model(server), _samples(server)
    first_token = 3 + ord("a") + len("hello") % 26  # the fake engine's first output token for a 5-byte prompt
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        assert (
            http.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3}).json()["choices"][
                0
            ]["finish_reason"]
            == "length"
        )
        stop = http.post(
            "/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 9, "stop_token_ids": [first_token + 1]},
        )
        assert stop.json()["choices"][0]["finish_reason"] == "stop"
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["finish_reason"] == "length"
        for path, body in (
            ("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4}),
            ("/v1/chat/completions", chat),
        ):
            with http.stream(
                "POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}
            ) as r:
                events = _sse_events(r)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 4
        # a batch of three prompts is three requests to the engine
        batch = http.post(
            "/v1/completions", json={"model": model, "prompt": ["a", "bb", "ccc"], "max_tokens": 2}
        ).json()
        assert [c["finish_reason"] for c in batch["choices"]] == ["length"] * 3
    delta = _delta_when(server, before, {("requests", "http", "length"): 7, ("requests", "http", "stop"): 1})
    assert delta == {("requests", "http", "length"): 7, ("requests", "http", "stop"): 1}
    # no `_created` timestamp samples: load generators that scrape /metrics (aiperf) took them for counter resets
    assert "_created" not in httpx.get(server.http_url + "/metrics", timeout=30).text
    assert server.frontend.metrics.registry.get_sample_value("strata_requests_in_flight") == 0


def test_http_client_that_goes_away_is_cancelled_once(server):
    model, before = _model(server), _samples(server)
    long = {"max_tokens": CONTEXT - 32, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        for path, body in (
            ("/v1/completions", {"model": model, "prompt": "tell me a story", **long}),
            ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "story"}], **long}),
        ):
            with http.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                for i, _line in enumerate(r.iter_lines()):
                    if i >= 4:
                        break  # leave mid-stream: the connection closes
    # non-streamed: the client gives up before the answer
    with httpx.Client(base_url=server.http_url, timeout=0.3) as http:
        with pytest.raises(httpx.TimeoutException):
            http.post(
                "/v1/completions",
                json={"model": model, "prompt": "slow", "max_tokens": CONTEXT - 32, "ignore_eos": True},
            )
    expected = {("requests", "http", "cancelled"): 3}
    assert _delta_when(server, before, expected) == expected


def test_http_refusals_are_counted_by_reason_before_and_inside_the_frontend(server):
    model, before = _model(server), _samples(server)
    c, ch = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (c, b"{not json", 400, "invalid_request"),  # refused while reading the body
        (c, {"model": model, "prompt": "hi", "n": 0}, 400, "invalid_request"),  # a bad value
        (c, {"model": model, "prompt": [1, 10**9]}, 400, "invalid_request"),  # refused by the frontend
        (ch, {"model": model, "messages": msgs, "max_tokens": 0}, 400, "invalid_request"),
        (c, {"model": model, "prompt": "x" * (CONTEXT - 10), "max_tokens": 20}, 400, "too_long"),
        (ch, {"model": model, "messages": msgs, "max_tokens": CONTEXT}, 400, "too_long"),
        (c, {"model": "gpt-4", "prompt": "hi"}, 404, "not_found"),
        (ch, {"model": "gpt-4", "messages": msgs}, 404, "not_found"),
        (c, {"model": model, "prompt": "y" * (100 << 10)}, 413, "body_too_large"),
    ]
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        for path, body, status, _reason in cases:
            r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
        assert http.post("/admin/flush_cache", json={"tier": "L9"}).status_code == 400  # not a generation request
        too_long = http.post(c, json={"model": model, "prompt": "x" * (CONTEXT - 10), "max_tokens": 20}).json()
        assert (
            too_long["error"]["code"] == "context_length_exceeded" and "context limit" in too_long["error"]["message"]
        )
    reasons = Counter(reason for *_, reason in cases)
    reasons["too_long"] += 1
    expected = {("requests", "http", "rejected"): sum(reasons.values())}
    expected.update({("requests_rejected", "http", r): n for r, n in reasons.items()})
    assert _delta_when(server, before, expected) == expected


def test_grpc_streams_cancels_and_refusals(server):
    before = _samples(server)
    with StrataClient(server.grpc_target) as client:
        msgs = list(client.generate("Hello there", max_tokens=5))
        assert msgs[-1].finish_reason == "length"
        assert list(client.generate([5, 6, 7], max_tokens=1))[-1].finish_reason == "length"  # first chunk is the last
        call = client.generate("tell me a long story", max_tokens=CONTEXT - 64, ignore_eos=True)
        for i, _ in enumerate(call):
            if i == 2:
                call.cancel()
                break
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate("hi", max_tokens=1, temperature=-1.0))  # refused before the frontend
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate("x" * (CONTEXT - 4), max_tokens=16))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context limit" in err.value.details()
        raw = client.channel.unary_stream("/strata.v1.Strata/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x0a\x02\xff\xfe", timeout=30))  # not UTF-8: refused by the decode guard
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    expected = {
        ("requests", "grpc", "length"): 2,
        ("requests", "grpc", "cancelled"): 1,
        ("requests", "grpc", "rejected"): 3,
        ("requests_rejected", "grpc", "invalid_request"): 2,
        ("requests_rejected", "grpc", "too_long"): 1,
    }
    assert _delta_when(server, before, expected) == expected


def test_overload_warmup_and_api_key_refusals():
    """503 (warming up), 401 / UNAUTHENTICATED (wrong key), 429 (queue full): each counted by reason."""
    gate = threading.Event()
    build = fake_engine_factory(max_waiting=1, max_running=1, step_s=0.02, max_context_tokens=CONTEXT)

    def slow_build():
        gate.wait(30)
        return build()

    config = ServerConfig(port=0, grpc_port=0, grace_s=1.0, api_key="sekret")
    srv = ThreadedServer(config, slow_build)
    starter = threading.Thread(target=srv.start, daemon=True)
    starter.start()
    try:
        assert srv.server.bound.wait(30)
        key = {"Authorization": "Bearer sekret"}
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        long = {**body, "max_tokens": CONTEXT - 32, "ignore_eos": True}
        with httpx.Client(base_url=srv.http_url, timeout=30) as http:
            before = _samples(srv)
            assert http.post("/v1/completions", json=body, headers=key).status_code == 503  # warming up
            gate.set()
            starter.join(30)
            assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}).status_code == 401
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}, headers=key) as running:
                lines = running.iter_lines()  # keep the iterator: dropping it closes the response
                next(lines)  # it holds the only running slot

                def wait_in_queue() -> None:  # holds the only waiting slot, then gives up
                    with httpx.Client(base_url=srv.http_url, timeout=1.5) as impatient:
                        with pytest.raises(httpx.TimeoutException):
                            impatient.post("/v1/completions", json=long, headers=key)

                waiter = threading.Thread(target=wait_in_queue)
                waiter.start()
                engine = srv.frontend.engine()
                deadline = time.monotonic() + 10
                while engine.cache_stats()["waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert [http.post("/v1/completions", json=body, headers=key).status_code for _ in range(3)] == [429] * 3
                waiter.join(30)
        with StrataClient(srv.grpc_target) as client:  # no key
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate("hi", max_tokens=1))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        expected = {
            ("requests", "http", "rejected"): 5,
            ("requests_rejected", "http", "unavailable"): 1,
            ("requests_rejected", "http", "unauthorized"): 1,
            ("requests_rejected", "http", "overloaded"): 3,
            ("requests", "http", "cancelled"): 2,
            ("requests", "grpc", "rejected"): 1,
            ("requests_rejected", "grpc", "unauthorized"): 1,
        }
        assert _delta_when(srv, before, expected) == expected
    finally:
        gate.set()
        srv.stop()
