"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in Flax NNX over a paged KV pool.

One forward serves a ragged batch: tokens of all sequences are packed into one
``[T]`` axis; ``AttentionMetadata`` says which sequence owns which tokens, where each
token's K/V goes (``slot_mapping``) and which pages each sequence reads
(``page_table``).  The KV pool is layer-first (see ``pallas_kernels.layout``) and is
threaded through the layers functionally so a jitted caller can donate it.

Layers are *stacked*: ``model.layers`` is one ``DecoderLayer`` whose every parameter
has a leading ``[num_layers]`` axis, and the forward runs it under ``jax.lax.scan``
(one traced layer body, so compile time does not grow with depth).  The layer index
reaching ``write_kv`` and attention is then a traced int32 scalar.  ``scan_layers=False``
runs the same stacked parameters as an unrolled Python loop (static layer ints), kept
for side-by-side step-time comparisons.  What differs between layers besides their
weights (the sliding window of Mistral / Qwen2 configs, Gemma's local/global layers and
their rope bases) is a per-layer *value* scanned beside the weights
(``run_stacked_layers``), never a second program.  Gemma 2/3 live in ``gemma.py`` and
share this module's attention, linear layers and layer scan.

Parameter paths mirror Hugging Face names with the layer number moved into the
stacked axis: ``model.layers.{i}.self_attn.q_proj.weight [out, in]`` is
``model.layers.self_attn.q_proj.kernel[i] [in, out]`` (linear kernels are stored
transposed); norms, biases, ``model.embed_tokens.weight``, ``model.norm.weight`` and
``lm_head.weight`` (-> ``lm_head.kernel``, transposed) keep their names.  See
``docs/runtime.md`` for the full table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from strata_jax.models.config import ModelConfig
from strata_jax.models.lora import LayerLora, LoraStep, project
from strata_jax.models.rope import apply_rope, inverse_frequencies, rope_application


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch layout (a pytree of int32 arrays; shapes fixed by the bucket).

    slot_mapping: [T]     flat pool slot of each new token (padding: num_slots, dropped)
    page_table:   [B, W]  page ids of each sequence in order
    seq_lens:     [B]     KV length of each sequence after this step (0 = padding)
    query_start:  [B + 1] token offsets of each sequence's new tokens

    A pool with layer groups (``pallas_kernels.layout.GroupedPoolLayout``, one layer of
    rows) adds ``layer_page_base [L]`` and ``layer_page_count [L]``: layer ``l`` reads and
    writes its pages at rows ``layer_page_base[l] + page`` (slots shifted by as many
    pages), so the kernels see a one-layer pool; a page id past the layer's count is
    clipped on reads and a slot past it (or negative) dropped on writes, never another
    layer's rows.  Its padding slot is the whole pool's slot count, out of range after any
    shift.  Its local (sliding-window) layers read ``local_page_table`` and write
    ``local_slot_mapping`` (local page ids) when given, the global ones otherwise.
    """

    slot_mapping: jax.Array
    page_table: jax.Array
    seq_lens: jax.Array
    query_start: jax.Array
    layer_page_base: jax.Array | None = None
    layer_page_count: jax.Array | None = None
    local_page_table: jax.Array | None = None
    local_slot_mapping: jax.Array | None = None

    def for_layer(
        self, kv_pool: jax.Array, layer: int | jax.Array, window: int | jax.Array | None
    ) -> tuple[jax.Array, jax.Array, int | jax.Array]:
        """(page table, slot mapping, pool layer index) that layer ``layer`` (sliding window
        ``window``: > 0 for a local layer) uses in ``kv_pool``."""
        if self.layer_page_base is None:
            return self.page_table, self.slot_mapping, layer
        table, slots = self.page_table, self.slot_mapping
        if self.local_page_table is not None and window is not None:
            local = jnp.asarray(window) > 0
            assert self.local_slot_mapping is not None  # given together with local_page_table
            table = jnp.where(local, self.local_page_table, table)
            slots = jnp.where(local, self.local_slot_mapping, slots)
        assert self.layer_page_count is not None  # given together with layer_page_base
        base, count = self.layer_page_base[layer], self.layer_page_count[layer]
        page_size, total_slots = kv_pool.shape[3], kv_pool.shape[2] * kv_pool.shape[3]
        inside = (slots >= 0) & (slots < count * page_size)  # padding stays out, no overflow
        shifted = jnp.where(inside, slots + base * page_size, total_slots)
        return jnp.clip(table, 0, count - 1) + base, shifted, 0


class RMSNorm(nnx.Module):
    """``weight * x / rms(x)``, normalized in float32.  Llama's casts back to the model's dtype
    before the scale; ``scale_in_float32`` (GPT-OSS, whose norms transformers keeps in float32)
    scales in float32 and casts after, as ``GptOssRMSNorm`` does."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, *, scale_in_float32: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        self.kernel = nnx.Param((jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * std).astype(dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        y = kernel.matmul(x) if isinstance(kernel, LayerKernels) else x @ kernel
        return y + self.bias[...] if self.bias is not None else y


