"""Building models: random (embedded tiny default), from HF safetensors, from orbax checkpoints."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
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


@dataclass(frozen=True)
class NamedTensor:
    """One checkpoint tensor under its Hugging Face name, read only when ``get()`` is called.

    ``nbytes`` drives the progress bar; ``origin`` names the file it comes from in errors.
    Every weight source (safetensors, GGUF) yields these, so all share one loader.
    """

    name: str
    nbytes: int
    get: Callable[[], np.ndarray]
    origin: str


def load_hf_weights(
    folder: str | Path, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, show_progress: bool = True
) -> LlamaForCausalLM:
    """Load HF safetensors (single or sharded) into a model, casting to ``dtype``."""
    files = checkpoint_files(folder)
    tensors = [NamedTensor(name, st.nbytes(name), partial(st.get, name), st.path.name) for name, st in iter_tensors(files)]
    return load_named_tensors(tensors, config, dtype=dtype, show_progress=show_progress, source=str(folder))


def load_named_tensors(
    tensors: Sequence[NamedTensor],
    config: ModelConfig,
    *,
    dtype: jnp.dtype = jnp.float32,
    show_progress: bool = True,
    source: str,
) -> LlamaForCausalLM:
    """Build a model from tensors named as in Hugging Face checkpoints, casting to ``dtype``.

    Raises ``WeightLoadError`` naming the tensor for anything missing, unexpected or
    of the wrong shape; ``source`` names the checkpoint in those errors and the progress bar.
    """
    abstract = nnx.eval_shape(lambda: random_model(config, dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}
    total = sum(t.nbytes for t in tensors)
    loaded: dict[tuple, jax.Array] = {}
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"loading {Path(source).name}",
        disable=not show_progress or total < PROGRESS_BAR_MIN_BYTES,
    )
    with bar:
        for tensor in tensors:
            name = tensor.name
            bar.update(tensor.nbytes)
            if _IGNORED.match(name):
                continue
            path, transpose = _hf_name_to_path(name)
            if path not in expected:
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint may still store the (shared) head
                raise WeightLoadError(f"unexpected tensor {name!r} in {tensor.origin} for a {config.model_type} model")
            array = tensor.get()
            shape = tuple(array.shape)
            if transpose:
                array = array.T
            want = expected[path].get_value().shape
            if tuple(array.shape) != tuple(want):
                raise WeightLoadError(
                    f"tensor {name!r} in {tensor.origin} has shape {shape}, the config implies "
                    f"{tuple(want)[::-1] if transpose else tuple(want)}"
                )
            loaded[path] = jnp.asarray(np.ascontiguousarray(array), dtype=dtype)
    missing = [".".join(map(str, p)) for p in expected if p not in loaded]
    if missing:
        raise WeightLoadError(f"checkpoint {source} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
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
