"""Agents' requests on the real model (SmolLM2-135M-Instruct) through `strata-jax serve` and the
`openai` client: structured outputs parse and validate every time (checked with pydantic,
jsonschema, Python's `re` and set membership, independently of the server).

Skips, saying why, when the model cannot be fetched (tests/real_model.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]
N = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    """`strata-jax serve` on the real model, in its own process."""
    port, grpc_port = _free_port(), _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "serving.cli",
        "serve",
        "--model",
        smollm2_gguf,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--max-batch-size",
        "8",
        "--max-context-tokens",
        "2048",
        "--device-tokens",
        "16384",
        "--show-progress",
        "false",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"serve did not become ready:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"]


FRUITS = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "lime",
    "mango",
    "melon",
    "orange",
    "papaya",
    "peach",
    "pear",
    "plum",
    "kiwi",
    "fig",
    "date",
    "guava",
    "lychee",
    "apricot",
    "coconut",
]
PEOPLE = [
    ("Alice", 31, "Paris"),
    ("Bob", 45, "Madrid"),
    ("Chen", 27, "Beijing"),
    ("Dana", 52, "Cairo"),
    ("Emil", 38, "Oslo"),
]


def _each(fn, items):
    # The first call alone: the openai client builds each response model's pydantic schema lazily, and
    # threads that race to build it the first time raise PydanticUserError ("BaseModel cannot be
    # instantiated directly"; CI's heavy run, where this file's first call was a threaded one).
    items = list(items)
    first = fn(items[0])
    with concurrent.futures.ThreadPoolExecutor(N) as pool:  # the rest at once: constrained rows batched together
        return [first, *pool.map(fn, items[1:])]


@pytest.mark.slow
def test_parse_with_a_pydantic_model_20_of_20(client, model):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    def ask(i):
        name, age, city = PEOPLE[i % len(PEOPLE)]
        text = f"{name} is {age} years old and lives in {city}. Give the person's name, age and city as JSON."
        return client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": text}],
            response_format=Person,
            max_tokens=80,
            temperature=0.7,
            seed=i,
        )

    replies = _each(ask, range(N))
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person), choice.message.content  # parsed and validated by the client
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())


@pytest.mark.slow
@pytest.mark.heavy  # the default run keeps the pydantic parse and the 400s: the server starts once for them
def test_json_object_regex_and_choice_every_time(client, model):
    def json_object(i):
        return client.chat.completions.create(
            model=model,
            max_tokens=120,
            temperature=0.8,
            seed=i,
            response_format={"type": "json_object"},
            messages=[{"role": "user", "content": f"{FRUITS[i]}: give its name and color as a JSON object."}],
        )

    for r in _each(json_object, range(N)):
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content  # closed, not cut by max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content

    pattern = r"[0-9]{3}-[0-9]{4}"
    choices = ["positive", "negative", "neutral"]

    def regex(i):
        return client.completions.create(
            model=model,
            prompt=f"Phone number {i}: ",
            max_tokens=16,
            temperature=0.8,
            seed=i,
            extra_body={"structured_outputs": {"regex": pattern}},
        )

    def choice(i):
        return client.chat.completions.create(
            model=model,
            max_tokens=8,
            temperature=0.8,
            seed=i,
            extra_body={"structured_outputs": {"choice": choices}},
            messages=[{"role": "user", "content": f"Is 'I loved it, take {i}' positive, negative or neutral?"}],
        )

    for r in _each(regex, range(N)):
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    for r in _each(choice, range(N)):
        assert r.choices[0].message.content in choices, r.choices[0].message.content


@pytest.mark.slow
def test_bad_constraints_are_400s_naming_the_field(server, model):
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectt"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": {"type": "string", "format": "no-such-format"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ]
    for extra, field in cases:
        r = httpx.post(f"{server}/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (extra, r.status_code, r.text)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a timezone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in SCHEMAS, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.heavy  # the default run keeps the pydantic parse and the 400s: the server starts once for them
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_calls_20_of_20(client, model, stream):
    def ask(args):
        i, choice = args
        city = PEOPLE[i % len(PEOPLE)][2]
        messages = [{"role": "user", "content": f"What is the weather in {city} right now, and what time is it there?"}]
        kwargs = dict(
            model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0.7, seed=i
        )
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            return reply.choices[0].finish_reason, reply.choices[0].message.tool_calls
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):  # OpenAI's delta shape, reassembled
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            for d in delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        from types import SimpleNamespace

        return finish, [SimpleNamespace(function=SimpleNamespace(**c)) for _, c in sorted(calls.items())]

    named = {"type": "function", "function": {"name": "get_time"}}
    results = _each(ask, [(i, "required") for i in range(N)] + [(i, named) for i in range(N)])
    for finish, calls in results[:N]:
        assert finish == "tool_calls"
        _check_calls(calls)
    for finish, calls in results[N:]:
        assert finish == "tool_calls"
        _check_calls(calls)
        assert all(c.function.name == "get_time" for c in calls)
