"""The HTTP face fuzzed from its own OpenAPI schema (schemathesis) against the running server.

Every operation of ``GET /openapi.json`` gets requests generated from the schema (positive:
bodies that fit it; negative: bodies that break it), sent to the real tiny engine on
127.0.0.1.  Checks: no 5xx (nor an error event inside a 200 SSE stream), every 4xx an
OpenAI error envelope, and a 400/404/422 names the offending field (``error.param``, or the
field's name in the message); afterwards the server is healthy and no page is leaked.

Bounds, so the engine serves rather than decodes: the schema the fuzzer reads is the app's
own with ``maxLength``/``maxItems``/``maximum`` added to the fields that cost decode work
(``max_tokens`` 4, ``n`` 2, short prompts and messages), ``model`` pinned to the served name
(else nearly every request would be a 404), and a chat body without ``max_tokens`` gets 4
(the server's default is 256).  Profile routes write into a temporary folder.

``STRATA_FUZZ_EXAMPLES`` (default 1000) is the number of cases per operation and mode for
the generation routes; the others get a tenth of it.  The totals are printed as ``FUZZ {...}``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from serving_harness import assert_no_leaks, shared_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.core.transport import STREAM_CUT_SHORT_ATTRIBUTE as STREAM_CUT_SHORT  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # ~4-5 min on 2 cores with the default budget

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "1000"))
MAX_TOKENS = 4
# Field -> JSON-schema keywords added for the fuzzer (on every branch of an anyOf that takes them).
BOUNDS: dict[str, dict[str, Any]] = {
    "max_tokens": {"maximum": MAX_TOKENS},
    "max_completion_tokens": {"maximum": MAX_TOKENS},
    "min_tokens": {"maximum": MAX_TOKENS},
    "n": {"maximum": 2},
    "best_of": {"maximum": 2},
    "logprobs": {"maximum": 5},
    "top_logprobs": {"maximum": 5},
    "prompt": {"maxLength": 64, "maxItems": 4},
    "messages": {"maxItems": 3},
    "content": {"maxLength": 64, "maxItems": 3},
    "text": {"maxLength": 64},
    "stop": {"maxItems": 4, "maxLength": 8},
    "stop_token_ids": {"maxItems": 4},
    "logit_bias": {"maxProperties": 4},
    "tools": {"maxItems": 2},
}
_KEYWORD_TYPES = {"maximum": "integer", "maxLength": "string", "maxItems": "array", "maxProperties": "object"}
# 4xx whose cause is a field of the body; the others (413 body size, 409 profile state, ...) need a message only.
FIELD_ERRORS = (400, 404, 422)


def _bound(prop: dict[str, Any], keywords: dict[str, Any]) -> None:
    """Add ``keywords`` to ``prop`` (or to each anyOf branch of the matching type), recursing into array items."""
    for branch in prop.get("anyOf", [prop]):
        kind = branch.get("type")
        for key, value in keywords.items():
            if _KEYWORD_TYPES[key] == kind or (key == "maximum" and kind == "number"):
                branch[key] = value
        if kind == "array" and isinstance(branch.get("items"), dict) and "maxLength" in keywords:
            _bound(branch["items"], {k: v for k, v in keywords.items() if k != "maxItems"})


def bounded_schema(schema: dict[str, Any], model: str) -> dict[str, Any]:
    """The app's schema with the fuzzing bounds added and ``model`` pinned to the served name."""
    schema = copy.deepcopy(schema)
    for component in schema["components"]["schemas"].values():
        props = component.get("properties", {})
        for name, keywords in BOUNDS.items():
            if name in props:
                _bound(props[name], keywords)
        if "model" in props:
            props["model"] = {"type": "string", "enum": [model]}
    return schema


def _prepare(case: Any, profile_dir: str) -> None:
    """The per-request bounds a schema cannot say (a default the server would otherwise pick)."""
    body = case.body
    if not isinstance(body, dict):
        return
    # A null limit is no limit (the server's chat default, 256 tokens, applies), so it counts as absent.
    unbounded = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if case.path == "/v1/chat/completions" and unbounded:
        body["max_tokens"] = MAX_TOKENS
    if case.path == "/admin/profile/start" and isinstance(body.get("log_dir"), str):
        body["log_dir"] = profile_dir  # never a fuzzed path on this machine


def field_names(schema: dict[str, Any]) -> frozenset[str]:
    """The name of every property of every body in the schema (what an error may name)."""
    names = {name for component in schema["components"]["schemas"].values() for name in component.get("properties", {})}
    return frozenset(names | {"body"})


def names_a_field(message: str, fields: frozenset[str]) -> bool:
    """Whether ``message`` names one of ``fields`` as a word (``messages.0.role: ...`` names ``messages``)."""
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) for name in fields)


