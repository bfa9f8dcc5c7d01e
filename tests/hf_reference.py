"""Hugging Face references: tiny random models saved to disk, and transformers' own load of a GGUF file."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

CONFIGS: dict[str, tuple[type, dict]] = {
    "llama3_scaled": (
        transformers.LlamaConfig,
        dict(
            BASE,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama_linear": (transformers.LlamaConfig, dict(BASE, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_tied": (transformers.LlamaConfig, dict(BASE, tie_word_embeddings=True, head_dim=24)),
    "mistral": (transformers.MistralConfig, dict(BASE, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(BASE)),
    "qwen3": (transformers.Qwen3Config, dict(BASE, head_dim=32)),
}


def make_hf_model(kind: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Build a random HF model of ``kind``, save it to ``folder`` and return it (float32, eval)."""
    config_cls, kwargs = CONFIGS[kind]
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits biases/norm weights trivially; randomise so they are exercised
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_model_from_gguf(gguf_path: str) -> torch.nn.Module:
    """transformers' Llama model from a GGUF file (float32, its own dequantization and q/k un-permutation)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.LlamaConfig(**load_gguf_checkpoint(gguf_path)["config"])
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    state = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(state, strict=False)  # tied: lm_head is the embedding
    model.tie_weights()
    return model.eval()
