"""Building models: random (embedded tiny default), from HF safetensors, from orbax checkpoints."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from strata_jax.models.config import ModelConfig, RopeScaling
from strata_jax.models.llama import LlamaForCausalLM
from strata_jax.models.safetensors_io import checkpoint_files, iter_tensors


class WeightLoadError(ValueError):
    """Weights that do not fit the model config (missing, unexpected or misshapen tensors)."""


# Tensors some checkpoints carry that the model recomputes instead.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
PROGRESS_BAR_MIN_BYTES = 64 * 1024 * 1024


def random_model(config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(params=seed))


def _hf_name_to_path(name: str) -> tuple[tuple[str | int, ...], bool]:
    """Map a HF tensor name to (our state path, transpose?)."""
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in name.split(".")]
    is_linear = parts[-1] == "weight" and len(parts) >= 2 and str(parts[-2]).endswith("_proj")
    if is_linear or parts[:1] == ["lm_head"]:
        return tuple(parts[:-1]) + ("kernel",), True
    return tuple(parts), False


def load_hf_weights(
    folder: str | Path, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, show_progress: bool = True
) -> LlamaForCausalLM:
    """Load HF safetensors (single or sharded) into a model, casting to ``dtype``.

    Raises ``WeightLoadError`` naming the tensor for anything missing, unexpected or
    of the wrong shape.
    """
    abstract = nnx.eval_shape(lambda: random_model(config, dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}
    files = checkpoint_files(folder)
    tensors = list(iter_tensors(files))
    total = sum(st.nbytes(name) for name, st in tensors)
    loaded: dict[tuple, jax.Array] = {}
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"loading {Path(folder).name}",
        disable=not show_progress or total < PROGRESS_BAR_MIN_BYTES,
    )
    with bar:
        for name, st in tensors:
            bar.update(st.nbytes(name))
            if _IGNORED.match(name):
                continue
            path, transpose = _hf_name_to_path(name)
            if path not in expected:
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint may still store the (shared) head
                raise WeightLoadError(f"unexpected tensor {name!r} in {st.path.name} for a {config.model_type} model")
            array = st.get(name)
            if transpose:
                array = array.T
            want = expected[path].get_value().shape
            if tuple(array.shape) != tuple(want):
                raise WeightLoadError(
                    f"tensor {name!r} has shape {tuple(st.get(name).shape)}, the config implies "
                    f"{tuple(want)[::-1] if transpose else tuple(want)}"
                )
            loaded[path] = jnp.asarray(np.ascontiguousarray(array), dtype=dtype)
    missing = [".".join(map(str, p)) for p in expected if p not in loaded]
    if missing:
        raise WeightLoadError(f"checkpoint {folder} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    flat = [(path, var.replace(loaded[path])) for path, var in expected.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


CONFIG_FILE = "strata_model_config.json"


def save_checkpoint(model: LlamaForCausalLM, directory: str | Path) -> Path:
    """Save the model's state with orbax plus its config; ``directory`` must not exist."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        raise FileExistsError(f"checkpoint directory {directory} already exists")
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "state", state)
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(model.config), indent=2))
    return directory


def restore_checkpoint(directory: str | Path, *, dtype: jnp.dtype = jnp.float32) -> LlamaForCausalLM:
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise WeightLoadError(f"{directory} is not a strata-jax checkpoint (no {CONFIG_FILE})")
    raw = json.loads(config_file.read_text())
    raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    config = ModelConfig(**raw)
    abstract = nnx.eval_shape(lambda: random_model(config, dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(directory / "state", abstract_state)
    return nnx.merge(graphdef, state)
