"""Reading a llama.cpp GGUF file: its config, its tensors under Hugging Face names, dequantized lazily.

The ``gguf`` package (an optional extra: ``pip install 'strata-jax[gguf]'``) parses the file and
dequantizes the block formats; this module maps names and metadata onto what the rest of the
loader expects (a HF ``config.json`` dict and ``NamedTensor``s), one tensor at a time, so loading
never holds more than the model in the engine's dtype plus one tensor being converted.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import numpy as np

from strata_jax.models.config import ModelConfigError
from strata_jax.models.weights import NamedTensor

GGUF_MAGIC = b"GGUF"
# Tensor types this loader dequantizes (all through ``gguf.quants``); the common llama.cpp formats.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Architectures whose attention llama.cpp's converter permutes for its interleaved rope (``permute`` in
# convert_hf_to_gguf.py); HF applies rope to halves, so q/k rows are put back in HF order here.
PERMUTED_QK_ARCHS = ("llama", "mistral")
# general.architecture values this loader reads -> the HF model_type they become.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}
# Mixtral: llama.cpp converts it as architecture "llama" with ``llama.expert_count`` > 0.
MIXTRAL_ARCH = "llama"
# Mixtures of experts (docs/models.md, "Mixture of experts from GGUF").  What llama.cpp assumes when the file
# has no ``{arch}.expert_weights_norm``: its qwen3moe graph renormalizes the top-k weights, qwen2moe does not,
# Mixtral (llama) does (``norm_w`` of build_moe_ffn in src/models/*.cpp).
MOE_DEFAULT_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False}
# The GGUF tensor kinds of a MoE layer (gguf.MODEL_TENSOR member names) -> the HF name of one layer's part;
# the ``*_EXP`` ones hold every expert of the layer in one 3-D tensor ``[expert, out, in]`` (HF order).
_MOE_TENSORS = {
    "FFN_GATE_INP": "mlp.gate.weight",
    "FFN_GATE_INP_SHEXP": "mlp.shared_expert_gate.weight",
    "FFN_GATE_SHEXP": "mlp.shared_expert.gate_proj.weight",
    "FFN_UP_SHEXP": "mlp.shared_expert.up_proj.weight",
    "FFN_DOWN_SHEXP": "mlp.shared_expert.down_proj.weight",
}
_MOE_EXPERTS = {"FFN_GATE_EXP": "gate_proj", "FFN_UP_EXP": "up_proj", "FFN_DOWN_EXP": "down_proj"}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # its checkpoint's per-expert names
# llama.cpp's converter stores Gemma's RMSNorm weights plus one (its norm multiplies by w, Gemma's by 1 + w);
# the loader subtracts it again so the tensors are the Hugging Face checkpoint's.
NORM_SHIFTED_ARCHS = ("gemma2", "gemma3")
# What llama.cpp assumes for Gemma when the file does not say (llama-model.cpp): every 2nd (Gemma 2) /
# 6th (Gemma 3) layer is global, Gemma 3's local layers rotate with base 10000, and the 27B models scale
# attention by (hidden / heads) ** -0.5 instead of head_dim ** -0.5 (Gemma 2 27B: 46 layers, Gemma 3 27B: 62).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Rows per dequantization chunk are chosen so that a chunk's float32 copy stays under this size.
DEQUANT_CHUNK_BYTES = 16 * 1024 * 1024

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm *before* the MLP (pre_feedforward_layernorm)
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"  # llama3-style rope scaling, stored as per-frequency factors


class GGUFError(ModelConfigError):
    """A GGUF file this runtime cannot read or serve faithfully; the message names the file."""


@dataclass(frozen=True)
class _HFTensor:
    """One HF checkpoint tensor as read from the file: ``info`` is the GGUF tensor or, for an expert, its
    slice of the layer's 3-D expert tensor (the experts are its outermost axis, so each is one byte range)."""

    name: str
    info: GGUFTensorInfo
    heads: int | None  # undo llama.cpp's q/k permutation with this many heads
    norm_shift: bool  # subtract llama.cpp's + 1 (Gemma's norms)