@dataclass(frozen=True)
class LayerKernels:
    """A linear kernel held per layer (``split_layer_weights``) inside the layer scan:
    ``layer`` (a traced int32) picks which of ``per_layer`` multiplies.

    The product runs inside a ``jax.lax.switch`` whose branch ``i`` multiplies by
    ``per_layer[i]`` itself, so the kernel is read where it lies.  Slicing a stacked
    ``[L, in, out]`` kernel instead copies the slice on XLA:CPU before the matmul, every
    layer of every step (``run_stacked_layers``).
    """

    layer: jax.Array
    per_layer: tuple[jax.Array, ...]

    def matmul(self, x: jax.Array) -> jax.Array:
        branches = [partial(_matmul_by, i) for i in range(len(self.per_layer))]
        return jax.lax.switch(self.layer, branches, x, self.per_layer)


def _matmul_by(index: int, x: jax.Array, kernels: tuple[jax.Array, ...]) -> jax.Array:
    return x @ kernels[index]


class Attention(nnx.Module):
    """Self-attention over the paged pool.  ``norm_cls`` builds the q/k norms (``qk_norm``);
    the softmax scale and score soft-cap come from the config (Gemma: ``query_pre_attn_scalar``,
    ``attn_logit_softcapping``); GPT-OSS adds per-head sinks and an o_proj bias."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float, *, norm_cls: type = RMSNorm):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sm_scale, self.soft_cap = c.attention_scale, c.attn_logit_softcapping
        self.rope = rope_application(c)  # static: the cos/sin factor, dynamic NTK's parameters
        self.q_proj = Linear(
            c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias, dtype=dtype, rngs=rngs, std=std
        )
        self.k_proj = Linear(
            c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias, dtype=dtype, rngs=rngs, std=std
        )
        self.v_proj = Linear(
            c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias, dtype=dtype, rngs=rngs, std=std
        )
        self.o_proj = Linear(
            c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_out_bias, dtype=dtype, rngs=rngs, std=std
        )
        # GPT-OSS: one learned sink logit per query head (``pallas_kernels.reference.normalize_with_sinks``)
        self.sinks = nnx.Param(jnp.zeros((c.num_heads,), dtype)) if c.attention_sinks else None
        self.q_norm = norm_cls(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = norm_cls(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        inv_freq: jax.Array,
        kv_pool: jax.Array,
        layer: int | jax.Array,
        meta: AttentionMetadata,
        window: int | jax.Array | None = None,
        lora: LayerLora | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """``window``: this layer's sliding window (None: the model has none; a traced
        int32 under the layer scan, 0 = full attention).  ``lora``: the step's adapters."""
        tokens = x.shape[0]
        q = project(self.q_proj, "q_proj", x, lora).reshape(tokens, self.num_heads, self.head_dim)
        k = project(self.k_proj, "k_proj", x, lora).reshape(tokens, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, "v_proj", x, lora).reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (config.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq, self.rope), apply_rope(k, positions, inv_freq, self.rope)
        page_table, slot_mapping, pool_layer = meta.for_layer(kv_pool, layer, window)
        kv_pool = pallas_kernels.write_kv(kv_pool, pool_layer, k, v, slot_mapping)
        decode_only = tokens == meta.page_table.shape[0]  # the runner's decode buckets: one token per sequence
        out, kv_pool = pallas_kernels.ragged_paged_attention_pool(
            q,
            kv_pool,
            pool_layer,
            page_table,
            meta.seq_lens,
            meta.query_start,
            sm_scale=self.sm_scale,
            soft_cap=self.soft_cap,
            max_q_len=1 if decode_only else None,
            sliding_window=window,  # None (no window): the plain causal call
            sinks=None if self.sinks is None else self.sinks[...].astype(jnp.float32),
        )
        return project(self.o_proj, "o_proj", out.reshape(tokens, self.num_heads * self.head_dim), lora), kv_pool


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The gate activation a config names (``ModelConfig.hidden_act``)."""
    if name == "silu":
        return jax.nn.silu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unknown activation {name!r}")


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SiLU for Llama, GELU-tanh for Gemma);
    ``intermediate_size`` overrides the config's (qwen2_moe's shared expert)."""

    def __init__(
        self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float, *, intermediate_size: int | None = None
    ):
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.act_name = config.hidden_act
        self.gate_proj = Linear(h, i, bias=False, dtype=dtype, rngs=rngs, std=std)
        self.up_proj = Linear(h, i, bias=False, dtype=dtype, rngs=rngs, std=std)
        self.down_proj = Linear(i, h, bias=False, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x: jax.Array, lora: LayerLora | None = None) -> jax.Array:
        gate, up = project(self.gate_proj, "gate_proj", x, lora), project(self.up_proj, "up_proj", x, lora)
        return project(self.down_proj, "down_proj", activation(self.act_name)(gate) * up, lora)


