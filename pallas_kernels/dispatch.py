"""The one place that picks a kernel implementation per platform.

Backends, by name:

* ``"xla"``: implementations written for a CPU: block-causal XLA attention
  (``pallas_kernels.blocked``) and, over a float32 pool on CPU, the native paged decode
  and extend kernels (``pallas_kernels.native``, XLA FFI custom calls built on first use;
  ``$STRATA_NATIVE_KERNELS=0`` turns them off); the page transfers and KV writes are the
  reference's.  The default on CPU (and TPU).
* ``"reference"``: the pure-JAX references every other backend is tested against.
* ``"pallas"``: compiled Pallas kernels, Triton lowering; the default on CUDA and ROCm.
* ``"interpret"``: the same Pallas kernels in interpret mode (any platform; for tests).
* ``"auto"``: choose by platform as above.

Selection order: an explicit ``backend=`` argument (or ``KernelConfig.backend``)
other than ``"auto"`` wins; else the innermost ``use_backend(...)`` scope (how the
model runner applies ``EngineConfig.kernel_backend`` to the model it traces); else
the ``STRATA_KERNEL_BACKEND`` environment variable if set; else the platform
default.  The choice is made in Python when a function is traced, so inside
``jax.jit`` it is fixed at compile time: a jitted function traced once keeps its
backend even if the environment changes later.

``"auto"`` falls back to ``"xla"`` for shapes the compiled kernel cannot tile
(attention with a head_dim that is not a power of two >= 16); an explicit
``"pallas"`` raises instead.

``write_kv`` has no Pallas kernel: it is one small XLA scatter on every platform.

Inside ``pallas_kernels.sharded.use_head_sharding(mesh)`` (tensor parallelism) every
entry point below runs its implementation per shard of the KV heads under
``shard_map``; the pool's and the page-first staging's head axis is 4.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

import jax

from pallas_kernels import sharded
from pallas_kernels.attention import (
    attention_supported,
    ragged_paged_attention_pallas,
    ragged_paged_attention_pool_pallas,
)
from pallas_kernels.blocked import blocked_paged_attention
from pallas_kernels.native import cpu_paged_attention_pool
from pallas_kernels.reference import (
    gather_pages_reference,
    ragged_paged_attention_pool_reference,
    ragged_paged_attention_reference,
    scatter_pages_reference,
    write_kv_reference,
)
from pallas_kernels.transfer import gather_pages_pallas, scatter_pages_pallas

ENV_VAR = "STRATA_KERNEL_BACKEND"
# "auto": by platform (the scoped backend and $STRATA_KERNEL_BACKEND may override it)
KernelBackend = Literal["auto", "xla", "reference", "pallas", "interpret"]
ConcreteBackend = Literal["xla", "reference", "pallas", "interpret"]  # what "auto" resolves to
BACKENDS: tuple[KernelBackend, ...] = get_args(KernelBackend)
_PALLAS_PLATFORMS = ("cuda", "rocm")


class UnknownBackendError(ValueError):
    """A kernel backend name that is not one of ``BACKENDS``."""


def _validate(name: str, source: str) -> KernelBackend:
    if name not in BACKENDS:
        raise UnknownBackendError(f"{source}: unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel implementation to use (``"auto"``: by platform, env may override)."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        _validate(self.backend, "KernelConfig.backend")


def platform_name() -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"`` for JAX's default backend."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version or "hip" in version else "cuda"
    return platform


def default_backend_for(platform: str) -> ConcreteBackend:
    return "pallas" if platform in _PALLAS_PLATFORMS else "xla"


_SCOPED_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("strata_kernel_backend", default="auto")


@contextlib.contextmanager
def use_backend(backend: str | KernelConfig) -> Iterator[None]:
    """Within this block (this thread / task), kernels called without an explicit
    ``backend=`` use ``backend``; ``"auto"`` leaves the choice to the env / platform."""
    name = backend.backend if isinstance(backend, KernelConfig) else _validate(backend, "use_backend")
    token = _SCOPED_BACKEND.set(name)
    try:
        yield
    finally:
        _SCOPED_BACKEND.reset(token)


def resolve_backend(backend: str | KernelConfig | None = None, platform: str | None = None) -> ConcreteBackend:
    """The concrete backend (``xla``, ``reference``, ``pallas`` or ``interpret``) to use now."""
    if isinstance(backend, KernelConfig):
        backend = backend.backend
    for choice, source in ((backend, "backend argument"), (_SCOPED_BACKEND.get(), "use_backend")):
        if choice is not None and (name := _validate(choice, source)) != "auto":
            return name
    env = os.environ.get(ENV_VAR, "").strip()
    if env and (name := _validate(env, f"${ENV_VAR}")) != "auto":
        return name
    return default_backend_for(platform or platform_name())


_IMPLEMENTATIONS: Mapping[str, Mapping[str, Callable]] = MappingProxyType(
    {
        "scatter_pages": MappingProxyType(
            {
                "xla": scatter_pages_reference,
                "reference": scatter_pages_reference,
                "pallas": scatter_pages_pallas,
                "interpret": functools.partial(scatter_pages_pallas, interpret=True),
            }
        ),
        "gather_pages": MappingProxyType(
            {
                "xla": gather_pages_reference,
                "reference": gather_pages_reference,
                "pallas": gather_pages_pallas,
                "interpret": functools.partial(gather_pages_pallas, interpret=True),
            }
        ),
        "ragged_paged_attention": MappingProxyType(
            {
                "xla": blocked_paged_attention,
                "reference": ragged_paged_attention_reference,
                "pallas": ragged_paged_attention_pallas,
                "interpret": functools.partial(ragged_paged_attention_pallas, interpret=True),
            }
        ),
        "ragged_paged_attention_pool": MappingProxyType(
            {
                "xla": cpu_paged_attention_pool,
                "reference": ragged_paged_attention_pool_reference,
                "pallas": ragged_paged_attention_pool_pallas,
                "interpret": functools.partial(ragged_paged_attention_pool_pallas, interpret=True),
            }
        ),
    }
)


def operations() -> tuple[str, ...]:
    return tuple(_IMPLEMENTATIONS)


def get_implementation(op: str, backend: str | KernelConfig | None = None) -> Callable:
    """The function implementing ``op`` for the resolved backend."""
    if op not in _IMPLEMENTATIONS:
        raise KeyError(f"unknown kernel op {op!r}; choose one of {', '.join(_IMPLEMENTATIONS)}")
    return _IMPLEMENTATIONS[op][resolve_backend(backend)]


def scatter_pages(
    pool: jax.Array, staging: jax.Array, page_ids: jax.Array, *, backend: str | KernelConfig | None = None
) -> jax.Array:
    """Write page-first ``staging[n, L, 2, S, H, D]`` into ``pool[L, 2, P, S, H, D]`` at ``page_ids``.

    Out-of-range ids are dropped.  Donate ``pool`` (``jax.jit(..., donate_argnums=...)``)
    so the update is in place.  See ``pallas_kernels.reference.scatter_pages_reference``.
    """
    impl = get_implementation("scatter_pages", backend)
    return sharded.per_head_shard(impl, (pool, staging, page_ids), (4, 4, None), 4)


def gather_pages(pool: jax.Array, page_ids: jax.Array, *, backend: str | KernelConfig | None = None) -> jax.Array:
    """Read ``pool[L, 2, P, S, H, D]`` pages ``page_ids[n]`` into page-first ``[n, L, 2, S, H, D]``."""
    impl = get_implementation("gather_pages", backend)
    return sharded.per_head_shard(impl, (pool, page_ids), (4, None), 4)


def write_kv(
    kv_pool: jax.Array, layer: int | jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Write new tokens' K/V ``[T, H, D]`` of one layer into the pool (``write_kv_reference``)."""
    return sharded.per_head_shard(write_kv_reference, (kv_pool, layer, k, v, slot_mapping), (4, None, 1, 1, None), 4)


