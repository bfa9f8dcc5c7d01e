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
class GroupedPoolLayout:
    """A device pool in which each layer may have its own page count (issue 22's layer
    groups: local, sliding-window layers can keep fewer pages than global ones)::

        kv_pool[1, 2, num_rows, page_size, num_kv_heads, head_dim]

    Layer ``l``'s page ``p`` is row ``page_base[l] + p`` of ``kv_pool[0, 0]`` (K) and of
    ``kv_pool[0, 1]`` (V); each layer's rows follow the previous layer's.  To the kernels
    this is a one-layer pool read at layer 0 through a page table offset by ``page_base[l]``,
    so they run unchanged, a layer scan reads its rows at a traced offset (both kinds of
    layer stay one program) and the donated pool is updated in place (``lax.cond`` over two
    pools would copy both: scripts/probe_layer_group_pools.py).  A global layer's pages are
    the tree's page ids; a local layer's are local ids (``local_pages`` of them).  With
    equal page counts this holds the layer-first pool's pages, ``kv_pool[0, kv, page_base[l]
    + p] == layer_first[l, kv, p]`` (``uniform``).
    """

    layout: KVLayout
    local_layers: tuple[bool, ...]  # one entry per layer: True for a sliding-window layer
    global_pages: int
    local_pages: int

    def __post_init__(self) -> None:
        if len(self.local_layers) != self.layout.num_layers:
            raise ValueError(f"{len(self.local_layers)} layer kinds for {self.layout.num_layers} layers")
        for name in ("global_pages", "local_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedPoolLayout.{name} must be a positive int, got {value!r}")
        if self.num_slots >= 2**31:  # slots are int32 in the step
            raise ValueError(f"a grouped pool of {self.num_slots} token slots does not fit int32 slot ids")

    @classmethod
    def uniform(cls, layout: KVLayout, num_pages: int) -> GroupedPoolLayout:
        return cls(layout, (False,) * layout.num_layers, num_pages, num_pages)

    @property
    def local_share(self) -> float:
        """The local (sliding-window) layers' share of a page's KV."""
        return sum(self.local_layers) / len(self.local_layers)

    @property
    def layer_pages(self) -> tuple[int, ...]:
        return tuple(self.local_pages if local else self.global_pages for local in self.local_layers)

    @property
    def page_base(self) -> np.ndarray:
        """int32 ``[num_layers]``: the row of each layer's page 0."""
        return np.cumsum((0, *self.layer_pages[:-1]), dtype=np.int64).astype(np.int32)

    @property
    def num_rows(self) -> int:
        return sum(self.layer_pages)

    def layer_rows(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (first row, page count): what the model step needs (static)."""
        return tuple((int(base), pages) for base, pages in zip(self.page_base, self.layer_pages))

    @property
    def num_slots(self) -> int:
        """Token slots of one of K / V over every row: a slot at or past it is out of the pool."""
        return self.num_rows * self.layout.page_size

    def pool_shape(self) -> tuple[int, ...]:
        return (1, 2, self.num_rows, self.layout.page_size, self.layout.num_kv_heads, self.layout.head_dim)

    def rows(self, global_ids: np.ndarray, local_ids: np.ndarray) -> np.ndarray:
        """int32 ``[n, num_layers]``: the rows holding pages ``global_ids[n]`` (global layers)
        and ``local_ids[n]`` (local layers).  An id outside its group's range (padding, or a
        local page that is not there) gives ``num_rows``: out of the pool."""
        global_ids = np.asarray(global_ids, np.int64)[:, None]
        local_ids = np.asarray(local_ids, np.int64)[:, None]
        local = np.asarray(self.local_layers)[None, :]
        ids = np.where(local, local_ids, global_ids)
        limit = np.where(local, self.local_pages, self.global_pages)
        inside = (ids >= 0) & (ids < limit)
        return np.where(inside, self.page_base[None, :] + ids, self.num_rows).astype(np.int32)

    @property
    def nbytes(self) -> int:
        lay = self.layout
        return 2 * self.num_rows * lay.page_size * lay.num_kv_heads * lay.head_dim * lay.itemsize


def _numpy_dtype_name(dtype: str) -> str:
    if dtype not in ("float32", "float16"):
        import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 names with numpy
    return dtype
