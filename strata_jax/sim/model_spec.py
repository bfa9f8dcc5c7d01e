"""``ModelSpec``: the shape of the simulated model (a ``ModelConfig``) and its tensor-parallel degree.

Built-ins: ``llama-3.1-8b``, ``qwen2.5-14b``, ``llama-3.1-70b-tp4``, ``gemma-3-27b`` (their
published ``config.json`` shapes; Gemma 3 27B: 62 layers, every 6th global, the others
with a 1,024-token sliding window), and two mixture-of-experts models, ``qwen3-30b-a3b``
(48 layers, 128 experts of width 768, top 8: 30.5B parameters, 3.35B active) and
``gpt-oss-120b-tp4`` (36 layers alternating a 128-token sliding window and full attention,
128 experts of width 2,880, top 4: 116.8B parameters, 5.13B active without the embedding
table, as OpenAI counts); or a path to any supported ``config.json`` (with ``--tp``).
``load_share(pages)`` is the share of a full page set a window-aware load of ``pages``
pages moves: every page of full-attention layers, and of a sliding-window layer only the
pages its window reaches back from where the reuse starts.  ``cached_share(lengths)`` is
the same for capacity: the bytes a window-aware tier holds per cached page, averaged over
cached sequences of those lengths (each keeps what a reuse at its end loads).
KV is bf16 (2 bytes) in L1, as on GPUs, unless ``kv_dtype_bytes`` says otherwise (the
engine's float32 KV on a CPU: ``bench twin``); ``tier_*`` figures are the L2/L3 format's
(``full``: bf16; ``fp8``/``int8``: 1 byte per value plus a float32 scale per page,
layer, K/V and KV head, ``strata_jax.cache.tier_format``).  Per-rank figures divide
heads and weights by ``tp``.

Mixture of experts (``ModelConfig.moe``: a sparse layer's MLP is ``num_experts`` routed experts,
``num_experts_per_tok`` of them per token, plus an optional shared expert) has three weight
counts, where a dense model has one:

* **held** (``total_params``, ``weight_bytes``): every expert; what HBM must hold, so what
  L1's capacity is left after;
* **multiplied per token** (``active_params``, ``body_params``): attention, the router, the
  ``k`` picked experts and the shared expert; what a token's FLOPs are (prefill and decode);
* **read per step** (``step_weight_bytes(tokens)``): a step over ``B`` tokens reads every
  non-expert weight and, per MoE layer, the union of the experts its tokens picked.  Its
  expectation under uniform, independent routing is ``E (1 - (1 - k / E) ** B)`` distinct
  experts per layer (``expected_experts``; a token picks ``k`` distinct experts, so a given
  expert escapes it with probability ``1 - k / E``): ``k`` at ``B = 1`` (the active
  weights), tending to ``E`` (all of them) as ``B`` grows.  Uniform routing is the upper
  bound of that expectation for independent tokens (``1 - (1 - p) ** B`` is concave in an
  expert's pick rate ``p``): skewed or correlated routing (a batch of tokens about the same
  document) reads fewer experts, so decode of a real MoE can be cheaper than this.

A dense model's three counts are one, and it prices exactly as before.  Tensor parallelism
splits every expert's columns over the ranks (no expert parallelism), so per-rank figures
divide expert weights by ``tp`` like the rest.  The built-ins leave out what
``ModelConfig.num_parameters`` does not count (GPT-OSS's o_proj and expert biases, its router
bias and attention sinks: 0.03% of its parameters).  GPT-OSS ships its experts in MXFP4; the
engine computes in its own dtype (bf16 on GPUs) and dequantizes a quantized checkpoint when
it loads one (as it does GGUF), so the spec prices those experts dequantized to bf16, 2
bytes per weight: 234 GB, which is why the built-in is tensor-parallel over 4 H200s (58 GB
of weights per rank; ``--tp 2`` fits too, with about 80K tokens of L1 per rank).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from strata_jax.models.config import ModelConfig, MoEConfig

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
    # Qwen/Qwen3-30B-A3B config.json: every layer MoE (decoder_sparse_step 1, no mlp_only_layers);
    # intermediate_size 6144 is the dense width no layer uses
    "qwen3-30b-a3b": (
        ModelConfig(
            "qwen3_moe",
            151936,
            2048,
            6144,
            48,
            32,
            4,
            128,
            max_position_embeddings=40960,
            rope_theta=1e6,
            qk_norm=True,
            moe=MoEConfig(num_experts=128, num_experts_per_tok=8, expert_intermediate_size=768, norm_topk_prob=True),
        ),
        1,
    ),
    # openai/gpt-oss-120b config.json: layer_types alternate sliding (128 tokens, even layers) and
    # full attention; 131,072 positions (yarn, factor 32 over 4,096; not priced); q/k/v/o biases, sinks; experts of
    # width intermediate_size, softmax over the top 4 (renormalized).  MXFP4 experts held at bf16 (module
    # docstring), hence tp 4.
    "gpt-oss-120b-tp4": (
        ModelConfig(
            "gpt_oss",
            201088,
            2880,
            2880,
            36,
            64,
            8,
            64,
            max_position_embeddings=131072,
            rope_theta=150000.0,
            attention_bias=True,
            layer_windows=tuple(128 if i % 2 == 0 else 0 for i in range(36)),
            moe=MoEConfig(
                num_experts=128,
                num_experts_per_tok=4,
                expert_intermediate_size=2880,
                norm_topk_prob=True,
                router_bias=True,
                expert_bias=True,
                swiglu_limit=7.0,
            ),
            attention_sinks=True,
            attention_out_bias=True,
        ),
        4,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    tp: int = 1
    kv_dtype_bytes: int = KV_DTYPE_BYTES  # L1's KV (and a full-width tier's): bf16 on GPUs, float32 on a CPU
    weight_dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, per rank."""
        c = self.config
        return c.num_layers * 2 * max(1, c.num_kv_heads // self.tp) * c.head_dim * self.kv_dtype_bytes

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
        return page_size * max(1, c.num_kv_heads // self.tp) * c.head_dim * self.kv_dtype_bytes

    @property
    def weight_bytes(self) -> float:
        """Every weight the device holds, per rank (every expert of a MoE model)."""
        return self.config.num_parameters * self.weight_dtype_bytes / self.tp

    @property
    def lm_head_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def body_params(self) -> int:
        """Parameters every token multiplies through (embedding lookup excluded, LM head
        separate): a MoE model's attention, router, shared expert and ``k`` picked experts."""
        c = self.config
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        return c.num_parameters - embed - self.inactive_params

    # -- mixture of experts (the module docstring: held, multiplied, read) ---------------------
    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the sparse block (``ModelConfig.layer_is_sparse``)."""
        return sum(self.config.layer_is_sparse)

    @property
    def expert_params(self) -> int:
        """One routed expert of one layer (gate, up and down: ``3 x hidden x expert width``, plus
        their biases for GPT-OSS); 0 if dense."""
        m = self.config.moe
        if m is None:
            return 0
        h, f = self.config.hidden_size, m.expert_intermediate_size
        return 3 * h * f + (2 * f + h if m.expert_bias else 0)

    @property
    def total_params(self) -> int:
        """Every parameter held (all experts, both embedding tables unless tied)."""
        return self.config.num_parameters

    @property
    def inactive_params(self) -> int:
        """Parameters a token does not multiply: the ``E - k`` experts per MoE layer it did not pick."""
        m = self.config.moe
        return 0 if m is None else self.moe_layers * (m.num_experts - m.num_experts_per_tok) * self.expert_params

    @property
    def active_params(self) -> int:
        """``total_params`` less the experts a token skips (embedding tables counted, as Qwen
        counts its "activated" parameters; OpenAI's count for GPT-OSS leaves the input
        embedding out)."""
        return self.total_params - self.inactive_params

    def expected_experts(self, tokens: int) -> float:
        """Expected distinct experts ``tokens`` tokens pick in one MoE layer under uniform,
        independent routing: ``E (1 - (1 - k / E) ** tokens)`` (``k`` for one token, up to ``E``)."""
        m = self.config.moe
        if m is None or tokens <= 0:
            return 0.0
        e, k = m.num_experts, m.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step over ``tokens`` tokens reads, per rank: ``weight_bytes`` for a
        dense model; for a MoE model every non-expert weight plus, per layer, the expected
        union of the experts its tokens picked (``expected_experts``)."""
        m = self.config.moe
        if m is None:
            return self.weight_bytes
        unread = self.moe_layers * (m.num_experts - self.expected_experts(tokens)) * self.expert_params
        return (self.total_params - unread) * self.weight_dtype_bytes / self.tp


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
