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


_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name_to_param(name: str) -> tuple[tuple[str, ...], int | None, bool]:
    """Map a HF tensor name to (our state path, layer index or None, transpose?).

    ``model.layers.{i}.<rest>`` lands in row ``i`` of the stacked parameter
    ``model.layers.<rest>``; ``*_proj.weight`` / ``lm_head.weight`` ``[out, in]`` become
    ``...kernel`` ``[in, out]`` (transposed); every other name maps to itself.
    """
    layer: int | None = None
    match = _LAYER_TENSOR.match(name)
    if match:
        layer, name = int(match.group(1)), "model.layers." + match.group(2)
    parts = tuple(name.split("."))
    is_linear = parts[-1] == "weight" and len(parts) >= 2 and parts[-2].endswith("_proj")
    if is_linear or parts[:1] == ("lm_head",):
        return parts[:-1] + ("kernel",), layer, True
    return parts, layer, False


@partial(jax.jit, donate_argnums=0, static_argnames=("transpose",))
def _put_layer(stack: jax.Array, layer: jax.Array, tensor: jax.Array, *, transpose: bool) -> jax.Array:
    """Write one layer's tensor into row ``layer`` of its (donated) stacked array, in place.

    ``layer`` is traced, so one small program per parameter shape serves every layer.
    """
    value = (tensor.T if transpose else tensor).astype(stack.dtype)
    return jax.lax.dynamic_update_index_in_dim(stack, value, layer, 0)


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
    Stacked per-layer parameters are allocated once on the device and each layer's
    tensor is written into its row in place (a donated update), so loading holds the
    weights once plus one tensor in transit, never a second full copy.
    """
    abstract = nnx.eval_shape(lambda: random_model(config, dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}
    num_layers = config.num_layers
    stacked = {path for path in expected if path[:2] == ("model", "layers")}
    values: dict[tuple, jax.Array] = {}
    filled: dict[tuple, set[int]] = {path: set() for path in stacked}
    total = sum(t.nbytes for t in tensors)
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
            path, layer, transpose = hf_name_to_param(name)
            if path not in expected or (layer is None) != (path not in stacked) or (layer is not None and layer >= num_layers):
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # a tied checkpoint may still store the (shared) head
                raise WeightLoadError(f"unexpected tensor {name!r} in {tensor.origin} for a {config.model_type} model")
            array = tensor.get()
            want = tuple(expected[path].get_value().shape)
            if layer is not None:
                want = want[1:]
            got = tuple(array.shape)[::-1] if transpose else tuple(array.shape)
            if got != want:
                raise WeightLoadError(
                    f"tensor {name!r} in {tensor.origin} has shape {tuple(array.shape)}, the config implies "
                    f"{want[::-1] if transpose else want}"
                )
            if layer is None:
                values[path] = jnp.asarray(np.ascontiguousarray(array.T if transpose else array), dtype=dtype)
                continue
            if path not in values:
                values[path] = jnp.zeros((num_layers, *want), dtype)
            values[path] = _put_layer(values[path], np.int32(layer), array, transpose=transpose)
            filled[path].add(layer)
    missing = [".".join(map(str, p)) for p in expected if p not in stacked and p not in values]
    missing += [
        f"model.layers.{i}.{'.'.join(p[2:])}" for p in expected if p in stacked for i in range(num_layers) if i not in filled[p]
    ]
    if missing:
        raise WeightLoadError(f"checkpoint {source} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    flat = [(path, var.replace(values[path])) for path, var in expected.items()]
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
