"""Mixture-of-experts GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``
from llama-cpp-python's sdist, ``tests/llama_cpp_converter.py``), not by our writer.

Random transformers models of each MoE family llama.cpp converts (``qwen3moe``, ``qwen2moe``
with its shared expert, Mixtral as ``llama`` with experts), carrying the real SmolLM2
tokenizer (the converter refuses a folder without one, and recognises SmolLM2's), are
converted to float32 GGUF files; strata-jax loads them and its logits must equal
transformers' on the original folder within 1e-4, and Mixtral's engine greedy tokens its
``generate``.  ``docs/models.md``, "Mixture of experts from GGUF".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from hf_reference import save_random_hf_model
from test_moe import _hf_logits, _runner, assert_engine_greedy_matches

from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import SeqInput

pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece (the test extra)")

BASE = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FAMILIES = {
    "qwen3moe": (
        transformers.Qwen3MoeConfig,
        dict(BASE, head_dim=32, intermediate_size=112, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
        | {"norm_topk_prob": True},
    ),
    "qwen2moe": (
        transformers.Qwen2MoeConfig,
        dict(BASE, intermediate_size=112, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        | {"num_experts": 8, "num_experts_per_tok": 3},
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(BASE, intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),
}
LOADED = ("mixtral", "qwen2moe", "qwen3moe")  # gpt_oss's file is refused (the last test)
PROMPT = np.random.default_rng(1).integers(0, 49152, size=40).tolist()


@pytest.fixture(scope="module")
def convert(smollm2_gguf, tmp_path_factory):
    """``convert(family) -> (gguf path, hf model)``: the random model saved with SmolLM2's
    tokenizer and converted by llama.cpp."""
    from llama_cpp_converter import converter
    from real_model import FetchError

    try:
        script = converter()
    except FetchError as exc:
        pytest.skip(f"llama.cpp's converter unavailable: {exc}")
    gguf = Path(smollm2_gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def run(family: str):
        config_cls, fields = FAMILIES[family]
        folder = tmp_path_factory.mktemp(family)
        hf = save_random_hf_model(config_cls(**fields), folder, seed=3)
        tokenizer.save_pretrained(folder)
        out = folder / f"{family}.gguf"
        cmd = [sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", "f32"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=script.parent)
        assert done.returncode == 0, done.stderr[-2000:]
        return out, hf

    return run


@pytest.mark.parametrize("family", LOADED)
def test_llama_cpp_written_moe_gguf_gives_transformers_logits(convert, family):
    path, hf = convert(family)
    loaded = load_model(str(path), show_progress=False)
    assert loaded.config.moe is not None
    ours = _runner(loaded.model).step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    ref = _hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4, family
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), family


def test_llama_cpp_written_mixtral_gguf_engine_greedy_tokens(convert):
    path, hf = convert("mixtral")
    assert_engine_greedy_matches(str(path), hf, 8)


def test_llama_cpp_written_gpt_oss_gguf_is_refused_naming_the_architecture(convert):
    """GPT-OSS loads from its safetensors folder; its GGUF architecture is refused by name."""
    from strata_jax.models.gguf_file import GGUFError

    path, _ = convert("gpt_oss")
    with pytest.raises(GGUFError, match="architecture 'gpt-oss' is not supported"):
        load_model(str(path), show_progress=False)
