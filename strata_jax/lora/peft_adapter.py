"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT adds ``scaling * B @ A @ x`` to a targeted linear layer's output, with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA).  The weights are
stored as ``...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` (``[r, in]``) and
``lora_B.weight`` (``[out, r]``).  Anything PEFT can express that this reader would
silently get wrong is refused with a message: DoRA, trained biases, ``modules_to_save``,
per-module rank or alpha patterns, targets outside the decoder layers' seven linears.

An adapter's ``identity`` is a SHA-256 over its scaling and every tensor's name, shape,
dtype and bytes: two folders with equal content share it whatever their names, and any
change of weights or scaling changes it.  The cache namespaces KV by it
(``adapter_namespace``), never by the name a user gave.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata_jax.api import InvalidRequestError
from strata_jax.models.config import ModelConfig
from strata_jax.models.safetensors_io import SafetensorsError, SafetensorsFile

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES

_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")


class AdapterError(InvalidRequestError):
    """An adapter that cannot be served faithfully (bad folder, unsupported option, wrong base)."""


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of ``module`` in a decoder layer of ``config``."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    i = config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read for one base model.

    ``weights[module] = (a, b)``: ``a [L, r, in]`` and ``b [L, out, r]`` in float32, zero for
    layers the adapter does not touch; ``scaling`` is not folded in.
    """

    name: str
    path: str
    identity: str  # hex SHA-256 of the content (module doc)
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = field(repr=False)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m for m in MODULES if m in self.weights)


def _config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{path}: peft_type {kind!r} is not LORA")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layer_replication": "layer_replication",
    }
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{path}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: trained biases (bias={config['bias']!r}) are not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or not math.isfinite(rank):
        raise AdapterError(f"{path}: r={rank!r} must be a positive integer")
    if rank != int(rank) or rank < 1:
        raise AdapterError(f"{path}: r={rank!r} must be a positive integer")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{path}: lora_alpha={alpha!r} must be a positive finite number")
    return config


def _tensors(folder: Path) -> SafetensorsFile:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(f"{folder}: adapter_model.bin (pickle) is not read; save it as safetensors")
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    try:
        return SafetensorsFile(path)
    except SafetensorsError as exc:
        raise AdapterError(str(exc)) from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a header of the wrong shape
        raise AdapterError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc


def load_peft_adapter(name: str, path: str | Path, base: ModelConfig, *, max_rank: int) -> LoraAdapter:
    """Read the adapter at ``path`` for the base model ``base`` (its shapes and layer count are
    checked); ``max_rank``: the largest rank the server's slots hold.  Anything wrong with the
    folder is an ``AdapterError`` naming it (a 400 at run time, a start-up error at start)."""
    try:
        return _load(name, path, base, max_rank)
    except AdapterError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise AdapterError(f"{path}: cannot be read as a PEFT adapter ({type(exc).__name__}: {exc})") from exc


def _load(name: str, path: str | Path, base: ModelConfig, max_rank: int) -> LoraAdapter:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"{folder}: not a directory")
    config = _config(folder)
    st = _tensors(folder)
    rank = int(config["r"])
    if rank > max_rank:
        raise AdapterError(f"{folder}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora", False))
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    if base.moe is not None and any(_KEY.fullmatch(k) and ".mlp." in k for k in st.keys()):
        raise AdapterError(f"{folder}: LoRA on the MLP of a mixture-of-experts model is not supported")
    num_layers = base.num_layers
    found: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    groups = dict.fromkeys(ATTENTION_MODULES, "self_attn") | dict.fromkeys(MLP_MODULES, "mlp")
    digest = hashlib.sha256(json.dumps({"rank": rank, "scaling": scaling}, sort_keys=True).encode())
    for key in sorted(st.keys()):
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"{folder}: tensor {key} is not a LoRA weight of a decoder layer's linear")
        layer, group, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in MODULES or groups[module] != group:
            raise AdapterError(f"{folder}: module {group}.{module} ({key}) is not one of the decoder layers' linears")
        if layer in found.get(module, {}).get(which, {}):  # a file holding several adapters
            raise AdapterError(
                f"{folder}: two lora_{which} tensors for layer {layer}'s {module} (one adapter per folder)"
            )
        if layer >= num_layers:
            raise AdapterError(f"{folder}: {key} names layer {layer}; the base model has {num_layers}")
        array = st.get(key)
        d_in, d_out = module_shape(base, module)
        want = (rank, d_in) if which == "A" else (d_out, rank)
        if tuple(array.shape) != want:
            raise AdapterError(f"{folder}: {key} has shape {tuple(array.shape)}; the base model needs {want}")
        value = np.asarray(array, np.float32)
        if not np.isfinite(value).all():
            raise AdapterError(f"{folder}: {key} holds NaN or infinite values")
        digest.update(f"{key}|{array.dtype.str}|{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
        found.setdefault(module, {}).setdefault(which, {})[layer] = value
    if not found:
        raise AdapterError(f"{folder}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for module in MODULES:
        parts = found.get(module)
        if parts is None:
            continue
        if set(parts.get("A", {})) != set(parts.get("B", {})):
            raise AdapterError(f"{folder}: {module} has lora_A and lora_B for different layers")
        d_in, d_out = module_shape(base, module)
        a = np.zeros((num_layers, rank, d_in), np.float32)
        b = np.zeros((num_layers, d_out, rank), np.float32)
        for layer, value in parts["A"].items():
            a[layer] = value
            b[layer] = parts["B"][layer]
        weights[module] = (a, b)
    return LoraAdapter(name, str(folder), digest.hexdigest(), rank, scaling, weights)


def adapter_namespace(namespace: str, identity: str | None) -> str:
    """The cache namespace of KV computed under the adapter ``identity`` for the tenant
    ``namespace`` (the base model's KV: ``namespace`` itself).  The tree keeps a subtree per
    namespace and L3 keys are seeded by it, so two adapters never share a page."""
    return namespace if not identity else f"{namespace}{_ADAPTER_MARK}{identity}"


def namespace_adapter(namespace: str) -> str | None:
    """The adapter identity of a cache namespace (``adapter_namespace``'s inverse), or None."""
    _, mark, identity = namespace.rpartition(_ADAPTER_MARK)
    return identity if mark else None


_ADAPTER_MARK = "\x1flora:"  # cache_salt may not hold U+001F (api.check_cache_salt)
