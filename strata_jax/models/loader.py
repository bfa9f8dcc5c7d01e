"""One entry point to get a servable model: ``load_model("tiny" | HF folder | FILE.gguf | orbax checkpoint)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax.numpy as jnp

from strata_jax.models.checkpoint import CONFIG_FILE, restore_checkpoint
from strata_jax.models.config import ModelConfig, ModelConfigError
from strata_jax.models.generation_config import GenerationDefaults
from strata_jax.models.weights import CausalLM, load_hf_weights, random_model
from strata_jax.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TINY_SEED = 20260501
GGUF_SUFFIX = ".gguf"


def is_gguf_path(spec: str) -> bool:
    return spec.lower().endswith(GGUF_SUFFIX)


def tiny_config() -> ModelConfig:
    """The embedded default: a ~11M-parameter Llama-architecture model over bytes."""
    return ModelConfig(
        model_type="llama",
        vocab_size=ByteTokenizer.vocab_size,  # bytes + BOS + EOS: every id decodes
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
    )


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None  # None when the folder has no tokenizer.json (token ids only)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids) | set(self.generation.eos_token_ids)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))


def load_model(spec: str, *, dtype: jnp.dtype = jnp.float32, show_progress: bool = True) -> LoadedModel:
    """``"tiny"``: embedded random model; a folder with config.json: HF checkpoint; a ``.gguf``
    file: llama.cpp model (dequantized to ``dtype``; needs the ``gguf`` extra); a folder with
    strata_model_config.json: orbax checkpoint saved by ``save_checkpoint``."""
    if spec == "tiny":
        config = tiny_config()
        return LoadedModel("tiny", config, random_model(config, dtype=dtype, seed=TINY_SEED), ByteTokenizer())
    if is_gguf_path(spec):
        from strata_jax.models.gguf_model import load_gguf

        config, model, tokenizer, generation = load_gguf(spec, dtype=dtype, show_progress=show_progress)
        return LoadedModel(Path(spec).stem, config, model, tokenizer, generation)
    folder = Path(spec)
    if not folder.is_dir():
        raise ModelConfigError(f"model {spec!r} is neither 'tiny' nor an existing directory (nor a .gguf file)")
    tokenizer = HFTokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    generation = GenerationDefaults.from_folder(folder)
    if (folder / CONFIG_FILE).is_file():
        model = restore_checkpoint(folder, dtype=dtype)
        return LoadedModel(folder.name, model.config, model, tokenizer or ByteTokenizer(), generation)
    config = ModelConfig.from_pretrained(folder)
    model = load_hf_weights(folder, config, dtype=dtype, show_progress=show_progress)
    return LoadedModel(folder.name, config, model, tokenizer, generation)