def _attention_backend(head_dim: int, backend: str | KernelConfig | None) -> str:
    name = resolve_backend(backend)
    explicit = backend is not None and (backend.backend if isinstance(backend, KernelConfig) else backend) != "auto"
    if name == "pallas" and not attention_supported(head_dim) and not explicit:
        return "xla"
    return name


def _attention_options(
    name: str, sm_scale: float, soft_cap: float | None, max_q_len: int | None, sliding_window, sinks=None
) -> dict:
    """Keyword arguments for backend ``name``: only the Pallas kernel takes ``max_q_len``;
    ``sliding_window`` and ``sinks`` are passed only when set (``None`` is every backend's default)."""
    options: dict = {"sm_scale": sm_scale, "soft_cap": soft_cap}
    if name in ("pallas", "interpret"):
        options["max_q_len"] = max_q_len
    if sliding_window is not None:
        options["sliding_window"] = sliding_window
    if sinks is not None:
        options["sinks"] = sinks
    return options


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    max_q_len: int | None = None,
    backend: str | KernelConfig | None = None,
) -> jax.Array:
    """Ragged paged attention of one layer (contract: ``ragged_paged_attention_reference``).

    ``sliding_window`` (None, an int or a traced int32 scalar; <= 0 means full
    attention): a token at position p reads KV positions ``max(0, p - window + 1)..p``.
    ``sinks`` (None or float32 ``[num_q_heads]``, GPT-OSS): each query head's learned sink
    logit joins its softmax denominator (``reference.normalize_with_sinks``).
    ``max_q_len`` (static, optional) bounds the new tokens of any one sequence; the
    Pallas kernel uses it to shrink its grid (pass 1 for decode-only batches), the
    others ignore it.  Inside a jitted model step prefer
    ``ragged_paged_attention_pool``: slicing ``kv_pool[layer, 0]`` for a GPU custom
    call copies the layer.
    """
    name = _attention_backend(q.shape[-1], backend)
    impl = _IMPLEMENTATIONS["ragged_paged_attention"][name]
    args = (q, k_pages, v_pages, page_table, seq_lens, query_start)
    return impl(*args, **_attention_options(name, sm_scale, soft_cap, max_q_len, sliding_window, sinks))