def require_gguf():
    """The ``gguf`` package, or a clear error saying how to install it."""
    try:
        import gguf
    except ModuleNotFoundError as exc:
        raise GGUFError(
            "loading a .gguf model needs the gguf package: pip install 'strata-jax[gguf]' (or pip install gguf)"
        ) from exc
    return gguf


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture ``arch``, or None when this loader does not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch in NORM_SHIFTED_ARCHS else _LAYER_NAMES
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair, half) -> (half, pair)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    hf_shape: tuple[int, ...]  # rows first, as HF stores it (GGUF lists dimensions innermost first)
    offset: int  # absolute byte offset of its data in the file
    nbytes: int


# GGUF metadata value types -> struct formats (little-endian); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
MAX_STRING_BYTES = 64 * 1024 * 1024


class _Cursor:
    """Reads GGUF's little-endian header fields from a memory map, failing clearly past its end."""

    def __init__(self, data: memoryview, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, size: int) -> memoryview:
        if size < 0 or self.pos + size > len(self.data):
            raise GGUFError(
                f"{self.path} is truncated or corrupt: its header runs past the end of the file (offset {self.pos:,})"
            )
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.scalar("<Q")
        if size > MAX_STRING_BYTES:
            raise GGUFError(f"{self.path} is corrupt: a {size:,}-byte string at offset {self.pos:,}")
        raw = self.take(size)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            if count > len(self.data):
                raise GGUFError(f"{self.path} is corrupt: an array of {count:,} items at offset {self.pos:,}")
            return [self.value(item) for _ in range(count)]
        raise GGUFError(f"{self.path} is corrupt: unknown metadata value type {kind} at offset {self.pos:,}")


