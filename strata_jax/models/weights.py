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


# Mixture-of-experts checkpoint names (config.moe): HF writes the experts one by one
# (qwen: mlp.experts.E.{gate,up,down}_proj; mixtral: block_sparse_moe.experts.E.{w1,w3,w2});
# transformers 5 holds them fused (mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F]).
_MOE_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_MOE_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MOE_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate|shared_expert_gate)\.weight$")
# GPT-OSS: the router is mlp.router (with a bias); the experts are fused, laid out [E, in, out],
# gate and up interleaved along gate_up_proj's last axis (gate = [..., ::2], up = [..., 1::2]),
# each with a bias; MXFP4 checkpoints store them as _blocks/_scales pairs (mxfp4.py).
_GPT_OSS_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.router\.(weight|bias)$")
_GPT_OSS_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_EXPERT_PROJ = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_EXPERT_PROJ.update(w1="gate_proj", w3="up_proj", w2="down_proj")  # mixtral's names


@dataclass(frozen=True)
class Placement:
    """Where (part of) a checkpoint tensor goes: the state ``path``, the ``index`` of the row it
    fills (``()``: the whole parameter; ``(layer,)``; ``(layer, expert)``), and the array in
    checkpoint orientation, its last two axes swapped when ``transpose`` (``[out, in]`` -> ``[in, out]``)."""

    path: tuple[str, ...]
    index: tuple[int, ...]
    get: Callable[[], np.ndarray]
    transpose: bool


def tensor_placements(tensor: NamedTensor, config: ModelConfig) -> list[Placement]:
    """Where a checkpoint tensor lands: ``hf_name_to_param``'s one place, or for a mixture of
    experts the router / expert rows (a fused ``gate_up_proj`` fills two parameters); in a
    stack mixing dense and sparse MLP layers a layer's MLP goes to its kind's stack
    (``_mixed_stack_placement``).

    Raises ``WeightLoadError`` for a fused expert tensor whose shape the config does not imply."""
    placements = _placements(tensor, config)
    if config.mixed_mlp_layers:
        return [_mixed_stack_placement(place, config) for place in placements]
    return placements


def _mixed_stack_placement(place: Placement, config: ModelConfig) -> Placement:
    """``model.layers.mlp.<...>`` row ``(layer, ...)`` as ``model.{moe,dense}_layers.mlp.<...>``
    row ``(the layer's row in its kind's stack, ...)`` (``llama.mixed_layer_values``)."""
    if place.path[:3] != ("model", "layers", "mlp") or not place.index:
        return place
    layer = place.index[0]
    if layer >= config.num_layers:
        return place  # past the last layer: refused by the loader as unexpected
    stack = "moe_layers" if config.layer_is_sparse[layer] else "dense_layers"
    row = config.mlp_stack_rows[layer]
    return Placement(("model", stack, *place.path[2:]), (row, *place.index[1:]), place.get, place.transpose)


def _placements(tensor: NamedTensor, config: ModelConfig) -> list[Placement]:
    moe = config.moe
    if config.model_type == "gpt_oss" and moe is not None:
        if match := _GPT_OSS_ROUTER.match(tensor.name):
            leaf = "kernel" if match.group(2) == "weight" else "bias"
            router = ("model", "layers", "mlp", "gate", leaf)
            return [Placement(router, (int(match.group(1)),), tensor.get, leaf == "kernel")]
        if match := _GPT_OSS_EXPERTS.match(tensor.name):
            return _gpt_oss_expert_placements(tensor, config, int(match.group(1)), match.group(2), bool(match.group(3)))
    if moe is not None:
        if match := _MOE_ROUTER.match(tensor.name):
            router = ("model", "layers", "mlp", match.group(2), "kernel")
            return [Placement(router, (int(match.group(1)),), tensor.get, True)]
        match = _MOE_EXPERT.match(tensor.name)
        if match and match.group(3) in _EXPERT_PROJ:
            expert = ("model", "layers", "mlp", "experts", _EXPERT_PROJ[match.group(3)], "kernel")
            return [Placement(expert, (int(match.group(1)), int(match.group(2))), tensor.get, True)]
        if match := _MOE_FUSED.match(tensor.name):
            layer, kind = int(match.group(1)), match.group(2)
            e, f, d = moe.num_experts, moe.expert_intermediate_size, config.hidden_size
            want = (e, 2 * f, d) if kind == "gate_up_proj" else (e, d, f)
            array = _read_shaped(tensor, want)
            experts = ("model", "layers", "mlp", "experts")
            if kind == "down_proj":
                return [Placement((*experts, "down_proj", "kernel"), (layer,), lambda: array, True)]
            return [  # rows [0, F) of each expert are its gate projection, [F, 2F) its up projection
                Placement((*experts, "gate_proj", "kernel"), (layer,), lambda: array[:, :f], True),
                Placement((*experts, "up_proj", "kernel"), (layer,), lambda: array[:, f:], True),
            ]
    dense_path, dense_layer, transpose = hf_name_to_param(tensor.name)
    return [Placement(dense_path, () if dense_layer is None else (dense_layer,), tensor.get, transpose)]