def make_mlp(config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float, *, sparse: bool) -> nnx.Module:
    """A layer's MLP: the mixture of experts (``sparse``) or the dense gated MLP."""
    if not sparse:
        return MLP(config, dtype, rngs, std)
    from strata_jax.models.moe import MoEBlock  # moe.py imports this module

    return MoEBlock(config, dtype, rngs, std)


class DecoderLayer(nnx.Module):
    """Attention and MLP with their norms.  In a stack mixing dense and sparse MLP layers
    (``ModelConfig.mixed_mlp_layers``) the layer holds no MLP: the model keeps each kind in its
    own stack (``MLPLayer``) and the forward passes the layer's one in (``mixed_mlp``)."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        f32 = config.norm_scale_in_float32
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, scale_in_float32=f32)
        self.self_attn = Attention(config, dtype, rngs, std)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, scale_in_float32=f32)
        mixed, sparse = config.mixed_mlp_layers, config.moe is not None
        self.mlp = None if mixed else make_mlp(config, dtype, rngs, std, sparse=sparse)

    def __call__(self, x, positions, inv_freq, kv_pool, layer, meta, window=None, mlp=None, lora=None):
        normed = self.input_layernorm(x)
        attn_out, kv_pool = self.self_attn(normed, positions, inv_freq, kv_pool, layer, meta, window, lora)
        x = x + attn_out
        normed = self.post_attention_layernorm(x)
        # LoRA reaches dense MLPs only (adapters on a mixture of experts' MLP are refused at load)
        x = x + (self.mlp(normed, lora) if isinstance(self.mlp, MLP) and mlp is None else (mlp or self.mlp)(normed))
        return x, kv_pool


class MLPLayer(nnx.Module):
    """One layer's MLP of one kind, stacked over the layers of that kind in a mixed stack
    (``DecoderModel.dense_layers`` / ``moe_layers``); its parameters keep the path
    ``mlp.<...>`` so checkpoint names and the tensor-parallel rules read as for a layer."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float, *, sparse: bool):
        self.mlp = make_mlp(config, dtype, rngs, std, sparse=sparse)


