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

# Sliding-window and hybrid (local/global) models; windows far below the tests' prompt lengths.
SLIDING_CONFIGS: dict[str, tuple[type, dict]] = {
    "mistral_window": (transformers.MistralConfig, dict(BASE, sliding_window=16)),
    # layers >= max_window_layers slide: layer 0 full, layer 1 local
    "qwen2_window": (
        transformers.Qwen2Config,
        dict(BASE, use_sliding_window=True, sliding_window=12, max_window_layers=1),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            BASE,
            num_hidden_layers=3,
            head_dim=32,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.05,
            final_logit_softcapping=0.5,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            BASE,
            num_hidden_layers=4,
            head_dim=32,
            sliding_window=16,
            query_pre_attn_scalar=24,
            sliding_window_pattern=3,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
}

# google/gemma-3-270m's config.json as published (the base model the real GGUF of the tests holds).
GEMMA3_270M_CONFIG = dict(
    architectures=["Gemma3ForCausalLM"],
    attention_bias=False,
    attn_logit_softcapping=None,
    bos_token_id=2,
    eos_token_id=1,
    final_logit_softcapping=None,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=640,
    intermediate_size=2048,
    max_position_embeddings=32768,
    num_attention_heads=4,
    num_hidden_layers=18,
    num_key_value_heads=1,
    pad_token_id=0,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_local_base_freq=10000.0,
    rope_theta=1000000.0,
    sliding_window=512,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
    vocab_size=262144,
)


def make_hf_model(kind: str, folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Build a random HF model of ``kind`` (``overrides`` replace config fields), save it to
    ``folder`` and return it (float32, eval)."""
    config_cls, kwargs = CONFIGS[kind] if kind in CONFIGS else SLIDING_CONFIGS[kind]
    return save_random_hf_model(config_cls(**{**kwargs, **overrides}), folder, seed)


def save_random_hf_model(config: transformers.PretrainedConfig, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random HF model of ``config`` saved to ``folder`` (float32, eval; biases and norm
    weights randomised too)."""
    torch.manual_seed(seed)
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


def hf_gemma3_270m_from_gguf(gguf_path: str) -> torch.nn.Module:
    """transformers' Gemma 3 from the real GGUF: the published gemma-3-270m config, tensors read,
    dequantized, renamed and norm-shifted by transformers' own GGUF loader (float32, eval)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.Gemma3TextConfig(**GEMMA3_270M_CONFIG)
    with torch.device("meta"):
        skeleton = transformers.Gemma3ForCausalLM(config)
    loaded = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)
    for key in ("hidden_size", "num_hidden_layers", "sliding_window", "head_dim", "num_key_value_heads", "vocab_size"):
        assert loaded["config"][key] == GEMMA3_270M_CONFIG[key], key  # the file is the model the config describes
    state = {name: tensor.to(torch.float32) for name, tensor in loaded["tensors"].items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    skeleton.load_state_dict(state, strict=True, assign=True)  # no second full-size init
    skeleton.model.rotary_emb = type(skeleton.model.rotary_emb)(config)  # buffers were on the meta device
    skeleton.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size**0.5)
    return skeleton.eval()
