"""Pallas kernels, their pure-JAX references, and per-platform dispatch.

Imports only jax and numpy.  Layouts: see ``pallas_kernels.layout``.
"""

from pallas_kernels.layout import KVLayout
from pallas_kernels.reference import (
    gather_pages_reference,
    ragged_paged_attention_reference,
    scatter_pages_reference,
    write_kv_reference,
)

# Until the dispatch module lands, the public entry points are the references.
ragged_paged_attention = ragged_paged_attention_reference
scatter_pages = scatter_pages_reference
gather_pages = gather_pages_reference
write_kv = write_kv_reference

__all__ = [
    "KVLayout",
    "gather_pages",
    "gather_pages_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "scatter_pages",
    "scatter_pages_reference",
    "write_kv",
    "write_kv_reference",
]