def mixed_layer_values(config: ModelConfig) -> dict[str, np.ndarray]:
    """``run_stacked_layers``' per-layer values of a mixed stack: ``mlp_sparse`` (1 where the
    layer's MLP is the mixture of experts) and ``mlp_row`` (its row in that kind's stack);
    nothing for a uniform stack."""
    if not config.mixed_mlp_layers:
        return {}
    return {
        "mlp_sparse": np.asarray(config.layer_is_sparse, np.int32),
        "mlp_row": np.asarray(config.mlp_stack_rows, np.int32),
    }


def _stack_row(stack: nnx.Module, row: int | jax.Array) -> MLPLayer:
    """Row ``row`` of a stack of ``MLPLayer`` (``stacked_layers``)."""
    graphdef, state = nnx.split(stack)
    return cast(MLPLayer, nnx.merge(graphdef, jax.tree.map(lambda a: a[row], state)))


def mixed_mlp(dense: nnx.Module, sparse: nnx.Module, is_sparse, row, x: jax.Array) -> jax.Array:
    """Layer ``row`` of the ``sparse`` (``MLPLayer`` stack) or ``dense`` stack on ``x``: a static
    pick when the layer is unrolled, else a ``jax.lax.cond`` that runs only the layer's kind."""
    if isinstance(is_sparse, int | np.integer):
        return _stack_row(sparse if is_sparse else dense, row).mlp(x)
    return jax.lax.cond(
        is_sparse > 0, lambda x: _stack_row(sparse, row).mlp(x), lambda x: _stack_row(dense, row).mlp(x), x
    )


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (vocab, dim), jnp.float32) * std).astype(dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


def stacked_layers(
    config: ModelConfig,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    std: float,
    layer_cls: Callable[..., nnx.Module] = DecoderLayer,
    count: int | None = None,
) -> nnx.Module:
    """One ``layer_cls`` (default ``DecoderLayer``) whose parameters carry a leading
    ``[count]`` axis (default ``num_layers``).

    Layer ``i`` draws the same keys it would have drawn as the ``i``-th of a list of
    layers built from ``rngs`` (so a seed gives the same weights as the unstacked model
    always did), and ``rngs`` comes out advanced past all of them.
    """
    count = config.num_layers if count is None else count
    stream = rngs.params
    base_key, start = stream.key[...], stream.count[...]
    abstract = nnx.eval_shape(lambda: layer_cls(config, dtype, nnx.Rngs(params=0), std))
    graphdef = nnx.graphdef(abstract)
    from strata_jax.models.moe import ExpertLinear  # moe.py imports this module

    # one key per Linear / ExpertLinear
    draws_per_layer = sum(isinstance(node, Linear | ExpertLinear) for _, node in nnx.iter_graph(abstract))

    def one(layer_idx):
        layer_rngs = nnx.Rngs(params=0)
        layer_rngs.params.key[...] = base_key
        layer_rngs.params.count[...] = start + layer_idx * draws_per_layer
        return nnx.state(layer_cls(config, dtype, layer_rngs, std))

    state = jax.vmap(one)(jnp.arange(count, dtype=jnp.uint32))
    stream.count[...] = start + count * draws_per_layer
    return nnx.merge(graphdef, state)


class DecoderModel(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, rngs, std)
        self.layers = stacked_layers(config, dtype, rngs, std)
        # a mixed stack: each MLP kind stacked over its own layers (``mixed_mlp``)
        if config.mixed_mlp_layers:
            sparse = sum(config.layer_is_sparse)
            dense_cls, sparse_cls = partial(MLPLayer, sparse=False), partial(MLPLayer, sparse=True)
            dense = config.num_layers - sparse
            self.dense_layers: nnx.Module | None = stacked_layers(config, dtype, rngs, std, dense_cls, dense)
            self.moe_layers: nnx.Module | None = stacked_layers(config, dtype, rngs, std, sparse_cls, sparse)
        else:
            self.dense_layers = self.moe_layers = None
        f32 = config.norm_scale_in_float32
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, scale_in_float32=f32)


