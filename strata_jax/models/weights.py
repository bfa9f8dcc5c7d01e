"""Building models: random (embedded tiny default) and from tensors named as in HF checkpoints
(safetensors here, GGUF via ``gguf_model``); orbax checkpoints are ``checkpoint``'s."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from strata_jax.models.config import ModelConfig
from strata_jax.models.gemma import GemmaForCausalLM
from strata_jax.models.llama import LlamaForCausalLM
from strata_jax.models.safetensors_io import checkpoint_files, iter_tensors

# The model families; each has LlamaForCausalLM's interface (__call__(ids, positions, kv_pool, meta), logits()).
CausalLM = LlamaForCausalLM | GemmaForCausalLM


class WeightLoadError(ValueError):
    """Weights that do not fit the model config (missing, unexpected or misshapen tensors)."""


# Tensors some checkpoints carry that the model recomputes instead.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
PROGRESS_BAR_MIN_BYTES = 64 * 1024 * 1024


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The module that runs ``config``'s family: ``GemmaForCausalLM`` for Gemma 2/3, else Llama's."""
    return GemmaForCausalLM if config.is_gemma else LlamaForCausalLM


def random_model(config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> CausalLM:
    return model_class(config)(config, dtype=dtype, rngs=nnx.Rngs(params=seed))


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


# XLA:CPU aliases (instead of copying) a host buffer aligned to this many bytes.
_CPU_ZERO_COPY_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised host array whose data starts on a ``_CPU_ZERO_COPY_ALIGNMENT`` boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _CPU_ZERO_COPY_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % _CPU_ZERO_COPY_ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


class HostStaging:
    """Builds every parameter in host memory, then hands it to the (CPU) device without a copy.

    On CPU the device's memory is host memory: each tensor is cast and transposed by numpy
    straight into its row of an aligned host array, and ``jax.device_put`` of an aligned
    array aliases it.  Loading holds the weights once plus nothing (safetensors are
    memory-mapped; GGUF holds one dequantized tensor), and compiles no programs.
    """

    def __init__(self, num_layers: int, dtype: jnp.dtype):
        self.num_layers, self.dtype = num_layers, np.dtype(dtype)
        self.arrays: dict[tuple, np.ndarray] = {}

    def put(
        self, path: tuple, layer: int | None, array: np.ndarray, *, shape: tuple[int, ...], transpose: bool
    ) -> None:
        if layer is None:
            target = self.arrays[path] = aligned_empty(shape, self.dtype)
        else:
            if path not in self.arrays:
                self.arrays[path] = aligned_empty((self.num_layers, *shape), self.dtype)
            target = self.arrays[path][layer]
        np.copyto(target, array.T if transpose else array, casting="unsafe")

    def finish(self) -> dict[tuple, jax.Array]:
        arrays, self.arrays = self.arrays, {}
        return {path: jax.device_put(array) for path, array in arrays.items()}


class _DeviceStaging:
    """Allocates stacked parameters on an accelerator once and writes each layer's tensor into
    its row by a donated update: device memory holds the weights once plus one tensor in
    transit, and host memory one tensor."""

    def __init__(self, num_layers: int, dtype: jnp.dtype):
        self.num_layers, self.dtype = num_layers, dtype
        self.arrays: dict[tuple, jax.Array] = {}

    def put(
        self, path: tuple, layer: int | None, array: np.ndarray, *, shape: tuple[int, ...], transpose: bool
    ) -> None:
        if layer is None:
            self.arrays[path] = jnp.asarray(np.ascontiguousarray(array.T if transpose else array), dtype=self.dtype)
            return
        if path not in self.arrays:
            self.arrays[path] = jnp.zeros((self.num_layers, *shape), self.dtype)
        self.arrays[path] = _put_layer(self.arrays[path], np.int32(layer), array, transpose=transpose)

    def finish(self) -> dict[tuple, jax.Array]:
        arrays, self.arrays = self.arrays, {}
        return arrays


def default_staging() -> str:
    """``"host"`` when the default device is a CPU (its memory is host memory), else ``"device"``."""
    return "host" if jax.devices()[0].platform == "cpu" else "device"


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
    folder: str | Path,
    config: ModelConfig,
    *,
    dtype: jnp.dtype = jnp.float32,
    show_progress: bool = True,
    staging: str | None = None,
) -> CausalLM:
    """Load HF safetensors (single or sharded) into a model, casting to ``dtype``
    (``staging``: see ``load_named_tensors``)."""
    files = checkpoint_files(folder)
    tensors = [
        NamedTensor(name, st.nbytes(name), partial(st.get, name), st.path.name) for name, st in iter_tensors(files)
    ]
    return load_named_tensors(
        tensors, config, dtype=dtype, show_progress=show_progress, source=str(folder), staging=staging
    )


def load_named_tensors(
    tensors: Sequence[NamedTensor],
    config: ModelConfig,
    *,
    dtype: jnp.dtype = jnp.float32,
    show_progress: bool = True,
    source: str,
    staging: str | None = None,
) -> CausalLM:
    """Build a model from tensors named as in Hugging Face checkpoints, casting to ``dtype``.

    Raises ``WeightLoadError`` naming the tensor for anything missing, unexpected or
    of the wrong shape; ``source`` names the checkpoint in those errors and the progress bar.
    Per-layer tensors land in rows of the stacked parameters, never in a second full
    copy of the weights; ``staging`` (default ``default_staging()``) picks how:
    ``"host"`` builds them in aligned host memory that the CPU device then aliases,
    ``"device"`` writes each row into a device array by a donated update.
    """
    staging = staging or default_staging()
    if staging not in ("host", "device"):
        raise ValueError(f"staging must be 'host' or 'device', got {staging!r}")
    stage = (HostStaging if staging == "host" else _DeviceStaging)(config.num_layers, dtype)
    abstract = nnx.eval_shape(lambda: random_model(config, dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}
    num_layers = config.num_layers
    stacked = {path for path in expected if path[:2] == ("model", "layers")}
    loaded: set[tuple] = set()
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
            if (
                path not in expected
                or (layer is None) != (path not in stacked)
                or (layer is not None and layer >= num_layers)
            ):
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
            stage.put(path, layer, array, shape=want, transpose=transpose)
            del array  # a dequantized GGUF tensor: free it before the next one
            if layer is None:
                loaded.add(path)
            else:
                filled[path].add(layer)
    missing = [".".join(map(str, p)) for p in expected if p not in stacked and p not in loaded]
    missing += [
        f"model.layers.{i}.{'.'.join(map(str, p[2:]))}"
        for p in expected
        if p in stacked
        for i in range(num_layers)
        if i not in filled[p]
    ]
    if missing:
        raise WeightLoadError(
            f"checkpoint {source} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    values = stage.finish()
    flat = [(path, var.replace(values[path])) for path, var in expected.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
