"""The chat request fields vLLM users send, end to end over HTTP, on a model folder as HF ships it.

The engine is the contract fake (the faces are under test) carrying a real ``HFTokenizer`` over a
folder saved by transformers (``chat_template.jinja``, named templates) and a
``generation_config.json``; it records the prompt ids and ``SamplingParams`` each request reached
it with, which are compared with transformers' ``apply_chat_template(tokenize=True)`` and with the
documented precedence (request > generation_config.json > server default).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_chat_template import CHATML, CONVERSATION, TOOLS, _write_tokenizer

from serving.config import ServerConfig
from serving.server import ThreadedServer
from strata_jax.models.generation_config import GenerationDefaults
from strata_jax.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")
CONTEXT = 1024


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_folder")
    _write_tokenizer(path, {"default": CHATML, "tool_use": TOOLS})
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7})
    )
    return path


def _start(folder, **config) -> ThreadedServer:
    from serving_fake_engine import FakeEngine, FakeEngineConfig

    seen: list[tuple[list[int], object]] = []

    def build():
        engine = FakeEngine(FakeEngineConfig(max_context_tokens=CONTEXT, step_s=0.001))
        engine.tokenizer = HFTokenizer(folder)
        engine.vocab_size = engine.tokenizer.vocab_size
        engine.generation_defaults = GenerationDefaults.from_folder(folder)
        inner = engine.stream

        def recording_stream(prompt, params=None, **kw):
            seen.append((list(prompt), params))
            return inner(prompt, params, **kw)

        engine.stream = recording_stream
        return engine

    srv = ThreadedServer(
        ServerConfig(port=0, grpc_port=0, grace_s=1.0, default_chat_max_tokens=11, **config), build
    ).start()
    srv.seen = seen
    return srv


@pytest.fixture(scope="module")
def server(folder):
    srv = _start(folder)
    yield srv
    srv.stop()


def _chat(server, **body) -> httpx.Response:
    body = {"model": server.frontend.model_name, "messages": CONVERSATION, **body}
    return httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=30)


def _last(server):
    return server.seen[-1]


def test_chat_prompt_ids_equal_transformers_apply_chat_template(server, folder):
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    cases = [
        ({}, {"add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"add_generation_prompt": True, "enable_thinking": False},
        ),
        ({"chat_template": "tool_use"}, {"add_generation_prompt": True, "chat_template": "tool_use"}),
    ]
    for body, kwargs in cases:
        r = _chat(server, max_tokens=2, **body)
        assert r.status_code == 200, r.text
        expected = list(ref.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False, **kwargs))
        assert _last(server)[0] == expected, body
    # continue_final_message: the prompt ends inside the assistant's message (no end-of-turn)
    prefilled = CONVERSATION + [{"role": "assistant", "content": "Six, because"}]
    r = _chat(server, messages=prefilled, continue_final_message=True, max_tokens=2)  # add_generation_prompt unset: off
    assert r.status_code == 200, r.text
    expected = list(ref.apply_chat_template(prefilled, tokenize=True, return_dict=False, continue_final_message=True))
    assert _last(server)[0] == expected
    # add_special_tokens (vLLM's field): the tokenizer's own post-processor runs on top of the template
    assert _chat(server, max_tokens=2, add_special_tokens=True).status_code == 200
    assert (
        _last(server)[0]
        == ref(ref.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True))["input_ids"]
    )


def test_chat_field_validation_is_vllms(server):
    both = _chat(
        server,
        messages=CONVERSATION + [{"role": "assistant", "content": "x"}],
        continue_final_message=True,
        add_generation_prompt=True,
    )
    assert both.status_code == 400
    assert (
        both.json()["error"]["message"]
        == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
    unknown = _chat(server, chat_template="{% for m in messages %}{{ m }}{% endfor %}")
    assert unknown.status_code == 400 and "['default', 'tool_use']" in unknown.json()["error"]["message"]
    reserved = _chat(server, chat_template_kwargs={"add_generation_prompt": False})
    assert (
        reserved.status_code == 400
        and "chat_template_kwargs may not set ['add_generation_prompt']" in reserved.json()["error"]["message"]
    )
    wrong_type = _chat(server, chat_template_kwargs=["enable_thinking"])
    assert wrong_type.status_code == 400 and "chat_template_kwargs" in wrong_type.json()["error"]["message"]
    disagree = _chat(server, max_tokens=3, max_completion_tokens=4)
    assert disagree.status_code == 400 and "disagree" in disagree.json()["error"]["message"]


def test_max_completion_tokens_and_sampling_defaults_precedence(server):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    model = server.frontend.model_name
    out = client.chat.completions.create(model=model, messages=CONVERSATION, max_completion_tokens=3)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    params = _last(server)[1]
    assert params.max_tokens == 3
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 0)  # generation_config.json, top_k off
    assert _chat(server, max_tokens=4, max_completion_tokens=4).status_code == 200 and _last(server)[1].max_tokens == 4
    # the request's own values win, field by field
    assert _chat(server, max_tokens=2, temperature=0, top_k=5).status_code == 200
    params = _last(server)[1]
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 5)
    # unset max tokens: generation_config's max_new_tokens (7) before the server's --default-chat-max-tokens (11)
    assert _chat(server).status_code == 200 and _last(server)[1].max_tokens == 7
    # completions too take the model's sampling defaults (max_tokens keeps OpenAI's 16)
    r = httpx.post(server.http_url + "/v1/completions", json={"model": model, "prompt": "hello"}, timeout=30)
    assert r.status_code == 200 and (_last(server)[1].temperature, _last(server)[1].max_tokens) == (0.6, 16)


def test_grpc_unset_sampling_fields_take_the_models_defaults(server):
    from serving.grpc_client import StrataClient

    with StrataClient(server.grpc_target) as client:
        assert list(client.generate("hello", max_tokens=2))[-1].finished
        assert (_last(server)[1].temperature, _last(server)[1].top_p) == (0.6, 0.9)
        assert list(client.generate("hello", max_tokens=2, temperature=0.0, top_p=0.5))[-1].finished
        assert (_last(server)[1].temperature, _last(server)[1].top_p) == (0.0, 0.5)


def test_generation_config_none_uses_the_server_defaults(folder):
    srv = _start(folder, generation_config="none")
    try:
        assert _chat(srv).status_code == 200
        params = _last(srv)[1]
        assert (params.temperature, params.top_p, params.max_tokens) == (
            1.0,
            1.0,
            11,
        )  # OpenAI's, --default-chat-max-tokens
    finally:
        srv.stop()
