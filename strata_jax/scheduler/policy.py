"""Scheduler policies by name, and the two batch-formation procedures.

A policy is a function ``SchedulerConfig -> Stages`` in a small registry:

* ``strata``: the stages the config enables (delay-hit deferral, balanced batch
  formation = Strata Algorithm 1, bubble filling, and load-or-recompute, a stage
  beyond the paper); each can be switched on or off.
  Short prefills that load nothing (``short_prefill_tokens``) go ahead
  of the continuing chunks of long prompts.
* ``fifo``: the baseline: take requests in order until the batch is full; no
  deferral, no set-aside, no short-first, prefill before decode (as SGLang does).

Batch formation works on a ``RoundQueue`` and a ``BatchBuilder``:
``form_in_order`` (fifo, and strata without balanced batching) and
``form_balanced`` (Algorithm 1, docs/design.md §4):

    batch = [queue.pop_head()]; pull_bundle(batch)        # head first: no starvation
    set_aside = []
    while queue and batch has room:
        r = queue.pop_head()
        if batch.would_be_loading_bound(r): set_aside.append(r)
        else: batch.add(r); pull_bundle(batch)
    for r in set_aside (original order): if batch has room: batch.add(r)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata_jax.scheduler.batch import BatchBuilder, Candidate
from strata_jax.scheduler.plan import PrefillItem
from strata_jax.scheduler.queue import RoundQueue

if TYPE_CHECKING:
    from strata_jax.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class Stages:
    """Which Strata stages run."""

    delay_hit: bool
    balanced_batch: bool
    bubble_filling: bool
    load_or_recompute: bool = False
    short_first: bool = False  # short prefills that load nothing share continuing chunks' steps
    mixed_steps: bool = False  # decode rows ride in the prefill chunk's program when the cost model says so


def _strata(config: SchedulerConfig) -> Stages:
    return Stages(
        config.enable_delay_hit,
        config.enable_balanced_batch,
        config.enable_bubble_filling,
        config.enable_load_or_recompute,
        short_first=config.short_prefill_tokens > 0,
        mixed_steps=config.enable_mixed_steps,
    )


def _fifo(config: SchedulerConfig) -> Stages:
    return Stages(delay_hit=False, balanced_batch=False, bubble_filling=False)


_REGISTRY: dict[str, Callable[[SchedulerConfig], Stages]] = {"strata": _strata, "fifo": _fifo}


def available_policies() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def resolve_stages(config: SchedulerConfig) -> Stages:
    """The stages ``config.policy`` runs under ``config``'s flags."""
    return _REGISTRY[config.policy](config)


@dataclass
class FormResult:
    """Counters of one batch formation (for stats and the plan)."""

    set_aside: list[str]
    bundle_hits: int = 0


def form_in_order(queue: RoundQueue, batch: BatchBuilder) -> FormResult:
    """Take requests in queue order until the batch is full or one does not fit."""
    while batch.has_room():
        cand = queue.pop_head()
        if cand is None or batch.try_add(cand) is None:
            break  # strict order: nothing jumps a request that does not fit
        queue.admit(cand)
    return FormResult(set_aside=[])


def form_balanced(queue: RoundQueue, batch: BatchBuilder) -> FormResult:
    """Strata Algorithm 1: head first, set aside loading-bound requests, pull bundle hits, backfill."""
    result = FormResult(set_aside=[])
    if not batch.has_room():
        return result
    head = queue.pop_head()
    if head is None:
        return result
    item = batch.try_add(head)
    if item is None:
        return result  # the head waits for room; nobody overtakes it (no starvation)
    queue.admit(head)
    result.bundle_hits += _pull_bundle(queue, batch, item)
    set_aside: list[Candidate] = []
    while batch.has_room():
        cand = queue.pop_head()
        if cand is None:
            break
        if batch.would_be_loading_bound(cand):
            set_aside.append(cand)
            result.set_aside.append(cand.request.request_id)
        elif (item := batch.try_add(cand)) is not None:
            queue.admit(cand)
            result.bundle_hits += _pull_bundle(queue, batch, item)
        # else: it does not fit on the device now; it keeps its place in the queue
    for cand in set_aside:
        if not batch.has_room():
            break
        if batch.try_add(cand, set_aside=True) is not None:
            queue.admit(cand)
    return result


def _pull_bundle(queue: RoundQueue, batch: BatchBuilder, added: PrefillItem) -> int:
    """Move every queued request whose whole load the batch already performs into the batch.

    Only a member that loads can create bundle hits, and the requests pulled add
    no load themselves, so one scan against the member just ``added`` suffices.
    """
    if added.load_tokens == 0:
        return 0
    pulled = 0
    for cand in list(queue.rest()):
        if not batch.has_room():
            break
        if batch.is_bundle_hit(cand, by=added) and batch.try_add(cand, bundled=True) is not None:
            queue.admit(cand)
            pulled += 1
    return pulled


FORMERS: dict[bool, Callable[[RoundQueue, BatchBuilder], FormResult]] = {True: form_balanced, False: form_in_order}
