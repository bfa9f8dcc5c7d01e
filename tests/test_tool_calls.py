"""Tool calling without a model: request checks, rendering through templates that do and do not
render tools, the grammar of required/named calls, parsing and streaming, and the HTTP face on
the tiny model (400s naming the field; calls in OpenAI's shape; agent turns hit the cache)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from serving import openai_protocol as oai
from serving import tool_calls as tc
from strata_jax.api import InvalidRequestError
from strata_jax.chat_template import load_chat_templates

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "snow, -3"},
]


def _req(**fields) -> oai.ChatCompletionRequest:
    body = {"model": "m", "messages": HISTORY, "tools": [WEATHER, TIME], **fields}
    return oai.ChatCompletionRequest.model_validate(body, strict=True)


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([{"type": "function", "function": {"description": "no name"}}], None, r"tools\[0\].function.name"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, r"tools\[0\].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectt"}}}],
            None,
            r"tools\[0\].function.parameters",
        ),
        ([WEATHER, WEATHER], None, "declared twice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        (None, "required", "tool_choice needs tools"),
    ],
)
def test_bad_tools_are_clear_errors(tools, choice, message):
    class Tok:
        def handles_tools(self, name=None):
            return False

    req = oai.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice},
        strict=True,
    )
    with pytest.raises(InvalidRequestError, match=message):
        tc.plan(req, Tok())


class _Tokenizer:
    """A tokenizer over one chat template (the plan asks it whether the template renders tools)."""

    def __init__(self, source: str, folder) -> None:
        (folder / "chat_template.jinja").write_text(source)
        self.chat_templates = load_chat_templates(folder, {})

    def handles_tools(self, name=None) -> bool:
        return self.chat_templates.handles_tools(name)

    def render(self, plan) -> str:
        return self.chat_templates.render(plan.messages, special_tokens={}, tools=plan.template_tools)


AWARE = (  # renders tools, calls and results itself (the Qwen/Hermes convention)
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
)
PLAIN = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"  # knows no tools (SmolLM2's kind)
)
STRICT = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{% endif %}{{ m.content }}{% endfor %}"
)


def test_a_template_that_renders_tools_gets_them_and_the_history(tmp_path):
    tok = _Tokenizer(AWARE, tmp_path)
    plan = tc.plan(_req(tool_choice="auto"), tok)
    text = tok.render(plan)
    assert (
        text.startswith("TOOLS:get_weather;get_time;")
        and 'CALL get_weather {"city": "Oslo"}' in text
        and "[tool]snow, -3" in text
    )
    assert plan.constraint is None and plan.fmt is tc.FORMATS["hermes"]


def test_a_template_that_does_not_gets_them_in_the_parsers_format(tmp_path):
    tok = _Tokenizer(PLAIN, tmp_path)
    plan = tc.plan(_req(tool_choice="required"), tok)
    text = tok.render(plan)
    assert text.startswith("<system>") and '"name": "get_weather"' in text.split("</system>")[0]
    assert (
        '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call></assistant>'
        in text
    )
    assert "<tool><tool_response>\nsnow, -3\n</tool_response></tool>" in text
    assert plan.constraint is not None and plan.constraint.closes_json
    none = tc.plan(_req(tool_choice="none"), tok)
    assert none.fmt is None and none.constraint is None and "get_time" not in tok.render(none)


def test_a_template_that_cannot_render_tool_messages_is_a_400(tmp_path):
    tok = _Tokenizer(STRICT, tmp_path)
    with pytest.raises(InvalidRequestError, match="roles must be user or assistant"):
        tok.render(tc.plan(_req(tool_choice="auto"), tok))


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
def test_the_grammar_admits_exactly_valid_calls(fmt_name):
    import llguidance

    fmt = tc.FORMATS[fmt_name]
    tools = tc.parse_tools([WEATHER, TIME])
    grammar = tc.StructuredOutput("grammar", fmt.grammar(tools, parallel=True)).grammar()
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return m.consume_tokens(list(text.encode())) and m.is_accepting()

    good = [fmt.render_call("get_weather", {"city": "Oslo"}), fmt.render_call("get_time", {"tz": "CET"})]
    joined = ("\n" if fmt_name == "hermes" else "; ").join(good)
    assert accepts(good[0]) and accepts(joined)
    assert not accepts(fmt.render_call("get_weather", {"city": "Oslo", "extra": 1}))  # additionalProperties false
    assert not accepts(fmt.render_call("get_time", {"tz": "PST"}))  # not in the enum
    assert not accepts(fmt.render_call("launch", {}))  # not a declared tool
    for text in good:  # the parser reads back what the grammar admits
        (call,) = fmt.parse(text)[1]
        jsonschema.validate(call.arguments, next(t.parameters for t in tools if t.name == call.name))


class _Bytes:
    tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streaming_splits_text_and_calls_wherever_the_chunks_break(step):
    fmt = tc.FORMATS["hermes"]
    text = (
        "Let me check.<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": {"city": "a</tool_call>b"}})
        + "\n</tool_call>\n"
        + fmt.render_call("get_time", {"tz": "UTC"})
        + " Done <tool"
    )
    stream = tc.CallStream(fmt)
    content, calls = "", []
    for k in range(0, len(text), step):
        c, d = stream.push(text[k : k + step], final=k + step >= len(text))
        content += c
        calls += d
    assert content.startswith("Let me check.") and content.endswith("Done <tool")  # an unfinished tag is text after all
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "a</tool_call>b"}, {"tz": "UTC"}]


def test_tools_over_http_on_the_tiny_model():
    from serving.config import ServerConfig
    from serving.server import ThreadedServer
    from strata_jax.engine import Engine, EngineConfig

    config = EngineConfig(
        model="tiny", warmup=False, show_progress=False, max_batch_size=4, device_tokens=8192, max_context_tokens=2048
    )
    srv = ThreadedServer(
        ServerConfig(port=0, grpc_port=0, enable_grpc=False, grace_s=2.0), lambda: Engine(config)
    ).start()
    try:
        url = f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions"
        base = {"model": "tiny", "max_tokens": 160, "temperature": 0, "tools": [WEATHER, TIME], "messages": HISTORY[:1]}
        r = httpx.post(
            url, json={**base, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, timeout=120
        ).json()
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert (
            r["choices"][0]["finish_reason"] == "tool_calls"
            and call["function"]["name"] == "get_time"
            and call["id"].startswith("call_")
        )
        jsonschema.validate(json.loads(call["function"]["arguments"]), TIME["function"]["parameters"])
        # the next turn resends the history with the call and its result: its prefix comes from the cache
        follow = [
            *HISTORY[:1],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "10:42"},
        ]
        again = httpx.post(
            url, json={**base, "messages": follow, "tool_choice": "auto", "max_tokens": 4}, timeout=120
        ).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        bad = httpx.post(
            url, json={**base, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, timeout=60
        )
        assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
        both = httpx.post(
            url, json={**base, "tool_choice": "required", "response_format": {"type": "json_object"}}, timeout=60
        )
        assert both.status_code == 400 and "cannot be combined" in both.json()["error"]["message"]
    finally:
        srv.stop(30.0)
