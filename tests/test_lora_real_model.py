"""LoRA on the real SmolLM2-135M-Instruct (Q4_1 GGUF from the registry) against transformers + peft.

transformers reads the same GGUF (its own dequantization); peft wraps it with random adapters
of non-trivial scale (two ranks, rsLoRA on and off, all seven target modules and a subset),
saved as PEFT folders the engine loads.  Logits within 1e-4 and greedy tokens identical,
cold and with the prompt from L1, L2 and L3.  Skips, saying why, when the model cannot be
fetched (tests/real_model.py).  Heavy (about two minutes here): ``pytest -m heavy``.

SmolLM2 has 9 attention heads and 3 KV heads, so it cannot run at tp 2; the tensor-parallel
check runs it at tp 3 (the random GQA model of tests/test_lora.py runs at tp 2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import hf_model_from_gguf

pytest.importorskip("peft", reason="the LoRA references need peft (pip install -e '.[test]')")
from lora_reference import ALL_MODULES, save_random_adapter  # noqa: E402

from strata_jax.api import SamplingParams  # noqa: E402
from strata_jax.engine import Engine, EngineConfig  # noqa: E402

pytestmark = pytest.mark.heavy

NEW_TOKENS = 8
# (rank, alpha, rsLoRA, targets, seed)
ADAPTERS = {"r8rs": (8, 16, True, ALL_MODULES, 21), "r16": (16, 16, False, ["q_proj", "v_proj", "down_proj"], 22)}


@pytest.fixture(scope="module")
def adapters(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_real")
    base = hf_model_from_gguf(smollm2_gguf)
    refs = {}
    for name, (rank, alpha, rslora, targets, seed) in ADAPTERS.items():
        refs[name] = save_random_adapter(base, root / name, rank, alpha, rslora, targets, seed, scale=0.03)
    return root, base, refs


def _engine(smollm2_gguf, root, **overrides) -> Engine:
    config = dict(
        model=smollm2_gguf,
        warmup=False,
        show_progress=False,
        tiers="L1+L2+L3",
        page_size=16,
        device_tokens=4096,
        max_batch_tokens=512,
        max_batch_size=4,
        max_context_tokens=1024,
        prefetch_policy="wait_complete",
        prefetch_min_tokens=0,
        storage_dir=str(root / "kv"),
        max_loras=2,
        lora_modules=tuple((name, str(root / name)) for name in ADAPTERS),
    )
    return Engine(EngineConfig(**(config | overrides)))


@pytest.fixture(scope="module")
def setup(smollm2_gguf, adapters):
    root, base, refs = adapters
    engine = _engine(smollm2_gguf, root)
    yield engine, base, refs
    engine.shutdown()


def _hf_greedy(model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_logits_equal_peft_on_the_real_model(setup):
    from strata_jax.runtime.model_runner import SeqInput

    engine, base, refs = setup
    ids = engine.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    runner = engine.runner
    for entry in engine.adapters.listing():
        pages = list(range(4000 // 16, 4000 // 16 + 2))  # past what the cache hands out in these tests
        ours = runner.step([SeqInput(ids, 0, pages, adapter_slot=entry.slot)], all_logits=True).logits[: len(ids)]
        with torch.no_grad():
            ref = refs[entry.adapter.name](torch.tensor([ids])).logits[0].numpy()
            plain = base(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(ours - ref).max() <= 1e-4, entry.adapter.name
        assert np.abs(ref - plain).max() > 0.5, entry.adapter.name  # a non-trivial adapter: the check can fail


def test_greedy_tokens_equal_peft_cold_and_from_every_tier(setup):
    engine, base, refs = setup
    tok = engine.tokenizer
    question = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}]),
        add_special_tokens=False,
    )
    document = tok.encode("Gravity is the force by which a planet draws objects toward its center. " * 40)[:600]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for name, ref in refs.items():
        for prompt in (question, document):
            assert engine.generate([prompt], params, lora_name=name)[0].token_ids == _hf_greedy(ref, prompt), name
    assert engine.generate([document], params)[0].token_ids == _hf_greedy(base, document)
    full = len(document) // 16 * 16
    for name, ref in refs.items():
        want = _hf_greedy(ref, document)
        l1 = engine.generate([document], params, lora_name=name)[0]
        assert l1.token_ids == want and l1.cached_tokens["device"] == full, name
    engine.flush_cache("device")
    for name in refs:
        l2 = engine.generate([document], params, lora_name=name)[0]
        assert l2.token_ids == _hf_greedy(refs[name], document) and l2.cached_tokens["host"] == full, name
    engine.flush_cache("device")
    engine.flush_cache("host")
    for name in refs:
        l3 = engine.generate([document], params, lora_name=name)[0]
        assert l3.token_ids == _hf_greedy(refs[name], document) and l3.cached_tokens["storage"] == full, name


def test_tensor_parallel_three_gives_the_tokens_of_peft(smollm2_gguf, adapters):
    root, _base, refs = adapters
    engine = _engine(smollm2_gguf, root, tp=3, tiers="L1+L2", storage_dir=None)
    try:
        prompt = engine.tokenizer.encode("Rivers carry water from the mountains to the sea, " * 12)
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        for name, ref in refs.items():
            assert engine.generate([prompt], params, lora_name=name)[0].token_ids == _hf_greedy(ref, prompt), name
        engine.flush_cache("device")
        for name, ref in refs.items():
            out = engine.generate([prompt], params, lora_name=name)[0]
            assert out.token_ids == _hf_greedy(ref, prompt) and out.cached_tokens["host"] > 0, name
    finally:
        engine.shutdown()