class LlamaForCausalLM(nnx.Module):
    """The whole decoder plus LM head; ``__call__`` returns final hidden states and the pool."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs, init_std: float = 0.02):
        self.config = config
        self.model = DecoderModel(config, dtype, rngs, init_std)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=init_std)
        )

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_pool: jax.Array,
        meta: AttentionMetadata,
        *,
        scan_layers: bool = True,
        layer_states: Sequence[nnx.State] | None = None,
        lora: LoraStep | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """``scan_layers``: run the stacked layers under ``jax.lax.scan`` (default) or as an
        unrolled Python loop (XLA then sees one copy per layer), over ``layer_states``
        when given (``run_stacked_layers``).  ``lora``: the step's adapters (``models/lora.py``)."""
        x = self.model.embed_tokens(input_ids)
        inv_freq = jnp.asarray(inverse_frequencies(self.config))  # a trace-time constant

        def one_layer(layer, carry, values):
            x, kv_pool = carry
            mlp = None
            if "mlp_sparse" in values:
                dense, sparse = self.model.dense_layers, self.model.moe_layers
                mlp = partial(mixed_mlp, dense, sparse, values["mlp_sparse"], values["mlp_row"])
            layer_lora = lora.for_layer(values) if lora is not None else None
            return layer(
                x, positions, inv_freq, kv_pool, values["layer"], meta, values.get("window"), mlp=mlp, lora=layer_lora
            )

        per_layer: dict = layer_window_values(self.config) | mixed_layer_values(self.config)
        if lora is not None:
            per_layer |= lora.per_layer()
        x, kv_pool = run_stacked_layers(
            self.model.layers, (x, kv_pool), per_layer, one_layer, scan_layers=scan_layers, layer_states=layer_states
        )
        return self.model.norm(x), kv_pool

    def logits(self, hidden: jax.Array) -> jax.Array:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden)


def head_logits(lm_head: Linear | None, embed_tokens: Embedding, hidden: jax.Array) -> jax.Array:
    """float32 logits of ``hidden`` through ``lm_head``, or the embedding when tied (None)."""
    if lm_head is None:
        return (hidden @ embed_tokens.weight[...].T).astype(jnp.float32)
    return lm_head(hidden).astype(jnp.float32)


def layer_window_values(config: ModelConfig) -> dict[str, np.ndarray]:
    """``run_stacked_layers``' per-layer values for the attention window: ``{"window":
    int32[num_layers]}`` (0 = full attention), or nothing for a model without windows (its
    layers then trace the plain causal call)."""
    return {"window": np.asarray(config.layer_windows, np.int32)} if config.has_sliding_window else {}


