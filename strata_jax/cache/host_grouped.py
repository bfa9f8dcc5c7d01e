"""``GroupedHostPool``: L2 with layer groups (docs/models.md, "L2 with layer groups").

Every host page holds its full-attention ("global") layers' KV; only some hold their
sliding-window ("local") layers' KV, in a smaller pool of local host pages found through
a ``DeviceLocalPages`` map (the same bookkeeping L1 uses: attach, evict least recently
attached first, pins).  A reuse needs a page's local KV only inside the window before
where it starts, so the local pool can be a fraction of the global one
(``--kv-host-local-ratio``) and L2 holds more pages for the same bytes.

Who gets a local host page, and when it goes:
* a backup of a device page that has its local KV (attached when issued, written when
  it lands: the slot is looked up then, so one evicted in between is simply not written);
* an L3 read of an object that has it (attached and pinned while the read runs, dropped
  at settle time for objects flagged global-only);
* when none is free, an unpinned one is evicted: first those outside every window a
  match can end after (the window before each leaf and branch point of the tree), least
  recently attached first; a page of such a window may also evict the oldest windows'.
  A page outside the windows that finds no room stays global-only.
A host page without local KV is global-only: the tree's matches end where a window is
complete (``tree_window``), so it is never a hit that would need it.

Layout: ``global_data[P, Lg, 2, S, H, D]`` and ``local_data[Q, Ll, 2, S, H, D]`` (page-first
within each group), scales ``[P, Lg, 2, H]`` / ``[Q, Ll, 2, H]`` for a quantized tier format.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from pallas_kernels.layout import KVLayout
from strata_jax.cache.local_pages import NO_LOCAL_PAGE, DeviceLocalPages
from strata_jax.cache.tier_format import TierFormat


def grouped_host_page_bytes(page_bytes: int, local_share: float, local_ratio: float) -> float:
    """Mean L2 bytes of a host page: its global layers' plus ``local_ratio`` of its local layers'."""
    return page_bytes * (1 - local_share + local_share * local_ratio)


class GroupedHostPool:
    """Page-first L2 pool with layer groups; ``local`` maps host page -> local host page."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        tier_format: TierFormat,
        local_layers: Sequence[bool],
        local_ratio: float,
    ) -> None:
        from strata_jax.cache.pools import numpy_dtype

        if len(local_layers) != layout.num_layers or not any(local_layers):
            raise ValueError("a grouped host pool needs one layer kind per layer, some of them local")
        if not 0 < local_ratio <= 1:
            raise ValueError(f"local_ratio must be in (0, 1], got {local_ratio}")
        self.layout, self.num_pages, self.format = layout, num_pages, tier_format
        mask = np.asarray(local_layers, bool)
        self.global_layers, self.local_layers = np.flatnonzero(~mask), np.flatnonzero(mask)
        self.num_local_pages = max(1, round(num_pages * local_ratio)) if num_pages else 0
        self.local = DeviceLocalPages(num_pages, self.num_local_pages)
        self.dtype = numpy_dtype(tier_format.element_dtype)
        tail = layout.page_first_shape(1)[2:]
        self.global_data = np.zeros((num_pages, len(self.global_layers), *tail), self.dtype)
        self.local_data = np.zeros((self.num_local_pages, len(self.local_layers), *tail), self.dtype)
        # set exactly when the format is quantized (``_scales``)
        self.global_scales: np.ndarray | None = None
        self.local_scales: np.ndarray | None = None
        if tier_format.quantized:
            heads = layout.num_kv_heads
            self.global_scales = np.ones((num_pages, len(self.global_layers), 2, heads), np.float32)
            self.local_scales = np.ones((self.num_local_pages, len(self.local_layers), 2, heads), np.float32)

    # ------------------------------------------------------------------ sizes
    @property
    def nbytes(self) -> int:
        arrays = (self.global_data, self.local_data, self.global_scales, self.local_scales)
        return sum(a.nbytes for a in arrays if a is not None)

    @property
    def page_bytes(self) -> float:
        """Mean bytes of one host page (global layers plus its share of the local pool)."""
        return self.nbytes / max(1, self.num_pages)

    # ------------------------------------------------------------------ local pages
    def has_local(self, page: int) -> bool:
        return self.local.has(page)

    def attach_local(self, pages: Sequence[int], windows: Collection[int] | None = None) -> None:
        """Give ``pages`` local host pages, from the free ones, then by evicting unpinned ones.

        ``windows``: the host pages inside the window before a point where a match can end
        (the tree's leaves and branch points, ``CacheController.host_window_pages``); the
        rest are evicted first, least recently attached first, and only pages of
        ``windows`` may evict pages of ``windows``.  A page left without one is global-only.
        Without ``windows`` every page counts as one (least recently attached first); when
        too few can be had the last of ``pages`` get them."""
        local = self.local
        want = [p for p in dict.fromkeys(pages) if not local.has(p)]
        free = local.map.free_pages
        if len(want) <= free:
            local.attach(want)
            return
        evictable = local.evictable_pages()
        if windows is None:
            windows = set(want) | set(evictable)
        new_window = [p for p in want if p in windows]
        new_rest = [p for p in want if p not in windows]
        rest_victims = [p for p in evictable if p not in windows]
        window_victims = [p for p in evictable if p in windows]
        # pages of windows take the free pages, then the others' local pages, then the oldest windows'
        take_window = new_window[max(0, len(new_window) - (free + len(rest_victims) + len(window_victims))) :]
        left = free + len(rest_victims) - len(take_window)  # what the others may still have
        take_rest = new_rest[max(0, len(new_rest) - left) :] if left > 0 else []
        short = len(take_window) + len(take_rest) - free
        if short > 0:
            local.evict((rest_victims + window_victims)[:short])
        local.attach(take_window + take_rest)

    def freed(self, pages: list[int]) -> None:
        """Host allocator listener: freed host pages give their local pages back."""
        self.local.freed(pages)

    # ------------------------------------------------------------------ writes
    def write(self, pages: Sequence[int], values: np.ndarray, scales: np.ndarray | None = None) -> None:
        """Full pages ``values[:n]`` (``[n, L, 2, S, H, D]``; ``scales[:n]`` ``[n, L, 2, H]`` for a
        quantized format) into ``pages`` (``HostPool.write``'s contract): every page's global
        layers, and the local layers of those that have a local page now."""
        n = len(pages)
        for layers in (self.global_layers, self.local_layers):
            group_scales = None if scales is None else scales[:n][:, layers]
            self.write_layers(pages, layers, values[:n][:, layers], group_scales)

    def write_layers(
        self, pages: Sequence[int], layers: np.ndarray, values: np.ndarray, scales: np.ndarray | None = None
    ) -> None:
        """One group's rows (a backup gathers each group apart): ``values[:n]`` of the
        ``layers`` group into ``pages``; the local group only into those pages that still
        have a local page (one evicted since its backup was issued is skipped)."""
        n = len(pages)
        if (scales is not None) != self.format.quantized:
            raise ValueError(f"tier format {self.format.name}: scales {'missing' if scales is None else 'unexpected'}")
        idx = np.asarray(pages, np.int64)
        if self._group(layers) == "global":
            self.global_data[idx] = values[:n]
            if scales is not None:
                self._scales("global")[idx] = scales[:n]
            return
        slots = self.local.local_ids(idx)
        keep = np.flatnonzero(slots != NO_LOCAL_PAGE)
        self.local_data[slots[keep]] = values[keep]
        if scales is not None:
            self._scales("local")[slots[keep]] = scales[keep]

    def write_slot(self, page: int, slot: int, values: np.ndarray, scales: np.ndarray | None, with_local: bool) -> None:
        """One full page (an L3 read) into ``page``; its local layers into ``slot`` (attached and
        pinned for it by the caller) when ``with_local``."""
        self.global_data[page] = values[self.global_layers]
        if scales is not None:
            self._scales("global")[page] = scales[self.global_layers]
        if with_local and slot != NO_LOCAL_PAGE:
            self.local_data[slot] = values[self.local_layers]
            if scales is not None:
                self._scales("local")[slot] = scales[self.local_layers]

    # ------------------------------------------------------------------ reads
    def _scales(self, group: str) -> np.ndarray:
        """The scales of the ``group`` (``"global"`` or ``"local"``) layers; a quantized pool only."""
        scales = self.global_scales if group == "global" else self.local_scales
        if scales is None:
            raise ValueError(f"tier format {self.format.name}: a full-width host pool has no scales")
        return scales

    def _group(self, layers: np.ndarray) -> str:
        if np.array_equal(layers, self.global_layers):
            return "global"
        if np.array_equal(layers, self.local_layers):
            return "local"
        raise ValueError(f"layers {layers.tolist()} are neither the global nor the local group")

    def _source(self, pages: Sequence[int], layers: np.ndarray, scales: bool) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(pages, np.int64)
        if self._group(layers) == "global":
            return (self._scales("global") if scales else self.global_data), idx
        slots = self.local.local_ids(idx).astype(np.int64)
        if (slots == NO_LOCAL_PAGE).any():
            raise ValueError("a host page without local-layer KV was read for its local layers")
        return (self._scales("local") if scales else self.local_data), slots

    def read_layers(self, pages: Sequence[int], layers: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The ``layers`` group (global or local) of ``pages`` into ``out[:n]``."""
        source, idx = self._source(pages, layers, scales=False)
        np.take(source, idx, axis=0, out=out[: len(idx)])
        return out

    def read_layer_scales(self, pages: Sequence[int], layers: np.ndarray, out: np.ndarray) -> np.ndarray:
        source, idx = self._source(pages, layers, scales=True)
        np.take(source, idx, axis=0, out=out[: len(idx)])
        return out

    def read(self, pages: Sequence[int]) -> np.ndarray:
        """Full pages ``[n, L, 2, S, H, D]`` (an L3 write): zeros in the local layers of a page
        without them (its object is flagged global-only)."""
        idx = np.asarray(pages, np.int64)
        out = np.zeros(self.layout.page_first_shape(len(idx)), self.dtype)
        out[:, self.global_layers] = self.global_data[idx]
        slots = self.local.local_ids(idx)
        keep = np.flatnonzero(slots != NO_LOCAL_PAGE)
        out[keep[:, None], self.local_layers[None, :]] = self.local_data[slots[keep]]
        return out

    def read_scales(self, pages: Sequence[int]) -> np.ndarray:
        idx = np.asarray(pages, np.int64)
        out = np.ones((len(idx), self.layout.num_layers, 2, self.layout.num_kv_heads), np.float32)
        out[:, self.global_layers] = self._scales("global")[idx]
        slots = self.local.local_ids(idx)
        keep = np.flatnonzero(slots != NO_LOCAL_PAGE)
        out[keep[:, None], self.local_layers[None, :]] = self._scales("local")[slots[keep]]
        return out

    def check(self, used_pages: Sequence[int]) -> None:
        self.local.check(used_pages)