def _read_shaped(tensor: NamedTensor, want: tuple[int, ...]) -> np.ndarray:
    """A fused expert tensor, read; ``WeightLoadError`` naming it unless its shape is ``want``."""
    array = tensor.get()
    if tuple(array.shape) != want:
        raise WeightLoadError(
            f"tensor {tensor.name!r} in {tensor.origin} has shape {tuple(array.shape)}, the config implies {want}"
        )
    return array


def _gpt_oss_expert_placements(
    tensor: NamedTensor, config: ModelConfig, layer: int, kind: str, bias: bool
) -> list[Placement]:
    """A GPT-OSS expert tensor's placements: ``gate_up_proj [E, D, 2F]`` (its bias ``[E, 2F]``)
    split into the interleaved gate and up projections, ``down_proj [E, F, D]`` (bias ``[E, D]``)
    whole; nothing transposed (they are already ``[E, in, out]``)."""
    assert config.moe is not None
    e, f, d = config.moe.num_experts, config.moe.expert_intermediate_size, config.hidden_size
    want = {
        ("gate_up_proj", False): (e, d, 2 * f),
        ("gate_up_proj", True): (e, 2 * f),
        ("down_proj", False): (e, f, d),
        ("down_proj", True): (e, d),
    }[(kind, bias)]
    array = _read_shaped(tensor, want)
    experts, leaf = ("model", "layers", "mlp", "experts"), "bias" if bias else "kernel"
    if kind == "down_proj":
        return [Placement((*experts, "down_proj", leaf), (layer,), lambda: array, False)]
    return [
        Placement((*experts, "gate_proj", leaf), (layer,), lambda: array[..., ::2], False),
        Placement((*experts, "up_proj", leaf), (layer,), lambda: array[..., 1::2], False),
    ]


def _oriented(array: np.ndarray, transpose: bool) -> np.ndarray:
    """``array`` with its last two axes swapped when ``transpose`` (a view; 1-D arrays as they are)."""
    return np.swapaxes(array, -1, -2) if transpose and array.ndim >= 2 else array


@partial(jax.jit, donate_argnums=0, static_argnames=("transpose",))
def _put_layer(stack: jax.Array, index: jax.Array, tensor: jax.Array, *, transpose: bool) -> jax.Array:
    """Write one tensor into row ``index`` (``int32[k]``: a layer, or a layer and an expert) of
    its (donated) stacked array, in place.

    ``index`` is traced, so one small program per parameter shape serves every layer.
    """
    value = (jnp.swapaxes(tensor, -1, -2) if transpose and tensor.ndim >= 2 else tensor).astype(stack.dtype)
    rows = index.shape[0]
    starts = [index[i] for i in range(rows)] + [0] * value.ndim
    return jax.lax.dynamic_update_slice(stack, value.reshape((1,) * rows + value.shape), starts)


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

    def __init__(self, dtype: jnp.dtype):
        self.dtype = np.dtype(dtype)
        self.arrays: dict[tuple, np.ndarray] = {}

    def put(
        self, path: tuple, index: tuple[int, ...], array: np.ndarray, *, shape: tuple[int, ...], transpose: bool
    ) -> None:
        """Copy ``array`` into row ``index`` of parameter ``path`` (whole ``shape``)."""
        if path not in self.arrays:
            self.arrays[path] = aligned_empty(shape, self.dtype)
        np.copyto(self.arrays[path][index], _oriented(array, transpose), casting="unsafe")

    def finish(self) -> dict[tuple, jax.Array]:
        arrays, self.arrays = self.arrays, {}
        return {path: jax.device_put(array) for path, array in arrays.items()}


