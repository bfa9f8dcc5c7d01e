"""Pallas kernels, their pure-JAX references, and per-platform dispatch.

Imports only jax and numpy.  Layouts: see ``pallas_kernels.layout``.
Public entry points (``scatter_pages``, ``gather_pages``, ``ragged_paged_attention``,
``ragged_paged_attention_pool``)
pick their implementation per platform in ``pallas_kernels.dispatch``: CPU ->
reference, CUDA/ROCm -> Pallas Triton; override with ``backend=`` /
``KernelConfig``, a ``use_backend(...)`` scope or ``$STRATA_KERNEL_BACKEND``
(``reference|pallas|interpret|auto``).
"""

from pallas_kernels.dispatch import (
    BACKENDS,
    KernelConfig,
    UnknownBackendError,
    gather_pages,
    platform_name,
    ragged_paged_attention,
    ragged_paged_attention_pool,
    resolve_backend,
    scatter_pages,
    use_backend,
    write_kv,
)
from pallas_kernels.layout import KVLayout
from pallas_kernels.reference import (
    gather_pages_reference,
    ragged_paged_attention_reference,
    scatter_pages_reference,
    write_kv_reference,
)

__all__ = [
    "BACKENDS",
    "KVLayout",
    "KernelConfig",
    "UnknownBackendError",
    "gather_pages",
    "gather_pages_reference",
    "platform_name",
    "ragged_paged_attention",
    "ragged_paged_attention_pool",
    "ragged_paged_attention_reference",
    "resolve_backend",
    "scatter_pages",
    "scatter_pages_reference",
    "use_backend",
    "write_kv",
    "write_kv_reference",
]