def run_stacked_layers(
    layers: nnx.Module,
    carry: tuple,
    per_layer: dict[str, np.ndarray],
    body: Callable[[nnx.Module, tuple, dict], tuple],
    *,
    scan_layers: bool,
    layer_states: Sequence[nnx.State] | None = None,
) -> tuple:
    """Run ``body(layer, carry, values) -> carry`` over the stacked ``layers``.

    ``values`` holds ``"layer"`` (the layer index) and row ``i`` of every ``per_layer``
    array (``[num_layers, ...]``: a window, a rope table).  Under ``jax.lax.scan``
    (``scan_layers``) they are traced values, so layers that differ only in such values
    are one program; unrolled, they are static per layer.

    ``layer_states``: each layer's weights as its own arrays (``split_layer_weights``),
    used instead of slices of the stacked ones (``layers`` then only lends its
    structure).  On XLA:CPU a slice of a stacked weight feeding a matmul is copied first,
    every step (under scan as a dynamic slice, unrolled as a static one): a decode step,
    which reads each weight once, then moves the weights three times.  Unrolled, layer
    ``i`` uses its arrays directly; under scan the linear kernels become
    ``LayerKernels`` (the matmul picks layer ``i``'s kernel by a switch, no copy) and the
    small vectors (norms, biases) are stacked once per step and sliced.
    """
    graphdef, stacked = nnx.split(layers)
    num_layers = len(layer_states) if layer_states is not None else jax.tree.leaves(stacked)[0].shape[0]
    if scan_layers:
        xs = {name: jnp.asarray(v) for name, v in per_layer.items()}
        xs["layer"] = jnp.arange(num_layers, dtype=jnp.int32)
        if layer_states is not None:
            stacked = jax.tree.map(
                lambda *a: jnp.zeros((num_layers,), jnp.int8) if a[0].ndim >= 2 else jnp.stack(a), *layer_states
            )

        def step(carry, layer_xs):
            layer_state, values = layer_xs
            if layer_states is not None:  # kernels (2-D and up) picked in place, vectors sliced
                layer_state = jax.tree.map(
                    lambda sliced, *a: LayerKernels(values["layer"], a) if a[0].ndim >= 2 else sliced,
                    layer_state,
                    *layer_states,
                )
            return body(nnx.merge(graphdef, layer_state), carry, values), None

        # The pool is a scan carry: each iteration updates it in place (donated by the runner).
        carry, _ = jax.lax.scan(step, carry, (stacked, xs))
        return carry
    for i in range(num_layers):
        values = {name: v[i] for name, v in per_layer.items()}
        values["layer"] = i
        state = layer_states[i] if layer_states is not None else jax.tree.map(lambda a, i=i: a[i], stacked)
        carry = body(nnx.merge(graphdef, state), carry, values)
    return carry


def split_layer_weights(state: nnx.State, shardings: nnx.State | None = None) -> tuple[nnx.State, list[nnx.State]]:
    """A model state's stacked layer weights (``state["model"]["layers"]``, ``[L, ...]``)
    as ``L`` per-layer states of their own arrays (``run_stacked_layers(layer_states=)``),
    and the state with 0-d placeholders where the stacked arrays were (the stacked copies
    are dropped; ``state`` is changed in place).  ``shardings``: the stacked state's shardings (tensor parallel); each
    layer's arrays keep them minus the layer axis."""
    layers = state["model"]["layers"]
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    if shardings is None:
        per_layer = [jax.tree.map(lambda a, i=i: jnp.array(a[i]), layers) for i in range(num_layers)]
    else:
        from jax.sharding import NamedSharding, PartitionSpec

        def one(a, sh, i):
            target = NamedSharding(sh.mesh, PartitionSpec(*sh.spec[1:]))
            return jax.jit(lambda x: x[i], out_shardings=target)(a)

        per_layer = [
            jax.tree.map(lambda a, sh, i=i: one(a, sh, i), layers, shardings["model"]["layers"])
            for i in range(num_layers)
        ]
    state["model"]["layers"] = jax.tree.map(lambda a: jnp.zeros((), a.dtype), layers)
    return state, per_layer


def stack_layer_weights(state: nnx.State, layer_states: Sequence[nnx.State]) -> nnx.State:
    """The inverse of ``split_layer_weights``: a state with stacked layer arrays (copies)."""
    from copy import copy

    stacked = jax.tree.map(lambda *arrays: jnp.stack(arrays), *layer_states)
    out = copy(state)
    out["model"] = copy(state["model"])
    out["model"]["layers"] = stacked
    return out