def check_response(status: int, text: str, content_type: str, fields: frozenset[str]) -> str | None:
    """What is wrong with one response, or ``None``."""
    if status >= 500:
        return f"{status}: {text[:300]}"
    if status < 400:
        if content_type.startswith("text/event-stream"):
            events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
            if not events or events[-1] != "[DONE]":
                bad = [e for e in events if '"error"' in e]
                return f"SSE stream without [DONE]: {bad[:1] or events[-1:]}"
        return None
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an error envelope: {text[:200]}"
    message, param = error.get("message"), error.get("param")
    if not isinstance(message, str) or not message:
        return f"{status} without a message: {text[:200]}"
    if status in FIELD_ERRORS and not param and not names_a_field(message, fields):
        return f"{status} does not name the field: {message[:200]}"
    return None


class Tally:
    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()
        self.per_operation: Counter[str] = Counter()
        self.failures: list[str] = []

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())


def fuzz_operation(
    operation: Any, base_url: str, examples: int, tally: Tally, profile_dir: str, fields: frozenset[str]
) -> None:
    """``examples`` generated cases per mode, sent one by one; failures are collected, not shrunk
    (shrinking would spend the time budget re-sending variations of one failure)."""
    label = f"{operation.method.upper()} {operation.path}"
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            _prepare(case, profile_dir)
            response = case.call(base_url=base_url, timeout=120)
            tally.statuses[response.status_code] += 1
            tally.per_operation[label] += 1
            content_type = response.headers.get("content-type") or [""]  # schemathesis: header -> list of values
            if getattr(response, STREAM_CUT_SHORT, False):
                # schemathesis stops reading an event stream after its max_stream_events (20): the
                # bounds above must keep every stream shorter, or [DONE] would seem missing.
                problem: str | None = "SSE stream longer than the fuzzer's client reads (a bound of this test)"
            else:
                problem = check_response(response.status_code, response.text, content_type[0], fields)
            if problem is not None:
                body = json.dumps(case.body, default=str)[:300]
                # noqa reason: run() runs to the end within this iteration of the mode loop
                tally.failures.append(f"{label} [{mode.value}] {problem} <- {body}")  # noqa: B023

        try:
            run()
        except Unsatisfiable:  # negative mode of an operation with nothing to negate (a GET without parameters)
            if mode is schemathesis.GenerationMode.POSITIVE:
                raise


@pytest.fixture(scope="module")
def server():
    return shared_server()


def test_openapi_fuzz_no_5xx_no_crash_no_leak(server, tmp_path):
    engine, model, url = server.frontend.engine(), server.frontend.model_name, server.http_url
    raw = httpx.get(url + "/openapi.json", timeout=30).json()
    for path in GENERATION_PATHS:  # the schema describes the bodies the handlers read by hand
        assert raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], path
    schema = schemathesis.openapi.from_dict(bounded_schema(raw, model))
    operations = [result.ok() for result in schema.get_all_operations()]
    fields = field_names(raw)
    tally = Tally()
    t0 = time.monotonic()
    for operation in operations:
        examples = EXAMPLES if operation.path in GENERATION_PATHS else max(10, EXAMPLES // 10)
        if operation.path.startswith("/admin/profile"):
            examples = 5  # each start/stop writes a trace
        fuzz_operation(operation, url, examples, tally, str(tmp_path / "profile"), fields)
    with contextlib.suppress(RuntimeError):  # a fuzzed profile/start without its stop: leave no trace running
        engine.stop_profile()
    server_errors = sum(n for status, n in tally.statuses.items() if status >= 500)
    report = {
        "operations": len(operations),
        "requests": tally.requests,
        "5xx": server_errors,
        "failures": len(tally.failures),
        "statuses": dict(sorted(tally.statuses.items())),
        "seconds": round(time.monotonic() - t0, 1),
        "per_operation": dict(tally.per_operation),
    }
    print("FUZZ", json.dumps(report))
    assert len(operations) == sum(len(methods) for methods in raw["paths"].values())  # every operation fuzzed
    assert all(tally.per_operation[f"{op.method.upper()} {op.path}"] for op in operations), tally.per_operation
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert tally.statuses.get(200) and tally.statuses.get(400), tally.statuses  # both kinds of answer were reached
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert_no_leaks(engine, server.baseline_used)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, MAX_TOKENS),
        ({"max_completion_tokens": None}, MAX_TOKENS),  # a null limit is no limit (CI once streamed 256 tokens)
        ({"max_tokens": None, "max_completion_tokens": None}, MAX_TOKENS),
        ({"max_tokens": 2}, 2),
        ({"max_completion_tokens": 3}, None),
    ],
)
def test_prepare_bounds_every_chat_body_without_a_limit(body, expected):
    case = SimpleNamespace(path="/v1/chat/completions", body=dict(body))
    _prepare(case, "/unused")
    assert case.body.get("max_tokens") == expected
