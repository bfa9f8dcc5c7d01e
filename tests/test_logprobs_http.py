"""The OpenAI HTTP and gRPC faces of logprobs, echo, n/best_of, penalties, logit_bias,
min_tokens and continuous usage: OpenAI's shapes, values equal to the engine's own
(checked against HF in test_logprobs_engine.py), and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_harness import assert_no_leaks, shared_server

from serving.grpc_client import StrataClient
from serving.protos import strata_pb2
from strata_jax.api import SamplingParams


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as client:
        yield client


def _post(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(http, path, body):
    events = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_echo_scoring_matches_the_engine(server, http):
    engine = server.frontend.engine()
    model = server.frontend.model_name
    prompt = "The cat sat on"
    body = {"model": model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    out = _post(http, "/v1/completions", body)
    choice = out["choices"][0]
    ids = engine.tokenizer.encode(prompt)
    lp = choice["logprobs"]
    assert choice["text"] == prompt and out["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == prompt and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    ref = engine.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    assert lp["token_logprobs"][1:] == pytest.approx([p.logprob for p in ref[1:]], abs=1e-6)
    for top, entry in zip(lp["top_logprobs"][1:], ref[1:]):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-6)
    # lm-eval's request: echo + logprobs + max_tokens 1 -> prompt positions, then the generated one
    one = _post(http, "/v1/completions", dict(body, max_tokens=1))["choices"][0]["logprobs"]
    assert len(one["tokens"]) == len(ids) + 1 and one["token_logprobs"][: len(ids)] == lp["token_logprobs"]


def test_completion_logprobs_streamed_and_not_agree(server, http):
    model = server.frontend.model_name
    body = {
        "model": model,
        "prompt": "hello there",
        "logprobs": 3,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = _post(http, "/v1/completions", body)["choices"][0]["logprobs"]
    # byte tokens that decode alike share a key in the dict (OpenAI's legacy shape): 1..4 entries
    assert len(full["tokens"]) == 5 and all(1 <= len(t) <= 4 for t in full["top_logprobs"])
    events = _sse(http, "/v1/completions", dict(body, stream=True))
    streamed = [x for e in events if e["choices"] for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(full["token_logprobs"], abs=1e-6)


def test_chat_logprobs_shape(server, http):
    model = server.frontend.model_name
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    out = _post(http, "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["logprob"] - 1e-6
    events = _sse(http, "/v1/chat/completions", dict(body, stream=True))
    streamed = [
        c["logprob"]
        for e in events
        if e["choices"] and e["choices"][0].get("logprobs")
        for c in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == pytest.approx([c["logprob"] for c in content], abs=1e-6)


def test_n_choices_and_best_of(server, http):
    model = server.frontend.model_name
    body = {
        "model": model,
        "prompt": "abcdefghijklmnopqrstuvwxyz0123456789",
        "n": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
    }
    out = _post(http, "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in out["choices"]}) == 3
    assert _post(http, "/v1/completions", body)["choices"] == out["choices"]  # seeded: reproducible
    single = _post(http, "/v1/completions", dict(body, n=1))
    assert out["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]  # the prompt once
    assert out["usage"]["completion_tokens"] == 18
    best = _post(http, "/v1/completions", dict(body, n=1, best_of=3, logprobs=0))
    assert len(best["choices"]) == 1
    scored = _post(http, "/v1/completions", dict(body, logprobs=0))["choices"]  # the same 3 (seeded)
    assert [c["text"] for c in scored] == [c["text"] for c in out["choices"]]
    means = [sum(c["logprobs"]["token_logprobs"]) / 6 for c in scored]
    got = sum(best["choices"][0]["logprobs"]["token_logprobs"]) / 6
    assert got == pytest.approx(max(means), abs=1e-5)
    events = _sse(http, "/v1/completions", dict(body, stream=True, n=2))
    assert {e["choices"][0]["index"] for e in events if e["choices"]} == {0, 1}
    chat = _post(
        http,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "max_tokens": 3,
            "temperature": 1.0,
            "seed": 1,
        },
    )
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert_no_leaks(server.frontend.engine(), server.baseline_used)


def test_penalties_bias_min_tokens_reach_the_engine(server, http):
    engine = server.frontend.engine()
    model = server.frontend.model_name
    fields = {
        "frequency_penalty": 1.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"65": 3.0},
        "min_tokens": 4,
    }
    body = {"model": model, "prompt": "aaaa", "max_tokens": 8, "temperature": 0, **fields}
    text = _post(http, "/v1/completions", body)["choices"][0]["text"]
    params = SamplingParams(
        max_tokens=8,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={65: 3.0},
        min_tokens=4,
    )
    assert text == engine.generate(["aaaa"], params)[0].text
    assert text != engine.generate(["aaaa"], SamplingParams(max_tokens=8))[0].text


def test_continuous_usage_stats(server, http):
    model = server.frontend.model_name
    body = {
        "model": model,
        "prompt": "hi",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = _sse(http, "/v1/completions", body)
    with_choices = [e for e in events if e["choices"]]
    assert all("usage" in e for e in with_choices)
    assert [e["usage"]["completion_tokens"] for e in with_choices] == [1, 2, 3, 4]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 17}, "n"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
        ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
        ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"min_tokens": 99}, "min_tokens"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"n": -1}, "n"),
        ("/v1/chat/completions", {"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ],
)
def test_bad_values_are_400_naming_the_field(server, http, path, extra, field):
    model = server.frontend.model_name
    base = (
        {"model": model, "prompt": "hi", "max_tokens": 4}
        if path == "/v1/completions"
        else {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    r = http.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message and "Traceback" not in message


def test_grpc_carries_the_fields(server):
    engine = server.frontend.engine()
    params = strata_pb2.SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1, frequency_penalty=1.0, min_tokens=2)
    params.logit_bias[66] = 2.0
    with StrataClient(server.grpc_target) as client:
        replies = list(
            client.stub.Generate(
                strata_pb2.GenerateRequest(token_ids=strata_pb2.TokenIds(ids=[72, 105, 33]), params=params)
            )
        )
    tokens = [t for r in replies for t in r.token_ids]
    lps = [lp for r in replies for lp in r.logprobs]
    ref = engine.generate(
        [[72, 105, 33]],
        SamplingParams(
            max_tokens=3, logprobs=2, prompt_logprobs=1, frequency_penalty=1.0, min_tokens=2, logit_bias={66: 2.0}
        ),
    )[0]
    assert tokens == ref.token_ids and [lp.token_id for lp in lps] == tokens
    assert [lp.logprob for lp in lps] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-6)
    assert all(len(lp.top) == 2 for lp in lps)
    prompt_lps = [lp for r in replies for lp in r.prompt_logprobs]
    assert [lp.token_id for lp in prompt_lps] == [105, 33]
    assert [lp.logprob for lp in prompt_lps] == pytest.approx([x.logprob for x in ref.prompt_logprobs[1:]], abs=1e-6)
