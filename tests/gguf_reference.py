"""Writing GGUF files the way llama.cpp's converter does, from random Hugging Face models.

The conventions (tensor names, metadata keys, the q/k row permutation of llama-architecture
models) are restated here from llama.cpp's ``convert_hf_to_gguf.py`` independently of the
loader under test, so a test compares the loader against the HF model the file was made from.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

# HF model_type -> the architecture llama.cpp writes (Mistral is converted as llama)
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",  # llama.cpp converts Mixtral as llama, with llama.expert_count > 0
}
# Gemma: four norms per layer, ffn_norm is the one before the MLP; llama.cpp stores every norm weight + 1
_GEMMA_LAYER = {
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Mixtures of experts (convert_hf_to_gguf.py's Qwen2MoeModel, which Qwen3MoeModel extends, and LlamaModel for
# Mixtral): the router and qwen2moe's shared expert keep one tensor per layer; a layer's experts are stacked into
# one [expert, out, in] tensor per projection (GGUF lists the dims reversed: {in, out, expert}).  transformers 5
# holds them fused in memory: gate_up_proj [E, 2F, D] (gate rows first) is split on its middle axis, as the
# converter does for fused checkpoints.  The routers (ffn_gate_inp, ffn_gate_inp_shexp) stay F32 (prepare_tensors).
_MOE_LAYER = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_F32_ONLY = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _moe_tensors(name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The HF tensor ``model.layers.N.<rest>`` as the GGUF tensors llama.cpp writes for it."""
    parts = name.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    if rest == "mlp.experts.gate_up_proj":
        width = array.shape[1] // 2
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", array[:, :width]),
            (f"blk.{layer}.ffn_up_exps.weight", array[:, width:]),
        ]
    return [(f"blk.{layer}.{_MOE_LAYER[rest]}", array)]


def _write_moe_metadata(writer, cfg, expert_count: int | None, weights_norm: bool | None) -> None:
    """TextModel.set_gguf_parameters (expert counts) and Qwen2MoeModel's (expert widths)."""
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    writer.add_expert_count(experts if expert_count is None else expert_count)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None) is not None:
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None) is not None:
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if weights_norm is not None:  # not written by llama.cpp's qwen/llama converters; its graph assumes the value
        writer.add_expert_weights_norm(weights_norm)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's two rope halves."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama_cpp_rope_freqs(cfg, head_dim: int) -> np.ndarray | None:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: llama3 rope scaling as one
    divisor per rope frequency (the ``rope_freqs`` tensor), None for other rope types."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "llama3":
        return None
    base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    rest = ".".join(parts[3:])
    names = {**_LAYER, **_GEMMA_LAYER} if arch.startswith("gemma") else _LAYER
    return f"blk.{parts[2]}.{names[rest]}"


def _write_gemma_metadata(writer, cfg) -> None:
    """What llama.cpp's Gemma2Model / Gemma3Model converters add: the window, the soft-caps (Gemma 2),
    the per-layer pattern (newer converters; true = sliding window) and Gemma 3's local rope base."""
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if cfg.model_type == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        full = cfg.rope_parameters["full_attention"]
        if full.get("rope_type") == "linear":  # Gemma3Model.set_gguf_parameters: global layers' scaling
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])


def write_gguf(
    hf_model: torch.nn.Module,
    path: Path,
    *,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    arch: str | None = None,
    tokenizer: dict | None = None,
    expert_count: int | None = None,
    expert_weights_norm: bool | None = None,
    drop: tuple[str, ...] = (),
    squeeze_shared_gate: bool = False,
) -> Path:
    """Write ``hf_model`` as llama.cpp would (2-D and 3-D weights as ``tensor_type``, norms, biases and
    routers F32).  For the error tests: ``expert_count`` overrides the metadata's, ``drop`` leaves
    those GGUF tensors out; ``squeeze_shared_gate`` writes ffn_gate_inp_shexp 1-D, as older converters did."""
    cfg = hf_model.config
    arch = arch or GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)  # Gemma 3: the global layers' rope
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or params["rope_theta"]))
    if arch.startswith("gemma"):
        _write_gemma_metadata(writer, cfg)
    rope_freqs = llama_cpp_rope_freqs(cfg, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    moe = cfg.model_type in ("qwen3_moe", "qwen2_moe", "mixtral")
    if moe:
        _write_moe_metadata(writer, cfg, expert_count, expert_weights_norm)
    if tokenizer:
        writer.add_tokenizer_model(tokenizer["model"])
        if "pre" in tokenizer:
            writer.add_tokenizer_pre(tokenizer["pre"])
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["types"])
        if "merges" in tokenizer:
            writer.add_token_merges(tokenizer["merges"])
        if "scores" in tokenizer:
            writer.add_token_scores(tokenizer["scores"])
        writer.add_bos_token_id(tokenizer["bos"])
        writer.add_eos_token_id(tokenizer["eos"])
        if "chat_template" in tokenizer:
            writer.add_chat_template(tokenizer["chat_template"])
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1.0
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        named = _moe_tensors(name, array) if moe and (".mlp." in name) else [(gguf_name(name, arch), array)]
        for out_name, out in named:
            if out_name in drop:
                continue
            if squeeze_shared_gate and out_name.endswith("ffn_gate_inp_shexp.weight"):
                out = out.reshape(-1)
            _add_tensor(writer, out_name, out, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer, name: str, array: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> None:
    block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    quantize = tensor_type != gguf.GGMLQuantizationType.F32 and array.ndim >= 2 and array.shape[-1] % block == 0
    if quantize and not name.endswith(_F32_ONLY):  # blocks run along each row (the last axis)
        array = np.ascontiguousarray(array, dtype=np.float32)
        try:
            raw = gguf.quants.quantize(array, tensor_type)
        except NotImplementedError:  # a type gguf-py cannot quantize: all-zero blocks are still valid data
            raw = np.zeros((*array.shape[:-1], array.shape[-1] // block * type_size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=tensor_type)
    else:  # llama.cpp too keeps norms, biases and rows that are not whole blocks in F32
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
