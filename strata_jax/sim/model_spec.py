"""``ModelSpec``: the shape of the simulated model (a ``ModelConfig``) and its tensor-parallel degree.

Built-ins: ``llama-3.1-8b``, ``qwen2.5-14b``, ``llama-3.1-70b-tp4``, ``gemma-3-27b`` (their
published ``config.json`` shapes; Gemma 3 27B: 62 layers, every 6th global, the others
with a 1,024-token sliding window); or a path to any supported ``config.json`` (with ``--tp``).
``load_share(pages)`` is the share of a full page set a window-aware load of ``pages``
pages moves: every page of full-attention layers, and of a sliding-window layer only the
pages its window reaches back from where the reuse starts.  ``cached_share(lengths)`` is
the same for capacity: the bytes a window-aware tier holds per cached page, averaged over
cached sequences of those lengths (each keeps what a reuse at its end loads).
KV is bf16 (2 bytes) in L1, as on GPUs; ``tier_*`` figures are the L2/L3 format's
(``full``: bf16; ``fp8``/``int8``: 1 byte per value plus a float32 scale per page,
layer, K/V and KV head, ``strata_jax.cache.tier_format``).  Per-rank figures divide
heads and weights by ``tp``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from strata_jax.models.config import ModelConfig

KV_DTYPE_BYTES = 2

BUILTIN_MODELS: dict[str, tuple[ModelConfig, int]] = {
    "llama-3.1-8b": (ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, max_position_embeddings=131072), 1),
    "qwen2.5-14b": (
        ModelConfig("qwen2", 152064, 5120, 13824, 48, 40, 8, 128, max_position_embeddings=131072, attention_bias=True),
        1,
    ),
    "llama-3.1-70b-tp4": (ModelConfig("llama", 128256, 8192, 28672, 80, 64, 8, 128, max_position_embeddings=131072), 4),
    "gemma-3-27b": (
        ModelConfig(
            "gemma3_text",
            262208,
            5376,
            21504,
            62,
            32,
            16,
            128,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            qk_norm=True,
            layer_windows=tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(62)),
            rope_theta=1e6,
            rope_local_theta=1e4,
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=168.0,
        ),
        1,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    tp: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, per rank."""
        c = self.config
        return c.num_layers * 2 * max(1, c.num_kv_heads // self.tp) * c.head_dim * KV_DTYPE_BYTES

    def load_share(self, num_pages: int, page_size: int) -> float:
        """Share of ``num_pages`` full pages (all layers) a window-aware load moves.

        A sliding-window layer needs the pages covering its last ``window`` positions
        before the reuse point: ``ceil(window / page_size) + 1`` pages (the window may
        start mid-page).  1.0 for a model without windows, or for a load within them.
        """
        if num_pages <= 0:
            return 0.0
        windows = self.config.layer_windows or (0,) * self.config.num_layers
        pages = sum(num_pages if w <= 0 else min(num_pages, -(-w // page_size) + 1) for w in windows)
        return pages / (num_pages * len(windows))

    def cached_share(self, sequence_tokens: Sequence[int], page_size: int) -> float:
        """Bytes per cached page, as a share of a full page, in a window-aware tier holding
        sequences of ``sequence_tokens`` tokens: each keeps every full page's global layers
        and, of each windowed layer, the pages a reuse at its end needs (``load_share`` of its
        pages); averaged over all their pages (1.0 for a model without windows, or when no
        sequence fills a page)."""
        pages = [n // page_size for n in sequence_tokens if n >= page_size]
        if not pages:
            return 1.0
        return sum(n * self.load_share(n, page_size) for n in pages) / sum(pages)

    def attention_pairs(self, new_tokens: int, context: int) -> float:
        """Query-key pairs per layer (averaged over layers) for ``new_tokens`` on ``context``
        cached ones: ``n (ctx + n / 2)`` for a full-attention layer; a windowed layer's token
        at position p sees ``min(p + 1, window)`` keys."""
        full = new_tokens * (context + new_tokens / 2.0)
        windows = self.config.layer_windows
        if not windows:
            return full

        def windowed(w: int) -> float:
            growing = max(0, min(w - context, new_tokens))  # tokens that still see every earlier key
            return growing * context + growing * (growing + 1) / 2.0 + (new_tokens - growing) * w

        return sum(full if w <= 0 else windowed(w) for w in windows) / len(windows)

    def page_bytes(self, page_size: int) -> int:
        return self.kv_bytes_per_token * page_size

    def tier_page_bytes(self, page_size: int, tier_format: str = "full") -> int:
        """One page in L2 / on the link / in L3 in ``tier_format``, per rank (values + scales)."""
        if tier_format == "full":
            return self.page_bytes(page_size)
        if tier_format not in ("fp8", "int8"):
            raise ValueError(f"tier format must be full, fp8 or int8, got {tier_format!r}")
        c = self.config
        heads = max(1, c.num_kv_heads // self.tp)
        return c.num_layers * 2 * heads * (page_size * c.head_dim * 1 + 4)

    def copy_bytes(self, page_size: int) -> int:
        """One layer's K (or V) of one page, per rank: the unit of the naive copy path."""
        c = self.config
        return page_size * max(1, c.num_kv_heads // self.tp) * c.head_dim * KV_DTYPE_BYTES

    @property
    def weight_bytes(self) -> float:
        return self.config.num_parameters * 2 / self.tp

    @property
    def lm_head_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def body_params(self) -> int:
        """Parameters every token multiplies through (embedding lookup excluded, LM head separate)."""
        c = self.config
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        return c.num_parameters - embed


def load_model_spec(name_or_path: str, tp: int | None = None) -> ModelSpec:
    if name_or_path in BUILTIN_MODELS:
        config, default_tp = BUILTIN_MODELS[name_or_path]
        return ModelSpec(name_or_path, config, tp or default_tp)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {name_or_path!r}: not a built-in ({', '.join(BUILTIN_MODELS)}) nor a config.json path"
        )
    try:
        config = ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return ModelSpec(path.parent.name or str(path), config, tp or 1)
