"""Model configuration read from a Hugging Face ``config.json``.

Supported: ``llama`` (rope scaling below), ``mistral``
(sliding window), ``qwen2`` (qkv bias; ``use_sliding_window`` + ``max_window_layers``),
``qwen3`` (per-head q/k RMSNorm), ``gemma2`` (local/global layers, attention and final
logit soft-capping), ``gemma3_text`` (local/global layers with their own rope
bases, q/k norm) and the mixture-of-experts families ``qwen3_moe``, ``qwen2_moe`` (shared
expert; dense layers by ``mlp_only_layers`` / ``decoder_sparse_step``), ``mixtral`` and
``gpt_oss`` (attention sinks, biases, clamped SwiGLU experts) (``MoEConfig``); GQA; explicit ``head_dim``; tied or
untied embeddings.  Both the transformers-4 (``rope_theta`` + ``rope_scaling``) and transformers-5
(``rope_parameters``) spellings are read.  Rope scaling (``rope_type``): ``default``,
``linear``, ``llama3``, ``yarn``, ``longrope`` and ``dynamic`` (NTK), read as transformers
reads them (``docs/models.md``, "Rope scaling", says where a position-only serving engine
differs: ``dynamic`` and ``longrope``).  Anything this runtime cannot reproduce exactly
raises ``ModelConfigError`` naming the field and its value.

Per-layer attention is ``layer_windows``: one sliding window per layer (0 = full
attention), ``()`` when every layer is full; the model scans it as an array, so local
and global layers stay one program (``docs/models.md``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *GEMMA_MODEL_TYPES, *MOE_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic", "longrope")
# model types users bring that are refused, each with why (docs/models.md, "What is refused")
UNSERVED_MODEL_TYPES = {
    "deepseek_v2": "multi-head latent attention (a compressed KV) and grouped top-k routing are not built",
    "deepseek_v3": "multi-head latent attention (a compressed KV) and grouped top-k routing are not built",
    "gemma3": "the multimodal Gemma 3 (vision + text); its text-only checkpoints (gemma3_text) are served",
    "llava": "multimodal (a vision encoder in front of the decoder)",
    "mllama": "multimodal (cross-attention to image features)",
    "qwen2_vl": "multimodal (a vision encoder and M-RoPE)",
    "qwen2_5_vl": "multimodal (a vision encoder and M-RoPE)",
    "mamba": "state-space layers keep a recurrent state, not a KV cache the tiers can page",
    "mamba2": "state-space layers keep a recurrent state, not a KV cache the tiers can page",
    "jamba": "its state-space layers keep a recurrent state, not a KV cache the tiers can page",
    "t5": "an encoder-decoder; this runtime serves causal decoders",
    "bart": "an encoder-decoder; this runtime serves causal decoders",
    "bert": "an encoder; this runtime serves causal decoders",
}
# Scalings Gemma 3's global layers may take: one rope table per layer, no per-token or cos/sin factor
GEMMA3_ROPE_TYPES = ("default", "llama3", "linear")
# HF activation names -> what the MLP computes (gelu_pytorch_tanh and gelu_new are the same tanh formula)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu")
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' defaults for fields a Gemma config.json may leave out
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "pattern": 2,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "sliding_window": 4096,
        "pattern": 6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rope_local_base_freq": 10000.0,
    },
}


# transformers' (5.25) defaults for fields a mixture-of-experts config.json may leave out
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "sliding_window": 4096,
    },
    "qwen2_moe": {
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "mixtral": {
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-5,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "gpt_oss": {  # transformers' (5.25) GptOssConfig
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "rms_norm_eps": 1e-5,
        "num_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    },
}


# transformers' (5.25) GptOssConfig's default rope: yarn, factor 32 over 4,096 positions
GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class ModelConfigError(ValueError):
    """A config.json this runtime cannot serve faithfully."""


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model (``moe.MoEBlock``), the same in every sparse
    layer (``ModelConfig.sparse_layers``).

    The router (``gate``; a bias with ``router_bias``) scores ``num_experts`` experts per token; the softmax
    (float32) picks the ``num_experts_per_tok`` best, their probabilities renormalized to sum
    to one when ``norm_topk_prob`` (qwen: the config's flag; mixtral, gpt_oss: always); each picked
    expert (a SiLU-gated MLP of width ``expert_intermediate_size``) runs on the token and
    their outputs are summed weighted by those probabilities.  ``float32_combine``: the
    expert outputs are multiplied by the float32 weights before the cast back (mixtral); else
    the weights are cast to the model's dtype first (qwen).  ``shared_expert_intermediate_size``
    > 0 (qwen2_moe): a dense SiLU-gated MLP of that width on every token, times
    ``sigmoid(shared_expert_gate(x))``, added to the experts' sum.
    """

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    float32_combine: bool = False
    # GPT-OSS: the router and every expert projection have biases, and the experts' gated unit
    # is the clamped SwiGLU ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    # ``g = min(gate, limit)`` (``swiglu_limit`` None: the plain ``silu(gate) * up``).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"moe {name}={value!r} must be a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        value = self.shared_expert_intermediate_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelConfigError(f"shared_expert_intermediate_size={value!r} must be a non-negative integer")


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` / ``rope_parameters`` as transformers resolves them.

    ``attention_factor`` is the resolved factor transformers multiplies cos and sin by
    (yarn: ``attention_factor`` or from ``factor`` / ``mscale`` / ``mscale_all_dim``;
    longrope: ``attention_factor`` or ``sqrt(1 + ln(factor) / ln(original))``; else 1).
    ``beta_fast`` / ``beta_slow`` / ``truncate``: yarn's ramp.  ``short_factor`` /
    ``long_factor``: longrope's per-frequency divisors (one per rotary pair).
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # a config read back from JSON (checkpoint.read_checkpoint_config) holds lists: keep it hashable
        for name in ("short_factor", "long_factor"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention: the sliding window of each layer (0 = full attention); () = all full.
    layer_windows: tuple[int, ...] = ()
    # Rope base of the sliding-window layers when it differs from rope_theta (Gemma 3's local
    # layers; they take no rope scaling); None = every layer uses rope_theta and rope_scaling.
    rope_local_theta: float | None = None
    hidden_act: str = "silu"
    # Softmax scale = query_pre_attn_scalar ** -0.5 (None: head_dim, as Llama).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # Mixture of experts: the sparse layers' MLP is this block (None: every layer the dense MLP).
    moe: MoEConfig | None = None
    # With ``moe``, which layers are sparse (qwen's ``mlp_only_layers`` / ``decoder_sparse_step``);
    # the others are dense MLPs of ``intermediate_size``.  () = every layer sparse.
    sparse_layers: tuple[bool, ...] = ()
    # GPT-OSS attention: a learned sink logit per query head joins each softmax's denominator,
    # and o_proj has a bias as q/k/v do.
    attention_sinks: bool = False
    attention_out_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ModelConfigError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ModelConfigError(f"layer windows must be >= 0 (0 = full attention), got {self.layer_windows}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelConfigError(
                f"hidden_act={self.hidden_act!r} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        if self.sparse_layers:
            if self.moe is None or len(self.sparse_layers) != self.num_layers:
                raise ModelConfigError(
                    f"sparse_layers needs moe and one entry per layer ({self.num_layers}), got {self.sparse_layers}"
                )
            if all(self.sparse_layers) or not any(self.sparse_layers):
                raise ModelConfigError("sparse_layers must mix sparse and dense layers (() = every layer sparse)")
        scaling = self.rope_scaling
        if scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.head_dim // 2:
                    raise ModelConfigError(
                        f"rope_scaling.{name} has {len(getattr(scaling, name))} entries; head_dim={self.head_dim} "
                        f"needs {self.head_dim // 2}"
                    )
        if scaling.rope_type == "dynamic" and self.head_dim <= 2:
            raise ModelConfigError(f"rope_scaling.rope_type='dynamic' needs head_dim > 2, got {self.head_dim}")

    @property
    def is_gemma(self) -> bool:
        """Gemma 2/3 layout: (1 + w) RMSNorm, sqrt(hidden)-scaled embedding, norms around
        attention and MLP (pre/post), always-tied head unless the checkpoint says otherwise."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def norm_scale_in_float32(self) -> bool:
        """GPT-OSS: its RMSNorms scale in float32 and cast after (transformers keeps them in
        float32); the others cast before the scale, as Llama's does."""
        return self.model_type == "gpt_oss"

    @property
    def layer_is_sparse(self) -> tuple[bool, ...]:
        """One entry per layer: True where the MLP is the mixture of experts."""
        if self.moe is None:
            return (False,) * self.num_layers
        return self.sparse_layers or (True,) * self.num_layers

    @property
    def mlp_stack_rows(self) -> tuple[int, ...]:
        """Each layer's row in the stack of its MLP kind (a mixed stack keeps the dense and the
        sparse MLPs in two stacks, ``llama.DecoderModel``): its index among the layers of its kind."""
        sparse = self.layer_is_sparse
        return tuple(sum(1 for kind in sparse[:layer] if kind == sparse[layer]) for layer in range(self.num_layers))

    @property
    def mixed_mlp_layers(self) -> bool:
        """A stack mixing dense and sparse MLP layers (``sparse_layers``)."""
        return bool(self.sparse_layers)

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_windows)

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """One entry per layer: True for a sliding-window (local) layer."""
        return tuple(w > 0 for w in self.layer_windows) if self.layer_windows else (False,) * self.num_layers

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_context_tokens(self) -> int:
        """The longest sequence the model serves: ``max_position_embeddings``, except for
        ``dynamic`` NTK scaling, where that is the unscaled length the NTK base grows from
        and the scaled limit is ``factor`` times it, and ``yarn``, whose scaled limit is
        ``factor`` times ``original_max_position_embeddings`` when that is longer (Qwen3's
        documented 128K set-up keeps ``max_position_embeddings`` 40960); both as vLLM derives them."""
        scaling = self.rope_scaling
        if scaling.rope_type == "dynamic":
            return int(self.max_position_embeddings * scaling.factor)
        if scaling.rope_type == "yarn":
            return max(self.max_position_embeddings, int(scaling.original_max_position_embeddings * scaling.factor))
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        mlp = dense_mlp
        if self.moe is not None:  # every expert (all are held), the router, the shared expert and its gate
            m = self.moe
            mlp = self.hidden_size * (
                3 * m.num_experts * m.expert_intermediate_size
                + m.num_experts
                + 3 * m.shared_expert_intermediate_size
                + (1 if m.shared_expert_intermediate_size else 0)
            )
            mlp += m.num_experts if m.router_bias else 0
            mlp += m.num_experts * (2 * m.expert_intermediate_size + self.hidden_size) if m.expert_bias else 0
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (4 if self.is_gemma else 2) * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        bias += self.hidden_size if self.attention_out_bias else 0
        bias += self.num_heads if self.attention_sinks else 0
        sparse = sum(self.layer_is_sparse)
        mlps = sparse * mlp + (self.num_layers - sparse) * dense_mlp
        return self.num_layers * (attn + norms + bias) + mlps + embed + self.hidden_size

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type == "gemma3" and isinstance(raw.get("text_config"), dict):
            raise ModelConfigError(
                "model_type='gemma3' is the multimodal Gemma 3 (vision + text), which is not supported; "
                "its text-only checkpoints (model_type 'gemma3_text', e.g. gemma-3-270m / gemma-3-1b) and GGUF files "
                "are"
            )
        if isinstance(model_type, str) and model_type in UNSERVED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type={model_type!r} is not supported: {UNSERVED_MODEL_TYPES[model_type]} "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        gemma = _GEMMA_DEFAULTS.get(model_type)
        if gemma is None:
            act = raw.get("hidden_act", "silu")
            if act != "silu":
                raise ModelConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
        else:
            act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
            if act not in SUPPORTED_ACTIVATIONS:
                raise ModelConfigError(
                    f"hidden_activation={act!r} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
                )
            if raw.get("use_bidirectional_attention"):
                raise ModelConfigError(
                    "use_bidirectional_attention=True is not supported (this runtime serves causal decoders)"
                )
        if raw.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=True is not supported")
        _check_quantization(raw, model_type)
        family = gemma or _MOE_DEFAULTS.get(model_type)  # transformers' defaults of the family, if it has its own
        if model_type == "qwen3_moe" and raw.get("attention_bias"):
            raise ModelConfigError("attention_bias=True is not supported for qwen3_moe (its o_proj would have a bias)")
        hidden = _required_int(raw, "hidden_size")
        heads = _required_int(raw, "num_attention_heads")
        layers = _required_int(raw, "num_hidden_layers")
        kv_heads = int(raw.get("num_key_value_heads") or (family or {}).get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or (family or {}).get("head_dim") or hidden // heads)
        max_pos = int(raw.get("max_position_embeddings", family["max_position_embeddings"] if family else 4096))
        if model_type == "gemma3_text":
            theta, scaling, local_theta = _read_gemma3_rope(raw, max_pos)
        elif model_type == "gpt_oss" and raw.get("rope_scaling") is None and raw.get("rope_parameters") is None:
            # transformers' GptOssConfig: yarn when the config.json names no rope
            with_rope = {**raw, "rope_scaling": GPT_OSS_DEFAULT_ROPE}
            theta, scaling = _read_rope(with_rope, max_pos, default_theta=family["rope_theta"] if family else 10000.0)
            local_theta = None
        else:
            theta, scaling = _read_rope(raw, max_pos, default_theta=family["rope_theta"] if family else 10000.0)
            local_theta = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        moe, sparse_layers = _read_moe(raw, model_type, layers) if model_type in MOE_MODEL_TYPES else (None, ())
        extra: dict[str, Any] = {}
        if gemma is not None:
            extra = dict(
                hidden_act="gelu_pytorch_tanh" if act == "gelu_new" else act,
                query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                # transformers' Gemma 3 attention never applies attn_logit_softcapping (Gemma 2's does)
                attn_logit_softcapping=None
                if model_type == "gemma3_text"
                else _cap(raw, "attn_logit_softcapping", gemma),
                final_logit_softcapping=_cap(raw, "final_logit_softcapping", gemma),
            )
        return cls(
            model_type=model_type,
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", family.get("rms_norm_eps", 1e-6) if family else 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma is not None)),
            attention_bias=_attention_bias(raw, model_type),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(raw, model_type, layers),
            rope_local_theta=local_theta,
            moe=moe,
            sparse_layers=sparse_layers,
            attention_sinks=model_type == "gpt_oss",
            attention_out_bias=model_type == "gpt_oss" and _attention_bias(raw, model_type),
            **extra,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ModelConfigError(f"no config.json in {path}")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{config_file} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{config_file} must hold a JSON object")
        return cls.from_hf_dict(raw)


def _check_quantization(raw: dict[str, Any], model_type: str) -> None:
    """A quantized checkpoint's ``quantization_config``: only GPT-OSS's MXFP4 experts are read
    (dequantized at load, ``mxfp4.py``); any other method is refused here, naming it, rather
    than failing later on tensor names the loader does not know."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if model_type == "gpt_oss" and method == "mxfp4":
        return
    raise ModelConfigError(
        f"quantization_config with quant_method={method!r} is not supported: strata-jax loads unquantized "
        "checkpoints (and GPT-OSS's MXFP4 experts, dequantized at load); use the unquantized checkpoint "
        "(its dtype is cast at load) or a GGUF file"
    )


def _attention_bias(raw: dict[str, Any], model_type: str) -> bool:
    """q/k/v biases: qwen2 always, qwen2_moe by ``qkv_bias`` (default true), mixtral never
    (transformers' Mixtral ignores ``attention_bias``), the rest by ``attention_bias``."""
    if model_type == "qwen2":
        return True
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    if model_type == "mixtral":
        return False
    if model_type == "gpt_oss":  # q/k/v and o, default true (GptOssConfig.attention_bias)
        return bool(raw.get("attention_bias", True))
    return bool(raw.get("attention_bias", False))


def _read_moe(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """The sparse MLP of a ``qwen3_moe`` / ``qwen2_moe`` / ``mixtral`` / ``gpt_oss`` config as
    transformers (5.25) builds it, and which layers are sparse (``()``: all); None when no
    layer is sparse (qwen with ``num_experts`` 0, or ``decoder_sparse_step`` past the last
    layer: every layer is then the dense MLP of ``intermediate_size``, as in transformers).

    qwen: layer ``i`` is sparse iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0``, the others dense MLPs of ``intermediate_size`` (``ModelConfig.sparse_layers``).  The
    expert width is ``moe_intermediate_size``;
    ``norm_topk_prob`` defaults to false (transformers' default for both qwen families).
    mixtral: every layer sparse, the expert width is ``intermediate_size``, the top-k
    probabilities always renormalized and applied in float32.
    """
    defaults = _MOE_DEFAULTS[model_type]
    # mixtral and qwen3_moe's config.json (its attribute_map) spell it num_local_experts, qwen2_moe num_experts
    experts = next((raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None), None)
    experts = defaults["num_experts"] if experts is None else experts
    top_k = raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    if model_type == "gpt_oss":  # top-k of the router's logits, softmax over those k (= renormalized)
        alpha = raw.get("swiglu_alpha", defaults["swiglu_alpha"])
        limit = raw.get("swiglu_limit", defaults["swiglu_limit"])
        for name, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ModelConfigError(f"{name}={value!r} must be a positive number")
        gpt_oss = MoEConfig(
            num_experts=experts,
            num_experts_per_tok=top_k,
            expert_intermediate_size=_required_int(raw, "intermediate_size"),
            norm_topk_prob=True,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(limit),
            swiglu_alpha=float(alpha),
        )
        return gpt_oss, ()
    if model_type == "mixtral":
        mixtral = MoEConfig(
            num_experts=experts,
            num_experts_per_tok=top_k,
            expert_intermediate_size=_required_int(raw, "intermediate_size"),
            norm_topk_prob=True,
            float32_combine=True,
        )
        return mixtral, ()
    if isinstance(experts, int) and not isinstance(experts, bool) and experts == 0:
        return None, ()  # transformers: every layer the dense MLP
    step = raw.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ModelConfigError(f"decoder_sparse_step={step!r} must be a positive integer")
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ModelConfigError(f"mlp_only_layers={mlp_only!r} must be a list of layer indices")
    sparse = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
    if not any(sparse):
        return None, ()
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ModelConfigError(f"norm_topk_prob={norm!r} must be true or false")
    qwen = MoEConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        expert_intermediate_size=raw.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
        norm_topk_prob=norm,
        shared_expert_intermediate_size=raw.get(
            "shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"]
        )
        if model_type == "qwen2_moe"
        else 0,
    )
    return qwen, (() if all(sparse) else sparse)


def _required_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"config field {key}={value!r} must be a positive integer")
    return value


def _read_rope(raw: dict[str, Any], max_pos: int, default_theta: float = 10000.0) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
        scaling_raw: dict[str, Any] | None = params
    else:
        theta = float(raw.get("rope_theta", default_theta))
        scaling_raw = raw.get("rope_scaling")
    return theta, _read_scaling(scaling_raw, max_pos, raw)


def _read_scaling(scaling_raw: dict[str, Any] | None, max_pos: int, raw: dict[str, Any] | None = None) -> RopeScaling:
    """One rope-parameter dict as transformers' ``modeling_rope_utils`` reads it (``max_pos``:
    the config's ``max_position_embeddings``; ``raw``: the whole config, whose top-level
    ``original_max_position_embeddings`` / ``partial_rotary_factor`` transformers also honours)."""
    if not scaling_raw:
        return RopeScaling()
    raw = raw or {}
    rope_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope_scaling.rope_type={rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeScaling()
    partial = scaling_raw.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and (isinstance(partial, bool) or not isinstance(partial, (int, float)) or partial != 1.0):
        raise ModelConfigError(f"partial_rotary_factor={partial!r} is not supported (rope rotates the whole head)")
    # transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3
    # style) wins, else the rope dict's, else max_position_embeddings
    original = raw.get("original_max_position_embeddings", scaling_raw.get("original_max_position_embeddings", max_pos))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ModelConfigError(f"rope_scaling.original_max_position_embeddings={original!r} must be a positive integer")
    factor = scaling_raw.get("factor")
    if factor is None:
        if rope_type in ("yarn", "longrope"):  # transformers: the ratio of the two lengths (DeepSeek, Phi-3)
            factor = max_pos / original
        elif rope_type == "dynamic":
            raise ModelConfigError("rope_scaling.rope_type='dynamic' needs a factor")
        else:
            factor = 1.0
    factor = _positive(factor, "factor")
    extra: dict[str, Any] = {}
    if rope_type == "yarn":
        extra = _yarn_fields(scaling_raw, factor)
    elif rope_type == "longrope":
        extra = _longrope_fields(scaling_raw, factor, original)
    return RopeScaling(
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        **extra,
    )


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelConfigError(f"rope_scaling.{name}={value!r} must be a positive number")
    return float(value)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1), transformers' ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_fields(scaling_raw: dict[str, Any], factor: float) -> dict[str, Any]:
    attention_factor = scaling_raw.get("attention_factor")
    mscale, mscale_all_dim = scaling_raw.get("mscale"), scaling_raw.get("mscale_all_dim")
    if attention_factor is None:  # transformers: the mscale ratio only when both are set and non-zero
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    truncate = scaling_raw.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelConfigError(f"rope_scaling.truncate={truncate!r} must be true or false")
    return dict(
        attention_factor=_positive(attention_factor, "attention_factor"),
        # transformers: `or`, so 0 / None take the paper's 32 / 1
        beta_fast=_finite(scaling_raw.get("beta_fast") or 32, "beta_fast"),
        beta_slow=_finite(scaling_raw.get("beta_slow") or 1, "beta_slow"),
        truncate=truncate,
    )


def _longrope_fields(scaling_raw: dict[str, Any], factor: float, original: int) -> dict[str, Any]:
    attention_factor = scaling_raw.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    lists = {}
    for name in ("short_factor", "long_factor"):
        values = scaling_raw.get(name)
        if (
            not isinstance(values, list)
            or not values
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values
            )
        ):
            raise ModelConfigError(f"rope_scaling.{name}={values!r} must be a list of positive numbers")
        lists[name] = tuple(float(v) for v in values)
    return dict(attention_factor=_positive(attention_factor, "attention_factor"), **lists)


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelConfigError(f"rope_scaling.{name}={value!r} must be a number")
    return float(value)


def _read_gemma3_rope(raw: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling, float]:
    """(global rope_theta, global scaling, local rope base) of a Gemma 3 config.

    transformers 5 nests them per layer type (``rope_parameters.full_attention`` /
    ``.sliding_attention``); transformers 4 spells ``rope_theta`` + ``rope_scaling`` (global
    layers only) and ``rope_local_base_freq``.  Local layers take no scaling; global layers
    take the scalings that are one frequency table (``GEMMA3_ROPE_TYPES``).
    """
    defaults = _GEMMA_DEFAULTS["gemma3_text"]
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", raw.get("rope_theta", defaults["rope_theta"])))
        local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", defaults["rope_local_base_freq"])))
        if _read_scaling(local, max_pos).rope_type != "default":
            raise ModelConfigError(
                f"rope_parameters.sliding_attention.rope_type={local.get('rope_type')!r}: scaled rope on local layers "
                "is not supported"
            )
        scaling = _read_scaling(full, max_pos, raw)
    else:
        theta, scaling = _read_rope(raw, max_pos, default_theta=defaults["rope_theta"])
        local_theta = float(raw.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
    if scaling.rope_type not in GEMMA3_ROPE_TYPES:
        raise ModelConfigError(
            f"rope_type={scaling.rope_type!r} on gemma3_text's global layers is not supported "
            f"(supported: {', '.join(GEMMA3_ROPE_TYPES)})"
        )
    return theta, scaling, local_theta


def _cap(raw: dict[str, Any], key: str, defaults: dict[str, Any]) -> float | None:
    value = raw.get(key, defaults[key])
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelConfigError(f"{key}={value!r} must be null or a positive number")
    return float(value)


def _layer_windows(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """The sliding window of every layer (0 = full attention) as transformers applies it:

    * ``llama``: none (transformers' Llama has no sliding window).
    * ``mistral``, ``mixtral``: ``sliding_window`` on every layer (``layer_types`` is ignored, as
      transformers' ``MistralModel`` does).
    * ``qwen3_moe``: only with ``use_sliding_window``, then every layer (default window 4096).
    * ``qwen2_moe``: only with ``use_sliding_window``; the layers ``layer_types`` marks
      ``sliding_attention``, else the even layers below ``max_window_layers`` (default 28).
    * ``qwen2`` / ``qwen3``: only with ``use_sliding_window``; the layers ``layer_types``
      marks ``sliding_attention``, else layers ``i >= max_window_layers``.
    * ``gpt_oss``: ``layer_types``, else the even layers (window default 128).
    * ``gemma2`` / ``gemma3_text``: ``layer_types``, else ``sliding_window_pattern``
      (every N-th layer global: 2 for Gemma 2, 6 for Gemma 3).
    Returns ``()`` when no layer has a window.
    """
    if model_type == "llama":
        return ()
    family = _GEMMA_DEFAULTS.get(model_type) or _MOE_DEFAULTS.get(model_type) or {}
    window = raw.get("sliding_window", family.get("sliding_window"))
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelConfigError(f"sliding_window={window!r} must be null or a positive integer")
    layer_types = raw.get("layer_types")
    if model_type in ("mistral", "mixtral", "qwen3_moe"):
        sliding = [True] * num_layers
    elif layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelConfigError(f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
        unknown = sorted({t for t in layer_types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise ModelConfigError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
        sliding = [t == "sliding_attention" for t in layer_types]
    elif model_type in GEMMA_MODEL_TYPES:
        pattern = raw.get("sliding_window_pattern", family["pattern"])
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ModelConfigError(f"sliding_window_pattern={pattern!r} must be a positive integer")
        sliding = [bool((i + 1) % pattern) for i in range(num_layers)]
    elif model_type == "gpt_oss":  # transformers' GptOssConfig: even layers sliding, odd ones full
        sliding = [bool((i + 1) % 2) for i in range(num_layers)]
    elif model_type == "qwen2_moe":  # transformers' Qwen2MoeConfig: even layers below max_window_layers
        below = int(raw.get("max_window_layers", family["max_window_layers"]))
        sliding = [bool((i + 1) % 2) and i < below for i in range(num_layers)]
    else:  # qwen2 / qwen3
        first = int(raw.get("max_window_layers", 28))
        sliding = [i >= first for i in range(num_layers)]
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()
