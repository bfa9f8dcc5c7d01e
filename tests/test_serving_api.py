"""End-to-end tests of the serving faces with real clients (openai, grpc, httpx) on loopback."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import time

import grpc
import httpx
import openai
import pytest
from serving_harness import assert_no_leaks, shared_server

from serving.grpc_client import StrataClient
from serving.protos import strata_pb2


@pytest.fixture(scope="module")
def server():
    return shared_server()  # one warm engine for all serving tests


@pytest.fixture()
def oai(server):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


@pytest.fixture()
def grpc_client(server):
    with StrataClient(server.grpc_target) as client:
        yield client


def _model(server) -> str:
    return server.frontend.model_name


# ---- happy paths --------------------------------------------------------
def _outcomes(server, api: str) -> dict[str, float]:
    registry = server.frontend.metrics.registry
    return {
        status: registry.get_sample_value("strata_requests_total", {"api": api, "status": status}) or 0.0
        for status in ("stop", "length", "cancelled", "rejected", "error", "abort")
    }


def test_openai_completions_non_stream_and_stream(server, oai):
    before = _outcomes(server, "http")
    out = oai.completions.create(model=_model(server), prompt="Hello there", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens > 0 and 0 < out.usage.completion_tokens <= 5
    assert out.usage.prompt_tokens_details is None or out.usage.prompt_tokens_details.cached_tokens >= 0

    pieces, reasons = [], []
    stream = oai.completions.create(
        model=_model(server),
        prompt="Hello there",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == out.choices[0].text  # greedy: same text streamed or not
    assert reasons[-1] in ("length", "stop")
    assert usage is not None and usage.completion_tokens == out.usage.completion_tokens

    ids = oai.completions.create(model=_model(server), prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4
    # each of the three requests counted once with its finish reason (a finished stream is not `cancelled`)
    deadline = time.monotonic() + 10
    while (after := _outcomes(server, "http"))["stop"] + after["length"] < before["stop"] + before["length"] + 3:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    reasons = [out.choices[0].finish_reason, reasons[-1], ids.choices[0].finish_reason]
    assert delta == {r: float(reasons.count(r)) for r in set(reasons)}


def test_openai_chat_non_stream_and_stream(server, oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = oai.chat.completions.create(model=_model(server), messages=messages, max_tokens=6, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.completion_tokens <= 6
    text, finish = [], None
    for chunk in oai.chat.completions.create(
        model=_model(server), messages=messages, max_tokens=6, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(text) == out.choices[0].message.content
    assert finish in ("length", "stop")


def test_models_health_metrics(server, oai):
    assert [m.id for m in oai.models.list().data] == [_model(server)]
    assert httpx.get(server.http_url + "/health").status_code == 200
    body = httpx.get(server.http_url + "/metrics").text
    for name in (
        "strata_requests_total",
        "strata_time_to_first_token_seconds_bucket",
        "strata_inter_token_latency_seconds_bucket",
        "strata_engine_waiting",
        "strata_engine_hit_tokens",
        "strata_engine_evictions",
        "strata_engine_compiles",
        "strata_engine_device_pool_used_pages",
        "strata_engine_transfer_bytes_total",
        "strata_engine_transfers_link_bandwidth_bytes_per_s",
    ):
        assert name in body, name


def test_grpc_generate_health_and_admin(server, grpc_client):
    assert grpc_client.health() == "SERVING"
    assert grpc_client.health("strata.v1.Strata") == "SERVING"
    msgs = list(grpc_client.generate("Hello there", max_tokens=5, temperature=0.0))
    assert msgs[-1].finished and msgs[-1].finish_reason in ("length", "stop")
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
    assert msgs[-1].usage.prompt_tokens > 0
    # the same prompt again: served partly from the cache (the per-tier counts add up)
    again = list(grpc_client.generate("Hello there", max_tokens=5, temperature=0.0))
    u = again[-1].usage
    assert (
        u.cached_tokens
        == u.cached_tokens_per_tier.device + u.cached_tokens_per_tier.host + u.cached_tokens_per_tier.storage
    )
    text_ids = list(grpc_client.generate([5, 6, 7], max_tokens=2))
    assert text_ids[-1].usage.prompt_tokens == 3
    stats = grpc_client.cache_stats()
    assert "device_pool" in stats
    grpc_client.flush_cache("all")
    with pytest.raises(grpc.RpcError) as err:
        grpc_client.flush_cache("bogus")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a request id already in flight is refused
    call = grpc_client.generate(
        "long one", max_tokens=server.frontend.engine().max_context_tokens - 64, ignore_eos=True, request_id="dup-1"
    )
    next(iter(call))
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate("again", max_tokens=2, request_id="dup-1"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in flight" in err.value.details()
    call.cancel()


def test_http_admin_routes(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        stats = http.get("/admin/cache_stats").json()
        assert {"device_pool", "locked_nodes"} <= set(stats)
        assert http.post("/admin/flush_cache", json={"tier": "device"}).json() == {"flushed": "device"}
        assert http.post("/admin/flush_cache").json() == {"flushed": "all"}  # empty body: all tiers
        r = http.post("/admin/profile/start", json={})
        assert r.status_code == 400 and "profile-dir" in r.json()["error"]["message"]


def test_grpc_reflection_lists_services(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
    assert {"strata.v1.Strata", "grpc.health.v1.Health"} <= names


# ---- bad input ----------------------------------------------------------
def _bad_http_requests(model: str, context: int) -> list[tuple[str, object, int]]:
    """(path, body (bytes or JSON-able), expected status)."""
    huge = "x " * (context * 2)
    c = "/v1/completions"
    ch = "/v1/chat/completions"
    return [
        (c, {"model": model, "prompt": ""}, 400),
        (c, {"model": model, "prompt": []}, 400),
        (c, {"model": model, "prompt": huge, "max_tokens": 1}, 400),
        (c, {"model": model, "prompt": [1, 2, 10**9]}, 400),
        (c, {"model": model, "prompt": [1, -5]}, 400),
        (c, {"model": model, "prompt": "hi", "max_tokens": -1}, 400),
        (c, {"model": model, "prompt": "hi", "max_tokens": 10**12}, 400),
        (c, {"model": model, "prompt": "hi", "temperature": -1}, 400),
        (c, b'{"model": "%s", "prompt": "hi", "temperature": 1e999}' % model.encode(), 400),
        (c, b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % model.encode(), 400),
        (c, {"model": model, "prompt": "hi", "top_p": 7}, 400),
        (c, {"model": model, "prompt": "hi", "top_k": -3}, 400),
        (c, {"model": model, "prompt": "hi", "max_tokens": "5"}, 400),
        (c, {"model": model, "prompt": 42}, 400),
        (c, {"model": model, "prompt": "hi", "stop": 3}, 400),
        (c, {"model": model, "prompt": "hi", "seed": -1}, 400),
        (c, {"model": model, "prompt": "hi", "stop": ["a"] * 100}, 400),
        (c, {"model": model, "prompt": "hi", "stop_token_ids": [-1]}, 400),
        (c, {"model": model, "prompt": "hi", "repetition_penalty": 0}, 400),
        (c, {"model": model, "prompt": [[1, 2], []]}, 400),
        (c, {"model": model, "prompt": "hi", "stream": "yes"}, 400),
        (c, {"model": model, "prompt": "hi", "n": 0}, 400),
        (c, {"model": model, "prompt": "hi", "n": 17}, 400),
        (c, {"model": model}, 400),
        (c, ["not", "an", "object"], 400),
        (c, b"{not json", 400),
        (c, b'{"model": "' + model.encode() + b'", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400),
        (c, b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe bad utf8"}', 400),
        (c, b'{"model": "' + model.encode() + b'", "prompt": "\\ud800"}', 400),
        (c, {"model": "no-such-model", "prompt": "hi"}, 404),
        (c, {"model": model, "prompt": "y" * (2 << 20)}, 413),
        (ch, {"model": model, "messages": []}, 400),
        (ch, {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
        (ch, {"model": model, "messages": "hi"}, 400),
        (
            ch,
            {
                "model": model,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            400,
        ),
        (
            ch,
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": None, "max_tokens": 2.5},
            400,
        ),
        (ch, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
        (ch, {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ("/admin/flush_cache", {"tier": "L9"}, 400),
    ]


def test_bad_http_input_gets_clear_errors_and_server_survives(server, oai):
    model, engine = _model(server), server.frontend.engine()
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        for path, body, status in _bad_http_requests(model, engine.max_context_tokens):
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (path, str(body)[:80], r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["message"] and isinstance(err["message"], str), r.text

        # an oversized body without Content-Length (chunked) is cut off at the limit too
        def chunks():
            yield b'{"model": "' + model.encode() + b'", "prompt": "'
            for _ in range(40):
                yield b"z" * 65536
            yield b'"}'

        r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        # streaming requests with bad input get the status code too (before any SSE byte)
        r = http.post("/v1/completions", json={"model": model, "prompt": "", "stream": True})
        assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    # the official client surfaces them as typed errors
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="hi", temperature=-5)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # still serving, pool accounting at baseline
    assert oai.completions.create(model=model, prompt="still alive?", max_tokens=3).usage.completion_tokens > 0
    assert_no_leaks(engine, server.baseline_used)


_ODD_VALUES = [
    None,
    -1,
    0,
    2**70,
    -(2**70),
    1.5,
    float("nan"),
    float("inf"),
    True,
    "",
    "x",
    "\u0000",
    [],
    [None],
    [1, "a"],
    [[]],
    {},
    {"a": 1},
]


def test_fuzzed_fields_never_break_the_server(server):
    """Every field of both OpenAI bodies set to odd values: always a 2xx/4xx, never a 5xx."""
    model, engine = _model(server), server.frontend.engine()
    bases = {
        "/v1/completions": {"model": model, "prompt": "fuzz", "max_tokens": 1, "temperature": 0},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 1},
    }
    fields = [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "stop",
        "seed",
        "stream_options",
        "presence_penalty",
        "logit_bias",
        "ignore_eos",
        "cache_salt",
        "request_id",
        "stop_token_ids",
        "max_completion_tokens",
        "logprobs",
        "echo",
        "best_of",
        "frequency_penalty",
        "top_logprobs",
        "min_tokens",
        "repetition_penalty",
    ]
    seen: dict[int, int] = {}
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        for path, base in bases.items():
            for field in fields:
                for value in _ODD_VALUES:
                    body = json.dumps({**base, field: value})  # NaN/Infinity literals included
                    r = http.post(path, content=body, headers={"content-type": "application/json"})
                    seen[r.status_code] = seen.get(r.status_code, 0) + 1
                    assert r.status_code in (200, 400, 404), (path, field, value, r.status_code, r.text[:300])
                    if r.status_code != 200:
                        assert r.json()["error"]["message"], r.text
                    elif r.headers["content-type"].startswith("text/event-stream"):
                        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    assert seen.get(200) and seen.get(400), seen
    assert_no_leaks(engine, server.baseline_used)


def test_bad_grpc_input_gets_status_codes(server, grpc_client):
    engine = server.frontend.engine()
    cases = [
        (strata_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (strata_pb2.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT),
        (strata_pb2.GenerateRequest(token_ids=strata_pb2.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT),
        (
            strata_pb2.GenerateRequest(token_ids=strata_pb2.TokenIds(ids=[1, 4_000_000_000])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (strata_pb2.GenerateRequest(text="x " * (engine.max_context_tokens * 2)), grpc.StatusCode.INVALID_ARGUMENT),
        (
            strata_pb2.GenerateRequest(text="hi", params=strata_pb2.SamplingParams(temperature=math.nan)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            strata_pb2.GenerateRequest(text="hi", params=strata_pb2.SamplingParams(temperature=-2)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        # max_tokens=0 is valid now (prompt scoring with prompt_logprobs); logprobs > 20 is not
        (
            strata_pb2.GenerateRequest(text="hi", params=strata_pb2.SamplingParams(logprobs=21)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            strata_pb2.GenerateRequest(text="hi", params=strata_pb2.SamplingParams(presence_penalty=3)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            strata_pb2.GenerateRequest(text="hi", params=strata_pb2.SamplingParams(max_tokens=4_000_000_000)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            strata_pb2.GenerateRequest(text="hi", params=strata_pb2.SamplingParams(top_p=float("inf"))),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (strata_pb2.GenerateRequest(text="hi", request_id="bad\nid"), grpc.StatusCode.INVALID_ARGUMENT),
        (strata_pb2.GenerateRequest(text="z" * (2 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),  # > max message
    ]
    for request, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(grpc_client.stub.Generate(request, timeout=60))
        assert err.value.code() == code, (str(request)[:80], err.value.code(), err.value.details())
        assert err.value.details()
    # invalid UTF-8 in a proto string field (raw bytes: field 1 = b'\xff\xfe')
    raw = grpc_client.channel.unary_stream("/strata.v1.Strata/Generate")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\x0a\x02\xff\xfe", timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    assert grpc_client.complete("still here", max_tokens=2)[1].finished
    assert_no_leaks(engine, server.baseline_used)


# ---- cancellation -------------------------------------------------------
def _cancelled(server, api: str) -> float:
    value = server.frontend.metrics.registry.get_sample_value(
        "strata_requests_total", {"api": api, "status": "cancelled"}
    )
    return value or 0.0


def _wait_cancelled(server, api: str, target: float, timeout: float = 30.0) -> float:
    """The cancelled-request count once it reaches ``target`` (the server records it just after the abort)."""
    deadline = time.monotonic() + timeout
    while _cancelled(server, api) < target and time.monotonic() < deadline:
        time.sleep(0.05)
    return _cancelled(server, api)


def test_http_disconnect_mid_stream_frees_pages(server):
    engine, model = server.frontend.engine(), _model(server)
    long = engine.max_context_tokens - 64
    before = _cancelled(server, "http")
    for path, body in (
        (
            "/v1/completions",
            {"model": model, "prompt": "tell me a long story", "max_tokens": long, "stream": True, "ignore_eos": True},
        ),
        (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "story"}],
                "max_tokens": long,
                "stream": True,
                "ignore_eos": True,
            },
        ),
    ):
        for _ in range(3):
            with httpx.Client(base_url=server.http_url, timeout=60) as http:
                with http.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    got = 0
                    for line in r.iter_lines():
                        got += line.startswith("data:")
                        if got >= 3:
                            break  # leave mid-stream: the connection is closed
        assert_no_leaks(engine, server.baseline_used)
    assert _wait_cancelled(server, "http", before + 6) - before == 6  # aborted, not run to the end


def test_grpc_cancel_mid_stream_frees_pages(server, grpc_client):
    engine = server.frontend.engine()
    before = _cancelled(server, "grpc")
    for _ in range(3):
        call = grpc_client.generate("tell me a long story", max_tokens=engine.max_context_tokens - 64, ignore_eos=True)
        for i, _msg in enumerate(call):
            if i == 2:
                call.cancel()
                break
        assert call.code() == grpc.StatusCode.CANCELLED
    assert_no_leaks(engine, server.baseline_used)
    assert _wait_cancelled(server, "grpc", before + 3) - before == 3


# ---- profiling ----------------------------------------------------------
def _trace_names(trace_dir: str) -> str:
    """All bytes of the trace files under ``trace_dir`` (xplane.pb holds span names as strings)."""
    blobs = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*"), recursive=True):
        if path.endswith(".xplane.pb"):
            blobs.append(open(path, "rb").read().decode("latin-1"))
        elif path.endswith(".trace.json.gz"):
            blobs.append(gzip.open(path).read().decode("utf-8", "replace"))
    assert blobs, f"no trace files under {trace_dir}"
    return "\n".join(blobs)


def test_profile_via_admin_route_and_grpc(server, grpc_client, tmp_path):
    model = _model(server)
    with httpx.Client(base_url=server.http_url, timeout=120) as http:
        r = http.post("/admin/profile/start", json={"log_dir": str(tmp_path / "http")})
        assert r.status_code == 200, r.text
        for _ in range(2):
            assert (
                http.post("/v1/completions", json={"model": model, "prompt": "profile me", "max_tokens": 8}).status_code
                == 200
            )
        r = http.post("/admin/profile/stop")
        assert r.status_code == 200, r.text
        names = _trace_names(r.json()["trace_dir"] or str(tmp_path / "http"))
    for span in ("schedule", "extend", "decode"):
        assert span in names, span

    grpc_client.start_profile(str(tmp_path / "grpc"))
    grpc_client.complete("profile me too", max_tokens=8)
    trace_dir = grpc_client.stop_profile()
    names = _trace_names(trace_dir or str(tmp_path / "grpc"))
    for span in ("schedule", "extend", "decode"):
        assert span in names, span
    with pytest.raises(grpc.RpcError) as err:
        grpc_client.stop_profile()  # not running
    assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL)
