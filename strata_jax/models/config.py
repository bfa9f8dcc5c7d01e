"""Model configuration read from a Hugging Face ``config.json``.

Supported: ``llama`` (rope scaling ``llama3`` / ``linear`` / none), ``mistral``,
``qwen2`` (qkv bias), ``qwen3`` (per-head q/k RMSNorm); GQA; explicit ``head_dim``;
tied or untied embeddings.  Both the transformers-4 (``rope_theta`` +
``rope_scaling``) and transformers-5 (``rope_parameters``) spellings are read.
Anything this runtime cannot reproduce exactly raises ``ModelConfigError`` naming
the field and its value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class ModelConfigError(ValueError):
    """A config.json this runtime cannot serve faithfully."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def max_context_tokens(self) -> int:
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=True is not supported")
        hidden = _required_int(raw, "hidden_size")
        heads = _required_int(raw, "num_attention_heads")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        max_pos = int(raw.get("max_position_embeddings", 4096))
        theta, scaling = _read_rope(raw)
        max_pos = min(max_pos, _sliding_window_limit(raw, model_type, max_pos))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_layers=_required_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
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


def _required_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"config field {key}={value!r} must be a positive integer")
    return value


def _read_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling_raw: dict[str, Any] | None = params
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling_raw = raw.get("rope_scaling")
    if not scaling_raw:
        return theta, RopeScaling()
    rope_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope_scaling.rope_type={rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    factor = float(scaling_raw.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ModelConfigError(f"rope_scaling.factor={factor!r} must be a positive number")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling_raw.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window_limit(raw: dict[str, Any], model_type: str, max_pos: int) -> int:
    """Sliding-window attention is honoured by never letting a context exceed the window.

    Within the window, sliding and full attention are identical, so capping the
    served context length keeps outputs exact.
    """
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return max_pos
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and layer_types and all(t == "full_attention" for t in layer_types):
        return max_pos
    if window is None:
        return max_pos
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelConfigError(f"sliding_window={window!r} must be null or a positive integer")
    return window
