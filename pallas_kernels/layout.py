"""KV cache layouts shared by the model, the kernels and the cache tiers.

Two layouts, one per place the KV lives:

* **Layer-first device pool (L1)**, what attention reads::

      kv_pool[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]

  ``kv_pool[l, 0]`` is layer ``l``'s K, ``kv_pool[l, 1]`` its V; each is one
  contiguous ``[num_pages, page_size, kv_heads, head_dim]`` block.  A token's
  *slot* is ``page_id * page_size + offset_in_page``; viewing the pool as
  ``[num_layers, 2, num_slots, kv_heads, head_dim]`` (a free reshape) indexes it
  by slot.  The pool is updated in place: every jitted step donates it.

* **Page-first staging / host / storage layout (L2, L3)**::

      pages[n_pages, num_layers, 2, page_size, num_kv_heads, head_dim]

  One page holds every layer's K and V for ``page_size`` tokens as one
  contiguous block, so moving a page is one large copy and one storage object.

Converting between them is a transpose of the leading axes; ``scatter_pages`` /
``gather_pages`` do it while moving pages in or out of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache; everything else is derived from it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def itemsize(self) -> int:
        return np.dtype(_numpy_dtype_name(self.dtype)).itemsize

    def device_pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def page_first_shape(self, num_pages: int) -> tuple[int, ...]:
        return (num_pages, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (K and V): one transfer unit."""
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        return self.page_bytes // self.page_size


@dataclass(frozen=True)
class RowLayout:
    """A device pool as one array of rows, ``pool[num_rows, page_size, num_kv_heads, head_dim]``,
    in which each layer may have its own page count (issue 22's layer groups: local,
    sliding-window layers keep fewer pages than global ones).

    Layer ``l``'s K of page ``p`` is row ``k_base[l] + p`` and its V row ``v_base[l] + p``;
    each layer's K rows, then its V rows, follow the previous layer's.  With one page
    count for every layer (``uniform``) this is today's layer-first pool
    ``[L, 2, P, S, H, D]`` reshaped, a free view.  A layer scan reads its rows at traced
    offsets, so both kinds of layer stay one program and the donated pool is updated in
    place (``lax.cond`` over two pools copies both: scripts/probe_layer_group_pools.py).
    Not used by the kernels yet (docs/models.md, "Layer groups").
    """

    layout: KVLayout
    layer_pages: tuple[int, ...]  # pages of each layer's group, one entry per layer

    def __post_init__(self) -> None:
        if len(self.layer_pages) != self.layout.num_layers:
            raise ValueError(f"{len(self.layer_pages)} page counts for {self.layout.num_layers} layers")
        if any(not isinstance(p, int) or p <= 0 for p in self.layer_pages):
            raise ValueError(f"every layer needs a positive page count, got {self.layer_pages}")

    @classmethod
    def uniform(cls, layout: KVLayout, num_pages: int) -> RowLayout:
        return cls(layout, (num_pages,) * layout.num_layers)

    @classmethod
    def grouped(cls, layout: KVLayout, local_layers: tuple[bool, ...], global_pages: int, local_pages: int) -> RowLayout:
        """Global layers with ``global_pages`` pages, local ones (``local_layers[l]``) with ``local_pages``."""
        return cls(layout, tuple(local_pages if local else global_pages for local in local_layers))

    @property
    def k_base(self) -> np.ndarray:
        return np.cumsum((0, *(2 * p for p in self.layer_pages[:-1])), dtype=np.int64).astype(np.int32)

    @property
    def v_base(self) -> np.ndarray:
        return self.k_base + np.asarray(self.layer_pages, np.int32)

    @property
    def num_rows(self) -> int:
        return 2 * sum(self.layer_pages)

    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_rows, self.layout.page_size, self.layout.num_kv_heads, self.layout.head_dim)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.layout.page_size * self.layout.num_kv_heads * self.layout.head_dim * self.layout.itemsize


def _numpy_dtype_name(dtype: str) -> str:
    if dtype not in ("float32", "float16"):
        import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 names with numpy)
    return dtype
