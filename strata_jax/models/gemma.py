"""Gemma 2 and Gemma 3 (text) decoders in Flax NNX over the paged KV pool.

What differs from the Llama family (``llama.py``, whose attention, linear layers,
embedding and layer scan this module reuses):

* RMSNorm scales by ``1 + weight`` (computed in float32, cast after the scale), and
  there are four norms per layer: ``input_layernorm`` before attention,
  ``post_attention_layernorm`` on the attention *output*, ``pre_feedforward_layernorm``
  before the MLP and ``post_feedforward_layernorm`` on its output.
* The embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the weights' dtype,
  as transformers does); the LM head is the (unscaled) embedding when tied.
* The MLP gate is GELU (tanh approximation); the softmax scale is
  ``query_pre_attn_scalar ** -0.5``; ``head_dim`` is independent of hidden / heads.
* Layers are local (sliding window) or global by ``ModelConfig.layer_windows``.  Gemma 3
  rotates local layers with their own rope base (``rope_local_theta``, unscaled) and
  global layers with ``rope_theta`` and its scaling; Gemma 3 normalises q and k per head.
* Gemma 2 soft-caps attention scores (``attn_logit_softcapping``) and final logits
  (``final_logit_softcapping``).

The window and the rope table of each layer are rows of ``[num_layers, ...]`` arrays
scanned beside the stacked weights, so local and global layers are one program.
Parameter names are Hugging Face's (``model.layers.N.pre_feedforward_layernorm.weight``...),
stacked as in ``llama.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.models.config import ModelConfig
from strata_jax.models.llama import (
    MLP,
    Attention,
    AttentionMetadata,
    Embedding,
    Linear,
    head_logits,
    layer_window_values,
    run_stacked_layers,
    stacked_layers,
)
from strata_jax.models.lora import LoraStep
from strata_jax.models.rope import inverse_frequencies, layer_inverse_frequencies


class GemmaRMSNorm(nnx.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back to ``x``'s dtype (transformers'
    Gemma2RMSNorm / Gemma3RMSNorm); the weight is stored as the checkpoint holds it."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = Attention(config, dtype, rngs, std, norm_cls=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = MLP(config, dtype, rngs, std)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def __call__(self, x, positions, inv_freq, kv_pool, layer, meta, window=None, lora=None):
        normed = self.input_layernorm(x)
        attn_out, kv_pool = self.self_attn(normed, positions, inv_freq, kv_pool, layer, meta, window, lora)
        x = x + self.post_attention_layernorm(attn_out)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lora))
        return x, kv_pool


class GemmaModel(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, std: float):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, rngs, std)
        self.layers = stacked_layers(config, dtype, rngs, std, GemmaDecoderLayer)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class GemmaForCausalLM(nnx.Module):
    """Gemma 2 / Gemma 3 text decoder plus LM head; same interface as ``LlamaForCausalLM``
    (``__call__`` -> final hidden states and the pool; ``logits(hidden)`` -> float32)."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs, init_std: float = 0.02):
        if not config.is_gemma:
            raise ValueError(f"GemmaForCausalLM needs a Gemma config, got model_type={config.model_type!r}")
        self.config = config
        self.model = GemmaModel(config, dtype, rngs, init_std)
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
        config = self.config
        x = self.model.embed_tokens(input_ids)
        x = x * jnp.asarray(config.hidden_size**0.5, jnp.float32).astype(x.dtype)
        per_layer: dict = layer_window_values(config)
        if lora is not None:
            per_layer |= lora.per_layer()
        table = layer_inverse_frequencies(config)  # [L, D/2] when local and global rope bases differ
        if table is not None:
            per_layer["inv_freq"] = table
        shared_freq = jnp.asarray(inverse_frequencies(config))  # a trace-time constant

        def one_layer(layer, carry, values):
            x, kv_pool = carry
            inv_freq = values["inv_freq"] if "inv_freq" in values else shared_freq
            layer_lora = lora.for_layer(values) if lora is not None else None
            window = values.get("window")
            return layer(x, positions, jnp.asarray(inv_freq), kv_pool, values["layer"], meta, window, layer_lora)

        x, kv_pool = run_stacked_layers(
            self.model.layers, (x, kv_pool), per_layer, one_layer, scan_layers=scan_layers, layer_states=layer_states
        )
        return self.model.norm(x), kv_pool

    def logits(self, hidden: jax.Array) -> jax.Array:
        logits = head_logits(self.lm_head, self.model.embed_tokens, hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
