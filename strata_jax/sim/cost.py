"""``SimCostModel``: how long a step or a transfer takes on a ``HardwareProfile`` for a ``ModelSpec``.

* Extend (prefill) of a batch: FLOPs at the matmul rate (``2 x body params`` per
  new token: a mixture-of-experts model's active ones, ``ModelSpec.body_params``; the LM
  head once per sequence) plus attention over the cached
  context (``4 x layers x heads x head_dim`` per attended query-key pair, with
  ``n_i * (ctx_i + n_i / 2)`` pairs for ``n_i`` new tokens on ``ctx_i`` cached ones)
  at the attention rate, plus the step overhead and TP all-reduces.
* Decode step: the larger of bytes (weights + the KV read of every sequence) over
  effective HBM bandwidth and FLOPs over the matmul rate, plus overheads (and
  ``decode_row_s`` per row; an extend step adds ``extend_overhead_s``: both 0 on the GPU
  profiles, measured on a CPU by ``bench twin``).  The weights read are
  ``ModelSpec.step_weight_bytes(batch)``: all of a dense model's; of a mixture-of-experts
  model the non-expert weights and the expected union of the experts the batch's tokens
  pick (the active weights at batch 1, nearly every expert at large batch).  L1's capacity
  is what HBM has left after all weights (``weight_bytes``, every expert).  An extend step
  is priced by its FLOPs alone, dense or MoE, as before: its weight read is not charged
  (a MoE prefill of ~50 tokens reads nearly every expert once).
* Host<->device transfers by path: ``naive`` moves every page's K and V of every
  layer as its own copy (``copies x (overhead + copy_bytes / peak)``: ~22% of
  PCIe 5.0 for 64 KiB copies); ``coalesced`` moves one contiguous buffer at
  ``coalesced_efficiency`` of peak after a fixed overhead.
* Storage reads and writes at their bandwidths.
* ``tier_format`` (``full``, ``fp8``, ``int8``): the format of L2 and L3, so a load or a
  storage read moves ``ModelSpec.tier_page_bytes`` per page and L2 holds
  ``host_kv_bytes`` over the tier's bytes per token; the dequantization runs inside the
  on-device scatter at HBM speed and is not charged (nor is the scatter itself).
* ``window_loads`` (models with sliding-window layers, e.g. ``gemma-3-27b``): a load or a
  storage read of ``n`` pages moves ``ModelSpec.load_share(n)`` of them: all layers'
  pages for full-attention layers, the window's last pages for the others (what a
  window-aware hierarchy moves: the engine's with ``kv_layer_groups``, every layer without).
  Attention of a windowed layer counts at most ``window`` keys per query either way (the
  kernels skip older blocks).  ``storage_window_reads`` (default: as ``window_loads``) says
  whether storage reads shrink too: False for the engine as it is, whose L3 objects hold
  every layer of a page (docs/models.md), so an L3 read moves whole pages while the L2->L1
  load after it moves only the windows.
* ``cached_share`` (window-aware capacity, with ``window_loads`` in the simulator): a cached
  page costs that share of a full page in L1 and L2 (``ModelSpec.cached_share``: every
  page's global layers, the windowed layers' pages only in the window before a cached
  sequence's end), so both hold ``1 / cached_share`` times the tokens.
All figures are per tensor-parallel rank (each rank has its own link).
"""

from __future__ import annotations

from collections.abc import Iterable

from strata_jax.sim.model_spec import ModelSpec
from strata_jax.sim.profile import HardwareProfile

IO_PATHS = ("naive", "coalesced")


