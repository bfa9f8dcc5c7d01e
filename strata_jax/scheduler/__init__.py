"""Control plane: request queues, the Strata policy and the FIFO baseline, step plans.

Pure Python (no jax/numpy).  See docs/scheduler.md.
"""

from strata_jax.scheduler.cache_view import CacheView, PrefixMatchLike, StaticMatch
from strata_jax.scheduler.config import SchedulerConfig, SchedulerConfigError
from strata_jax.scheduler.cost_model import CostModel, CostPrior
from strata_jax.scheduler.errors import SchedulerStateError, UnknownRequestError
from strata_jax.scheduler.plan import PrefillItem, SchedulerStats, StepPlan
from strata_jax.scheduler.policy import Stages, available_policies, resolve_stages
from strata_jax.scheduler.request import RequestStatus, ScheduledRequest
from strata_jax.scheduler.scheduler import Scheduler

__all__ = [
    "CacheView",
    "CostModel",
    "CostPrior",
    "PrefillItem",
    "PrefixMatchLike",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerStateError",
    "SchedulerStats",
    "Stages",
    "StaticMatch",
    "StepPlan",
    "UnknownRequestError",
    "available_policies",
    "resolve_stages",
]
