"""The systems a simulation compares, by name: scheduler stages, I/O path, tiers.

* ``l1-only``: radix cache on the device only; a miss is recomputed (FIFO).
* ``hicache``: SGLang HiCache: L1 + L2, layer-wise overlap, the naive per-page
  per-layer I/O path, FIFO scheduling.
* ``+gpu-io``: HiCache with this project's coalesced I/O (Strata's GPU-assisted I/O).
* ``+delay-hit``, ``+balanced-batch``: then each Strata scheduler stage, one at a time.
* ``strata``: coalesced I/O and every Strata stage (the above + bubble filling).
* ``strata+lor``: strata plus load-or-recompute (a stage beyond the paper).

Short prefills first (``SchedulerConfig.short_prefill_tokens``, on in the engine) is off
in every system here: they reproduce the paper's stages.

Each system is a real ``SchedulerConfig`` and ``CacheConfig`` setting: the
simulator runs the same scheduler and controller the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_jax.cache.config import Tiers
from strata_jax.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class SystemSpec:
    name: str
    policy: str = "strata"
    io_path: str = "coalesced"
    layerwise: bool = True
    tiers: Tiers = "L1+L2"
    delay_hit: bool = False
    balanced_batch: bool = False
    bubble_filling: bool = False
    load_or_recompute: bool = False
    short_first: bool = False

    def scheduler_kwargs(self) -> dict:
        return dict(
            policy=self.policy,
            enable_delay_hit=self.delay_hit,
            enable_balanced_batch=self.balanced_batch,
            enable_bubble_filling=self.bubble_filling,
            enable_load_or_recompute=self.load_or_recompute,
            short_prefill_tokens=SchedulerConfig.short_prefill_tokens if self.short_first else 0,
        )


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("l1-only", policy="fifo", tiers="L1"),
        SystemSpec("hicache", policy="fifo", io_path="naive"),
        SystemSpec("+gpu-io", policy="fifo"),
        SystemSpec("+delay-hit", delay_hit=True),
        SystemSpec("+balanced-batch", delay_hit=True, balanced_batch=True),
        SystemSpec("strata", delay_hit=True, balanced_batch=True, bubble_filling=True),
        SystemSpec("strata+lor", delay_hit=True, balanced_batch=True, bubble_filling=True, load_or_recompute=True),
    )
}
ABLATION_ORDER = ("hicache", "+gpu-io", "+delay-hit", "+balanced-batch", "strata", "strata+lor")


def get_system(name: str) -> SystemSpec:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}") from None