def ragged_paged_attention_pool(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    max_q_len: int | None = None,
    backend: str | KernelConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``ragged_paged_attention(q, kv_pool[layer, 0], kv_pool[layer, 1], ...)`` without the slice.

    ``kv_pool[L, 2, P, S, H, D]`` is the whole layer-first pool, ``layer`` a Python
    int or a traced int32 scalar (the index of a layer scan), ``sliding_window`` as in
    ``ragged_paged_attention`` (under a scan: this layer's entry of a per-layer array),
    ``sinks`` too (split with the query heads under tensor parallelism).
    Returns ``(out, kv_pool)`` and the caller continues with the returned
    pool: the XLA backends thread the pool through their block loops (a loop that only
    closed over it would make XLA copy the donated pool every step); the Pallas
    kernel reads the layer in place and hands the pool back unchanged.
    """
    name = _attention_backend(q.shape[-1], backend)
    impl = _IMPLEMENTATIONS["ragged_paged_attention_pool"][name]
    options = _attention_options(name, sm_scale, soft_cap, max_q_len, None)
    threads_pool = name in ("xla", "reference")

    def call(q, kv_pool, layer, page_table, seq_lens, query_start, window, sinks):
        extra = {} if window is None else {"sliding_window": window}
        if sinks is not None:
            extra["sinks"] = sinks
        result = impl(q, kv_pool, layer, page_table, seq_lens, query_start, **options, **extra)
        return result if threads_pool else (result, kv_pool)

    args = (q, kv_pool, layer, page_table, seq_lens, query_start, sliding_window, sinks)
    # Heads: q's axis 1, the pool's axis 4 (a shard's q heads attend its own KV heads) and
    # the sinks' axis 0 (one per q head); the window, like the layer index, is replicated.
    return sharded.per_head_shard(call, args, (1, 4, None, None, None, None, None, 0), (1, 4))


__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KernelConfig",
    "UnknownBackendError",
    "default_backend_for",
    "gather_pages",
    "get_implementation",
    "operations",
    "platform_name",
    "ragged_paged_attention",
    "ragged_paged_attention_pool",
    "ragged_paged_attention_pool_reference",
    "resolve_backend",
    "scatter_pages",
    "use_backend",
    "write_kv",
]