class GGUFFile:
    """One opened GGUF file: its metadata, and its tensors memory-mapped until one is asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._gguf = require_gguf()
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {self.path} does not exist")
        if self.path.stat().st_size < 24:
            raise GGUFError(f"{self.path} is not a GGUF file (only {self.path.stat().st_size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cursor = _Cursor(self._map.data, self.path)  # the array's buffer: a memoryview of the mapped bytes
        magic = bytes(cursor.take(4))
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3)")
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        if tensor_count > len(self._map) or kv_count > len(self._map):
            raise GGUFError(
                f"{self.path} is corrupt: it claims {tensor_count:,} tensors and {kv_count:,} metadata fields"
            )
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        raw_tensors = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            raw_tensors.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in raw_tensors:
            self.tensors[name] = self._tensor_info(name, dims, type_id, data_start + offset)

    def _tensor_info(self, name: str, dims: list[int], type_id: int, offset: int) -> GGUFTensorInfo:
        gguf = self._gguf
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(
                f"{self.path}: tensor {name!r} has unknown tensor type id {type_id} (corrupt file?)"
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if not dims or dims[0] % block:
            raise GGUFError(
                f"{self.path} is corrupt: tensor {name!r} has shape {dims} for {qtype.name} blocks of {block}"
            )
        nbytes = math.prod(dims) // block * type_size
        end = offset + nbytes
        if end > len(self._map):
            raise GGUFError(
                f"{self.path} is truncated: tensor {name!r} needs bytes up to {end:,} but the file has "
                f"{len(self._map):,}"
            )
        return GGUFTensorInfo(name, qtype.name, tuple(reversed(dims)), offset, nbytes)

    # ---- metadata ------------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def required(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise GGUFError(f"{self.path} lacks the metadata field {key!r}")
        return value

    @cached_property
    def architecture(self) -> str:
        arch = self.required("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
            )
        return arch

    def hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face ``config.json`` as a dict."""
        arch = self.architecture

        def key(name: str) -> str:
            return f"{arch}.{name}"

        hidden = int(self.required(key("embedding_length")))
        heads = int(self.required(key("attention.head_count")))
        kv_heads = int(self.field(key("attention.head_count_kv"), heads))
        head_dim = int(self.field(key("attention.key_length"), hidden // heads))
        value_dim = int(self.field(key("attention.value_length"), head_dim))
        if value_dim != head_dim:
            raise GGUFError(f"{self.path}: attention.value_length={value_dim} differs from key_length={head_dim}")
        tokens = self.field("tokenizer.ggml.tokens")
        # the embedding's rows are the model's vocabulary (Gemma 3 4B+ pads it past the token list)
        embedding = self.tensors.get("token_embd.weight")
        vocab = (
            self.field(key("vocab_size"))
            or (embedding.hf_shape[0] if embedding else None)
            or (len(tokens) if tokens else None)
        )
        if vocab is None:
            raise GGUFError(f"{self.path} lacks {key('vocab_size')!r}, token_embd.weight and tokenizer.ggml.tokens")
        # a mixture of experts may leave out the dense width (its layers have none): the expert width stands in
        ffn = self.field(key("feed_forward_length")) if self.is_moe else self.required(key("feed_forward_length"))
        config: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[arch]],
            "model_type": GGUF_ARCHITECTURES[arch],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(ffn or 0),
            "num_hidden_layers": int(self.required(key("block_count"))),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": int(self.field(key("context_length"), 4096)),
            "rms_norm_eps": float(self.field(key("attention.layer_norm_rms_epsilon"), 1e-6)),
            "rope_theta": float(self.field(key("rope.freq_base"), 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "torch_dtype": "float32",
        }
        rope_dims = self.field(key("rope.dimension_count"))
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise GGUFError(
                f"{self.path}: partial rotary embeddings (rope.dimension_count={rope_dims}, head_dim={head_dim}) are "
                "not supported"
            )
        scaling = self._rope_scaling(config)
        if scaling is not None:
            config["rope_scaling"] = scaling
        if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe"):
            config["use_sliding_window"] = False
        if arch in NORM_SHIFTED_ARCHS:
            config.update(self._gemma_config(config))
        if self.is_moe:
            config.update(self._moe_config(config))
        for hf_key, gguf_key in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("pad_token_id", "padding_token_id"),
        ):
            value = self.field(f"tokenizer.ggml.{gguf_key}")
            if value is not None:
                config[hf_key] = int(value)
        return config

    def _gemma_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The Gemma fields of the HF config: activation, window and layer pattern, softmax
        scale, soft-caps, Gemma 3's local rope base (llama.cpp's defaults where the file is silent)."""
        arch = self.architecture
        layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else config["head_dim"]
        out: dict[str, Any] = {
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": int(self.field(f"{arch}.attention.query_pre_attn_scalar", scalar)),
            "sliding_window": int(self.required(f"{arch}.attention.sliding_window")),
        }
        # soft-caps: absent keys keep transformers' (and llama.cpp's) defaults for the architecture
        caps = (
            ("final_logit_softcapping", "attn_logit_softcapping") if arch == "gemma2" else ("final_logit_softcapping",)
        )
        out.update({cap: float(self.field(f"{arch}.{cap}")) for cap in caps if self.field(f"{arch}.{cap}") is not None})
        if arch == "gemma3":
            out["rope_local_base_freq"] = float(self.field(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
        pattern = self.field(f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
        if isinstance(pattern, list):  # one flag per layer (true: sliding window), as newer converters write it
            if len(pattern) != layers:
                raise GGUFError(
                    f"{self.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} "
                    "layers"
                )
            out["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
        else:
            out["sliding_window_pattern"] = int(pattern)
        return out

    # ---- mixtures of experts -------------------------------------------------------------------

    def _moe_key(self, name: str) -> str:
        """The metadata key ``gguf.Keys.LLM.<name>`` of this file's architecture."""
        return str(getattr(self._gguf.Keys.LLM, name)).format(arch=self.architecture)

    def _moe_tensor(self, kind: str, layer: int) -> str:
        """The GGUF name of tensor ``gguf.MODEL_TENSOR.<kind>`` of ``layer``."""
        gguf = self._gguf
        return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]].format(bid=layer) + ".weight"

    @cached_property
    def is_moe(self) -> bool:
        """qwen2moe / qwen3moe always; llama (Mixtral) when ``llama.expert_count`` > 0."""
        arch = self.architecture
        if arch in MOE_DEFAULT_NORM_TOPK:
            return True
        return arch == MIXTRAL_ARCH and int(self.field(self._moe_key("EXPERT_COUNT")) or 0) > 0

    def _moe_kinds(self) -> tuple[str, ...]:
        """The MoE tensor kinds every layer of this file's architecture needs (llama.cpp's load_arch_tensors)."""
        kinds = ("FFN_GATE_INP", *_MOE_EXPERTS)
        if self.architecture == "qwen2moe":
            kinds += ("FFN_GATE_INP_SHEXP", "FFN_GATE_SHEXP", "FFN_UP_SHEXP", "FFN_DOWN_SHEXP")
        return kinds

    def _moe_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The MoE fields of the HF config (qwen3_moe / qwen2_moe / mixtral), after checking that every
        layer has its router and expert tensors, each holding the file's expert count."""
        arch, gguf = self.architecture, self._gguf
        experts = int(self.field(self._moe_key("EXPERT_COUNT")) or 0)
        if experts <= 0:
            raise GGUFError(f"{self.path}: a {arch} model needs {self._moe_key('EXPERT_COUNT')!r} > 0")
        used = int(self.required(self._moe_key("EXPERT_USED_COUNT")))
        gating = self.field(self._moe_key("EXPERT_GATING_FUNC"))
        if gating is not None and int(gating) != int(gguf.ExpertGatingFuncType.SOFTMAX):
            raise GGUFError(
                f"{self.path}: {self._moe_key('EXPERT_GATING_FUNC')}={gating} is not supported (only 1, softmax)"
            )
        scale = self.field(self._moe_key("EXPERT_WEIGHTS_SCALE"))
        if scale is not None and float(scale) != 1.0:
            raise GGUFError(f"{self.path}: {self._moe_key('EXPERT_WEIGHTS_SCALE')}={scale} is not supported (only 1)")
        layers = config["num_hidden_layers"]
        for layer in range(layers):
            for kind in self._moe_kinds():
                name = self._moe_tensor(kind, layer)
                info = self.tensors.get(name)
                if info is None:
                    needed = ", ".join(self._moe_tensor(k, layer).split(".", 2)[2] for k in self._moe_kinds())
                    raise GGUFError(
                        f"{self.path} lacks the tensor {name!r}: every layer of a {arch} mixture of experts needs "
                        f"{needed}"
                    )
                held = info.hf_shape[0] if kind in _MOE_EXPERTS or kind == "FFN_GATE_INP" else experts
                if held != experts or (kind in _MOE_EXPERTS and len(info.hf_shape) != 3):
                    raise GGUFError(
                        f"{self.path}: tensor {name!r} has shape {info.hf_shape} (experts first), but "
                        f"{self._moe_key('EXPERT_COUNT')} is {experts}"
                    )
        width = self.field(self._moe_key("EXPERT_FEED_FORWARD_LENGTH"))
        width = int(width) if width is not None else self.tensors[self._moe_tensor("FFN_GATE_EXP", 0)].hf_shape[1]
        norm = self.field(self._moe_key("EXPERT_WEIGHTS_NORM"))
        if arch == MIXTRAL_ARCH:
            if norm is not None and not norm:
                raise GGUFError(
                    f"{self.path}: {self._moe_key('EXPERT_WEIGHTS_NORM')} is false; Mixtral always renormalizes"
                )
            return {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "num_local_experts": experts,
                "num_experts_per_tok": used,
                "intermediate_size": width,  # Mixtral's intermediate_size is its experts' width
                "sliding_window": None,  # llama.cpp's llama architecture carries no window
            }
        out: dict[str, Any] = {
            "num_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": width,
            "norm_topk_prob": MOE_DEFAULT_NORM_TOPK[arch] if norm is None else bool(norm),
            "decoder_sparse_step": 1,  # llama.cpp's qwen MoE graphs make every layer sparse
            "mlp_only_layers": [],
        }
        if not config["intermediate_size"]:
            out["intermediate_size"] = width
        if arch == "qwen2moe":
            shared = self.field(self._moe_key("EXPERT_SHARED_FEED_FORWARD_LENGTH"))
            shape = self.tensors[self._moe_tensor("FFN_GATE_SHEXP", 0)].hf_shape
            out["shared_expert_intermediate_size"] = int(shared) if shared is not None else shape[0]
            out["qkv_bias"] = "blk.0.attn_q.bias" in self.tensors
        return out

    def _rope_scaling(self, config: dict[str, Any]) -> dict[str, Any] | None:
        arch = self.architecture
        kind = self.field(f"{arch}.rope.scaling.type")
        if ROPE_FREQS in self.tensors:
            return self._llama3_scaling_from_factors(config)
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.required(f"{arch}.rope.scaling.factor"))}
        raise GGUFError(f"{self.path}: rope scaling type {kind!r} is not supported (supported: none, linear, llama3)")

    def _llama3_scaling_from_factors(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """Llama 3.x files store llama3 rope scaling only as per-frequency divisors (``rope_freqs``);
        find the parameters that produce exactly those divisors: the largest divisor is the
        factor, low/high frequency factors are Llama 3's 1 and 4, the original context a power of two."""
        stored = self.dequantize(self.tensors[ROPE_FREQS], np.dtype(np.float32)).reshape(-1)
        theta, head_dim = config["rope_theta"], config["head_dim"]
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if stored.size and float(stored.min()) == float(stored.max()) == 1.0:
            return None  # all ones: no scaling
        factor = float(stored.max())
        for original in (2**k for k in range(4, 21)):
            candidate = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": original,
            }
            divisors = _llama3_divisors(inv_freq, candidate)
            if divisors.shape == stored.shape and np.allclose(divisors, stored, rtol=1e-3):
                return candidate
        raise GGUFError(f"{self.path}: its rope_freqs tensor matches no llama3 rope scaling this runtime knows")

    # ---- tensors -------------------------------------------------------------------------------

    def dequantize(self, info: GGUFTensorInfo, dtype: np.dtype) -> np.ndarray:
        """One tensor in HF shape and ``dtype``, dequantized a chunk of rows at a time."""
        gguf = self._gguf
        if info.type_name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(
                f"{self.path}: tensor {info.name!r} has type {info.type_name}, which this loader does not dequantize "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )
        qtype = gguf.GGMLQuantizationType[info.type_name]
        row_elems = info.hf_shape[-1]
        rows = math.prod(info.hf_shape[:-1])
        data = self._map[info.offset : info.offset + info.nbytes].reshape(rows, info.nbytes // rows)
        out = np.empty((rows, row_elems), dtype=dtype)
        rows_per_chunk = max(1, DEQUANT_CHUNK_BYTES // (4 * row_elems))
        for start in range(0, rows, rows_per_chunk):
            chunk = gguf.quants.dequantize(data[start : start + rows_per_chunk], qtype)
            if not np.isfinite(chunk).all():
                raise GGUFError(f"{self.path}: tensor {info.name!r} holds NaN or infinite values (a corrupt file?)")
            out[start : start + rows_per_chunk] = chunk
        self._release(info)
        return out.reshape(info.hf_shape)

    def _release(self, info: GGUFTensorInfo) -> None:
        """Drop the file pages of a tensor already converted, so they do not add to the loader's
        resident memory (they are clean file-backed pages: the kernel re-reads them if needed)."""
        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.nbytes) // page * page
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def hf_tensors(self, num_heads: int, num_kv_heads: int) -> list[_HFTensor]:
        """Every weight under its HF checkpoint name (a MoE layer's 3-D expert tensors split into the
        per-expert tensors of the hub's checkpoints), without reading any data."""
        arch = self.architecture
        permute = arch in PERMUTED_QK_ARCHS
        moe: dict[str, tuple[str, int]] = {}
        if self.is_moe:
            layers = int(self.required(f"{arch}.block_count"))
            moe = {self._moe_tensor(kind, i): (kind, i) for i in range(layers) for kind in self._moe_kinds()}
        mixtral = self.is_moe and arch == MIXTRAL_ARCH
        out = []
        for info in self.tensors.values():
            if info.name == ROPE_FREQS:
                continue  # folded into the config's rope scaling
            if info.name in moe:
                out.extend(self._moe_hf_tensors(info, *moe[info.name], mixtral=mixtral))
                continue
            hf_name = hf_tensor_name(info.name, arch)
            if hf_name is None:
                raise GGUFError(f"{self.path}: unexpected tensor {info.name!r} for a {arch} model")
            heads = None
            if permute and ".attn_q." in info.name:
                heads = num_heads
            elif permute and ".attn_k." in info.name:
                heads = num_kv_heads
            shift = arch in NORM_SHIFTED_ARCHS and info.name.endswith("norm.weight")
            out.append(_HFTensor(hf_name, info, heads, shift))
        return out

    def _moe_hf_tensors(self, info: GGUFTensorInfo, kind: str, layer: int, *, mixtral: bool) -> list[_HFTensor]:
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
        if kind in _MOE_EXPERTS:  # [expert, out, in]: expert e is the e-th of E equal byte ranges
            proj = _MOE_EXPERTS[kind]
            experts = info.hf_shape[0]
            size = info.nbytes // experts
            return [
                _HFTensor(
                    f"{prefix}.experts.{e}.{_MIXTRAL_EXPERTS[proj] if mixtral else proj}.weight",
                    replace(
                        info,
                        name=f"{info.name}[{e}]",
                        hf_shape=info.hf_shape[1:],
                        offset=info.offset + e * size,
                        nbytes=size,
                    ),
                    None,
                    False,
                )
                for e in range(experts)
            ]
        if kind == "FFN_GATE_INP_SHEXP" and len(info.hf_shape) == 1:  # older converters squeezed its [1, D]
            info = replace(info, hf_shape=(1, *info.hf_shape))
        name = _MOE_TENSORS[kind].removeprefix("mlp.")  # the router, qwen2moe's shared expert and its gate
        return [_HFTensor(f"{prefix}.{name}", info, None, False)]

    def named_tensors(self, dtype: np.dtype, num_heads: int, num_kv_heads: int) -> list[NamedTensor]:
        """Every weight under its HF name, dequantized to ``dtype`` when ``get()`` is called."""
        return [
            NamedTensor(
                t.name,
                math.prod(t.info.hf_shape) * np.dtype(dtype).itemsize,
                partial(self._get, t.info, dtype, t.heads, t.norm_shift),
                self.path.name,
            )
            for t in self.hf_tensors(num_heads, num_kv_heads)
        ]

    def _get(self, info: GGUFTensorInfo, dtype: np.dtype, heads: int | None, norm_shift: bool = False) -> np.ndarray:
        if norm_shift:  # undo llama.cpp's + 1 in float32, then round once to the target dtype
            return (self.dequantize(info, np.dtype(np.float32)) - 1.0).astype(dtype)
        array = self.dequantize(info, dtype)
        return unpermute_qk(array, heads) if heads else array


_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def _llama3_divisors(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """How much llama3 scaling divides each rope frequency by (what llama.cpp stores in rope_freqs)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    divisors = np.where(wavelen > low_wavelen, factor, 1.0)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, 1.0 / ((1 - smooth) / factor + smooth), divisors).astype(np.float32)