class SimCostModel:
    def __init__(
        self,
        profile: HardwareProfile,
        model: ModelSpec,
        page_size: int,
        tier_format: str = "full",
        window_loads: bool = False,
        cached_share: float = 1.0,
        storage_window_reads: bool | None = None,
    ) -> None:
        if not 0.0 < cached_share <= 1.0:
            raise ValueError(f"cached_share must be in (0, 1], got {cached_share!r}")
        self.profile = profile
        self.model = model
        self.page_size = page_size
        self.tier_format = tier_format
        self.window_loads = window_loads
        self.storage_window_reads = window_loads if storage_window_reads is None else storage_window_reads
        self.cached_share = cached_share
        self.tier_page_bytes = model.tier_page_bytes(page_size, tier_format)
        self._tier_share = self.tier_page_bytes / model.page_bytes(page_size)  # of a full-width page
        c = model.config
        self._linear_flops_per_token = 2.0 * model.body_params / model.tp
        self._head_flops = 2.0 * model.lm_head_params / model.tp
        self._attn_flops_per_pair = 4.0 * c.num_layers * (c.num_heads / model.tp) * c.head_dim
        self._mm_rate = profile.matmul_flops_per_s * profile.matmul_efficiency
        self._attn_rate = profile.matmul_flops_per_s * profile.attention_efficiency
        self._hbm_rate = profile.hbm_bytes_per_s * profile.hbm_efficiency
        self._fixed = profile.step_overhead_s + (
            profile.tp_allreduce_s_per_layer * 2 * c.num_layers if model.tp > 1 else 0.0
        )

    # -- compute -------------------------------------------------------------
    def extend_seconds(self, items: Iterable[tuple[int, int]]) -> float:
        """A prefill step over ``(new_tokens, cached_context)`` per sequence."""
        new = seqs = 0
        pairs = 0.0
        for n, ctx in items:
            new += n
            seqs += 1
            pairs += self.model.attention_pairs(n, ctx)
        if new == 0:
            return 0.0
        linear = (new * self._linear_flops_per_token + seqs * self._head_flops) / self._mm_rate
        fixed = self._fixed + self.profile.extend_overhead_s
        return fixed + linear + pairs * self._attn_flops_per_pair / self._attn_rate

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences reading ``context_tokens`` KV tokens in all."""
        if batch <= 0:
            return 0.0
        read = self.model.step_weight_bytes(batch) + context_tokens * self.model.kv_bytes_per_token
        flops = batch * (self._linear_flops_per_token + self._head_flops)  # attention is in the KV read
        rows = batch * self.profile.decode_row_s
        return self._fixed + max(read / self._hbm_rate, flops / self._mm_rate) + rows

    # -- transfers -----------------------------------------------------------
    def link_seconds(self, num_pages: int, path: str) -> float:
        """Host<->device copy of ``num_pages`` pages over the ``naive`` or ``coalesced`` path."""
        if num_pages <= 0:
            return 0.0
        p = self.profile
        share = self._load_share(num_pages)
        if path == "naive":
            copies = num_pages * self.model.config.num_layers * 2 * share
            copy_bytes = self.model.copy_bytes(self.page_size) * self._tier_share
            return copies * (p.naive_copy_overhead_s + copy_bytes / p.link_peak_bytes_per_s)
        if path == "coalesced":
            nbytes = num_pages * self.tier_page_bytes * share
            return p.transfer_overhead_s + nbytes / (p.link_peak_bytes_per_s * p.coalesced_efficiency)
        raise ValueError(f"io path must be one of {IO_PATHS}, got {path!r}")

    def link_efficiency(self, num_pages: int, path: str) -> float:
        """Achieved share of link peak for a transfer of ``num_pages`` pages."""
        t = self.link_seconds(num_pages, path)
        moved = num_pages * self.tier_page_bytes * self._load_share(num_pages)
        return 0.0 if t == 0 else moved / t / self.profile.link_peak_bytes_per_s

    def storage_read_seconds(self, num_pages: int) -> float:
        share = self._load_share(num_pages) if self.storage_window_reads else 1.0
        return num_pages * self.tier_page_bytes * share / self.profile.storage_read_bytes_per_s

    def _load_share(self, num_pages: int) -> float:
        return self.model.load_share(num_pages, self.page_size) if self.window_loads else 1.0

    # -- memory --------------------------------------------------------------
    def device_kv_tokens(self) -> int:
        """L1 capacity: HBM share for weights + KV, minus the weights, in tokens (of cached
        sequences at ``cached_share`` of a full token's bytes)."""
        p = self.profile
        free = p.hbm_bytes * p.kv_memory_fraction - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} (tp={self.model.tp}) does not fit in {p.name}'s HBM")
        return int(free // (self.model.kv_bytes_per_token * self.cached_share))

    def host_kv_tokens(self) -> int:
        """L2 capacity in tokens: the profile's host bytes in the tier format (at ``cached_share``)."""
        return int(self.profile.host_kv_bytes // (self.tier_page_bytes / self.page_size * self.cached_share))
