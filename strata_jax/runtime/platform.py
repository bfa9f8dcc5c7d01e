"""Per-platform defaults: the one place that decides what the engine runs with on CPU, CUDA or ROCm.

``defaults_for(platform)`` answers for any platform name (so ``strata-jax info`` can
say what it *would* choose on a GPU from a CPU host); ``resolve(...)`` applies a
user's explicit choices on top of the present platform's defaults.  The engine and
the runner take their dtypes, kernel backend and context cap from here and decide
nothing about platforms themselves.

Why each default (measured or documented, never a guess):

* ``kv_dtype``: float32 on CPU because XLA:CPU has no native bf16 scatter: an
  in-place update of a bf16 pool is lowered as convert-to-f32 + update + convert
  back, i.e. a rewrite of the *whole* pool on every step (the no-pool-copy HLO test,
  tests/test_runner_inplace.py, catches it).  bfloat16 on GPUs (half the bytes per
  cached token, the HBM and link budget that hierarchical caching is about).
* ``dtype`` (weights): float32 on CPU (the test platform; greedy parity with the
  Hugging Face reference in f32), bfloat16 on GPUs.
* ``kernel_backend``: ``pallas_kernels.dispatch.default_backend_for`` (Pallas
  Triton kernels on CUDA and ROCm, the XLA block-causal attention (``"xla"``) elsewhere);
  ``$STRATA_KERNEL_BACKEND`` and an explicit choice override ``"auto"``.
* ``host_memory_kind``: ``pinned_host`` on GPUs (page-locked memory DMAs at link
  speed; pageable memory goes through a driver bounce buffer), ``unpinned_host`` on
  CPU (host and device memory are the same DRAM).  The L2 pool is a numpy array
  today; this is the memory kind staging buffers and a jax-array host pool use.
* ``layer_weights``: ``per_layer`` on CPU, ``stacked`` elsewhere.  Under the layer scan
  a slice of a stacked ``[L, ...]`` weight is copied on XLA:CPU before its matmul, every
  layer of every step; per-layer arrays, picked inside a ``lax.switch`` by the matmul
  (``llama.LayerKernels``), are read in place: a 30-layer SmolLM2-shaped stack of
  matmuls took 33 vs 54 ms at batch 1 and 101 vs 148 ms at batch 16, side by side
  (docs/runtime.md).  On a GPU a switch reads its index on the host (a sync per
  matmul), so GPUs keep the stacked slices, which their fusions read in place.
* ``max_context_tokens`` cap: 16384 on CPU (a development platform: larger pools
  and page tables only make tests slow), none on GPUs (the model's limit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, cast, get_args

from pallas_kernels import dispatch
from pallas_kernels.dispatch import ConcreteBackend

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
CPU_CONTEXT_CAP = 16384
Dtype = Literal["float32", "bfloat16"]
# L1 KV may also be float8 e4m3 (vLLM's ``--kv-cache-dtype fp8``): values are clipped to
# +-448 and stored without scales; attention upcasts them.  "fp8" is an alias.
KVDtype = Literal["float32", "bfloat16", "float8_e4m3fn"]
LayerWeights = Literal["stacked", "per_layer"]  # "auto" resolves to one of them
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
KV_DTYPES: tuple[KVDtype, ...] = get_args(KVDtype)
LAYER_WEIGHTS: tuple[str, ...] = ("auto", *get_args(LayerWeights))
KV_DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def canonical_kv_dtype(name: str | None) -> str | None:
    """``"fp8"`` / ``"fp8_e4m3"`` -> ``"float8_e4m3fn"``; other names unchanged."""
    return KV_DTYPE_ALIASES.get(name, name) if name is not None else None


@dataclass(frozen=True)
class PlatformDefaults:
    """What the engine runs with on ``platform`` when the user leaves a field unset."""

    platform: str
    dtype: Dtype
    kv_dtype: KVDtype
    kernel_backend: ConcreteBackend
    host_memory_kind: str
    max_context_cap: int | None  # None: the model's own limit
    layer_weights: LayerWeights

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_GPU = ("cuda", "rocm")


def defaults_for(platform: str) -> PlatformDefaults:
    """The defaults on ``platform`` ("cpu", "cuda", "rocm", "tpu"), ignoring user overrides and env."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; choose one of {', '.join(PLATFORMS)}")
    on_gpu = platform in _GPU
    low_precision = platform != "cpu"
    return PlatformDefaults(
        platform=platform,
        dtype="bfloat16" if low_precision else "float32",
        kv_dtype="bfloat16" if low_precision else "float32",
        kernel_backend=dispatch.default_backend_for(platform),
        host_memory_kind="pinned_host" if on_gpu else "unpinned_host",
        max_context_cap=CPU_CONTEXT_CAP if platform == "cpu" else None,
        layer_weights="per_layer" if platform == "cpu" else "stacked",
    )


def resolve_layer_weights(choice: str, platform: str | None = None) -> LayerWeights:
    """``"stacked"`` or ``"per_layer"``: an explicit choice, else (``"auto"``) the platform's default."""
    if choice not in LAYER_WEIGHTS:
        raise ValueError(f"layer_weights must be one of {', '.join(LAYER_WEIGHTS)}, got {choice!r}")
    return (
        defaults_for(platform or current_platform()).layer_weights if choice == "auto" else cast(LayerWeights, choice)
    )


def current_platform() -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"`` for JAX's default backend."""
    return dispatch.platform_name()


@dataclass(frozen=True)
class ResolvedPlatform:
    """The settings in force: the user's explicit choices, else the platform's defaults."""

    defaults: PlatformDefaults
    dtype: Dtype
    kv_dtype: KVDtype
    kernel_backend: ConcreteBackend  # after "auto", the scoped backend and $STRATA_KERNEL_BACKEND
    layer_weights: LayerWeights = "stacked"

    @property
    def platform(self) -> str:
        return self.defaults.platform

    def max_context_tokens(self, model_limit: int, requested: int | None) -> int:
        """The context the engine serves: the request (validated by the caller), else the
        model's limit under the platform's cap."""
        if requested is not None:
            return requested
        cap = self.defaults.max_context_cap
        return model_limit if cap is None else min(model_limit, cap)


def resolve(
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    kernel_backend: str = "auto",
    layer_weights: str = "auto",
    platform: str | None = None,
) -> ResolvedPlatform:
    """Apply explicit choices (None / "auto" = default) over ``platform``'s defaults (default: this host's)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    kv_dtype = canonical_kv_dtype(kv_dtype)
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or fp8), got {kv_dtype!r}")
    defaults = defaults_for(platform or current_platform())
    return ResolvedPlatform(
        defaults=defaults,
        dtype=dtype if dtype is not None else defaults.dtype,
        kv_dtype=kv_dtype if kv_dtype is not None else defaults.kv_dtype,
        kernel_backend=dispatch.resolve_backend(kernel_backend, platform=defaults.platform),
        layer_weights=resolve_layer_weights(layer_weights, defaults.platform),
    )
