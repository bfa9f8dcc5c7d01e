"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the registry) against Hugging Face transformers.

transformers loads the same GGUF with its own reader, name mapping, q/k un-permutation and
tokenizer conversion; greedy tokens must be equal, cold and with the prefix from L1, L2 and L3.
Skips, saying why, when the model cannot be fetched (see tests/real_model.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_model_from_gguf

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8
LONG_PROMPT_TOKENS = 1100
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    """transformers' tokenizer converted from the same GGUF file."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(Path(smollm2_gguf).parent), gguf_file=Path(smollm2_gguf).name)


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    """transformers' model from the same GGUF file."""
    return hf_model_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def engine(smollm2_gguf, tmp_path_factory):
    engine = Engine(
        EngineConfig(
            model=smollm2_gguf,
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            page_size=16,
            device_tokens=4096,
            max_batch_tokens=512,
            max_batch_size=4,
            max_context_tokens=2048,
            prefetch_policy="wait_complete",
            prefetch_min_tokens=0,
            storage_dir=str(tmp_path_factory.mktemp("kv")),
        )
    )
    yield engine
    engine.shutdown()


def _hf_greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_tokenizer_and_chat_template_match_transformers(engine, hf_tokenizer):
    hf_tok = hf_tokenizer
    ours = engine.tokenizer
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "In 2024, 12,345 people   visited  Zürich\tand naïve café-goers said: 'it's fine!'\n\nNew line.",
        "<|im_start|>user\nhi<|im_end|>",  # control tokens stay whole
        "def f(x):\n    return x ** 2  # 😀",
    ]
    for text in texts:
        assert ours.encode(text) == hf_tok(text).input_ids, text
        assert ours.decode(ours.encode(text)) == hf_tok.decode(hf_tok(text).input_ids, skip_special_tokens=True)
    rendered = ours.apply_chat_template(QUESTION)
    assert rendered == hf_tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert engine.eos_token_ids == (hf_tok.eos_token_id,) and ours.bos_token_id == hf_tok.bos_token_id


@pytest.mark.slow  # ~2 min of CPU: transformers' GGUF load, a 1,100-token prompt through both, four tiers
def test_greedy_tokens_match_transformers_from_every_tier(engine, hf_model):
    tok = engine.tokenizer
    long_ids = tok.encode((REPO / "README.md").read_text() * 3)[:LONG_PROMPT_TOKENS]
    assert len(long_ids) == LONG_PROMPT_TOKENS
    prompts = [
        tok.encode(tok.apply_chat_template(QUESTION), add_special_tokens=False),
        tok.encode("Gravity is the force by which a planet or other body draws objects toward its center."),
        long_ids,
    ]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    cold = engine.generate(prompts, params)
    for prompt, out in zip(prompts, cold):
        assert out.token_ids == _hf_greedy(hf_model, prompt), tok.decode(prompt)[:60]
    full_pages = LONG_PROMPT_TOKENS // 16 * 16
    l1 = engine.generate([long_ids], params)[0]
    engine.flush_cache("device")
    l2 = engine.generate([long_ids], params)[0]
    engine.flush_cache("device")
    engine.flush_cache("host")
    l3 = engine.generate([long_ids], params)[0]
    assert l1.cached_tokens["device"] == full_pages
    assert l2.cached_tokens["host"] == full_pages and l2.cached_tokens["device"] == 0
    assert l3.cached_tokens["storage"] == full_pages
    assert cold[2].token_ids == l1.token_ids == l2.token_ids == l3.token_ids


def test_chat_answers_a_factual_question(engine):
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template(QUESTION), add_special_tokens=False)
    out = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"  # ended at <|im_end|>, the GGUF's eos


def test_http_chat_completion_answers_too(engine):
    import httpx

    from serving.config import ServerConfig
    from serving.server import ThreadedServer

    srv = ThreadedServer(ServerConfig(port=0, grpc_port=0, enable_grpc=False, grace_s=2.0), lambda: engine).start()
    try:
        body = {"model": engine.model_name, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{srv.server.http_port}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    finally:
        srv.stop(30.0)


@pytest.mark.slow  # writes and reloads the 538 MB float32 folder
def test_convert_gives_a_folder_transformers_loads_with_the_same_model(smollm2_gguf, hf_model, hf_tokenizer, tmp_path):
    import json

    import transformers

    from strata_jax.models.gguf_model import convert_gguf

    out = convert_gguf(smollm2_gguf, tmp_path / "smollm2")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == hf_tokenizer.eos_token_id
    assert (out / "chat_template.jinja").read_text() == hf_tokenizer.chat_template
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "In 2024, 12,345 people visited Zürich.\n<|im_start|>user"
    assert tok(text).input_ids == hf_tokenizer(text).input_ids
    assert tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    ) == hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = hf_tokenizer(text).input_ids
    with torch.no_grad():
        ours, ref = model(torch.tensor([ids])).logits, hf_model(torch.tensor([ids])).logits
    assert (ours - ref).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.heavy  # ~1 min: a second engine on the same GGUF and transformers on a 1,100-token prompt
def test_mixed_steps_keep_greedy_tokens_equal_to_transformers(smollm2_gguf, hf_model):
    """Two short prompts decode inside the 256-token chunks of a long one (mixed steps, issue 41)."""
    engine = Engine(
        EngineConfig(
            model=smollm2_gguf,
            warmup=False,
            show_progress=False,
            page_size=16,
            device_tokens=4096,
            max_batch_tokens=256,
            max_batch_size=4,
            max_context_tokens=2048,
            mixed_steps=True,
        )
    )
    try:
        tok = engine.tokenizer
        long_ids = tok.encode((REPO / "docs" / "design.md").read_text())[:LONG_PROMPT_TOKENS]
        prompts = [
            tok.encode(tok.apply_chat_template(QUESTION), add_special_tokens=False),
            tok.encode("Gravity is the force by which a planet or other body draws objects toward its center."),
            long_ids,
        ]
        outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert engine.counters["mixed_steps"] >= 3  # the short ones' decodes rode in the long one's chunks
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == _hf_greedy(hf_model, prompt), tok.decode(prompt)[:60]
    finally:
        engine.shutdown()