class _DeviceStaging:
    """Allocates stacked parameters on an accelerator once and writes each layer's tensor into
    its row by a donated update: device memory holds the weights once plus one tensor in
    transit, and host memory one tensor."""

    def __init__(self, dtype: jnp.dtype):
        self.dtype = dtype
        self.arrays: dict[tuple, jax.Array] = {}

    def put(
        self, path: tuple, index: tuple[int, ...], array: np.ndarray, *, shape: tuple[int, ...], transpose: bool
    ) -> None:
        """Write ``array`` into row ``index`` of parameter ``path`` (whole ``shape``)."""
        if not index:
            self.arrays[path] = jnp.asarray(np.ascontiguousarray(_oriented(array, transpose)), dtype=self.dtype)
            return
        if path not in self.arrays:
            self.arrays[path] = jnp.zeros(shape, self.dtype)
        self.arrays[path] = _put_layer(self.arrays[path], np.asarray(index, np.int32), array, transpose=transpose)

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


_LAYER_STACKS = ("layers", "dense_layers", "moe_layers")  # DecoderModel's stacked modules


def _row_depth(path: tuple) -> int:
    """Leading axes of parameter ``path`` that checkpoint tensors index: 2 for the experts'
    kernels (``[layer, expert]``), 1 for other stacked layer parameters, 0 otherwise."""
    if path[0] != "model" or len(path) < 2 or path[1] not in _LAYER_STACKS:
        return 0
    return 2 if path[2:4] == ("mlp", "experts") else 1


def _hf_row_name(path: tuple, row: tuple[int, ...], config: ModelConfig) -> str:
    """The checkpoint name of row ``row`` of parameter ``path`` (for a missing-tensor error)."""
    if not row:
        return ".".join(map(str, path))
    layer = row[0]
    if path[1] in ("dense_layers", "moe_layers"):  # a mixed stack's row: back to its layer
        kind = path[1] == "moe_layers"
        layer = next(
            i
            for i, (sparse, stack_row) in enumerate(zip(config.layer_is_sparse, config.mlp_stack_rows))
            if sparse == kind and stack_row == row[0]
        )
    if len(row) == 2:  # an expert: its per-expert name
        return f"model.layers.{layer}.mlp.experts.{row[1]}.{'.'.join(map(str, path[4:]))}"
    return f"model.layers.{layer}.{'.'.join(map(str, path[2:]))}"


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
    if config.model_type == "gpt_oss":  # MXFP4 experts: each blocks/scales pair read as one dequantized tensor
        from strata_jax.models.mxfp4 import merge_mxfp4_pairs  # mxfp4.py imports this module

        tensors = merge_mxfp4_pairs(tensors)
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
    stage = (HostStaging if staging == "host" else _DeviceStaging)(dtype)
    abstract = nnx.eval_shape(lambda: random_model(config, dtype=dtype))
    graphdef, abstract_state = nnx.split(abstract)
    expected = {path: var for path, var in nnx.to_flat_state(abstract_state)}
    shapes = {path: tuple(var.get_value().shape) for path, var in expected.items()}
    # how many leading axes a checkpoint tensor may index: 0 unstacked, 1 the layer, 2 a layer and an expert
    depth = {path: _row_depth(path) for path in expected}
    # rows filled so far, as index prefixes: (layer,) fills a layer (every expert of it), (layer, expert) one expert
    filled: dict[tuple, set[tuple[int, ...]]] = {path: set() for path in expected}
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
            for place in tensor_placements(tensor, config):
                path, index = place.path, place.index
                if (
                    path not in expected
                    or not (min(depth[path], 1) <= len(index) <= depth[path])
                    or any(i >= n for i, n in zip(index, shapes[path]))
                ):
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue  # a tied checkpoint may still store the (shared) head
                    raise WeightLoadError(
                        f"unexpected tensor {name!r} in {tensor.origin} for a {config.model_type} model"
                    )
                array = place.get()
                want = shapes[path][len(index) :]
                got = _oriented(array, place.transpose).shape
                if got != want:
                    implied = want[:-2] + want[-2:][::-1] if place.transpose else want
                    raise WeightLoadError(
                        f"tensor {name!r} in {tensor.origin} has shape {tuple(array.shape)}, the config implies "
                        f"{implied}"
                    )
                stage.put(path, index, array, shape=shapes[path], transpose=place.transpose)
                del array  # a dequantized GGUF tensor: free it before the next one
                filled[path].add(index)
    missing = [
        _hf_row_name(path, row, config)
        for path in expected
        for row in np.ndindex(*shapes[path][: depth[path]])
        if not any(row[:n] in filled[path] for n in range(len(row) + 1))
    ]
    if missing:
        raise WeightLoadError(
            f"checkpoint {source} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    values = stage.finish()
    flat = [(path, var.replace(values[path])) for path, var in expected.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
