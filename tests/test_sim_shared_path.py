"""The simulator runs the engine's own code path: the same workload through the real tiny
model (JaxExecutor) and through SimExecutor, with the simulated step times set to the
measured ones, yields the same scheduling decisions (batches, chunks, deferrals, decode
batches, bubble-filling order), step for step."""

from __future__ import annotations

import random

import pytest

from strata_jax.api import SamplingParams
from strata_jax.engine.core import EngineCore
from strata_jax.engine.executor import StepOutput
from strata_jax.engine.requests import TrackedRequest
from strata_jax.engine.sinks import CollectingSink


class _Recording:
    """Wraps an executor and records the seconds every step took, by kind."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.extend_s: list[float] = []
        self.decode_s: list[float] = []
        self._kinds: dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def dispatch_extend(self, work, loads):
        pending = self.inner.dispatch_extend(work, loads)
        self._kinds[id(pending)] = "extend"
        return pending

    def dispatch_decode(self, rows):
        pending = self.inner.dispatch_decode(rows)
        self._kinds[id(pending)] = "decode"
        return pending

    def collect(self, pending) -> StepOutput:
        out = self.inner.collect(pending)
        assert out.seconds is not None  # the serial loop waits for every step it collects
        (self.extend_s if self._kinds.pop(id(pending)) == "extend" else self.decode_s).append(out.seconds)
        return out


def _workload(vocab: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(7)
    doc = [rng.randrange(3, vocab) for _ in range(300)]
    other = [rng.randrange(3, vocab) for _ in range(200)]
    reqs = []
    for i in range(4):  # four questions on one document: three are deferred behind the first
        reqs.append((f"q{i}", doc + [rng.randrange(3, vocab) for _ in range(5 + i)], 6 + i))
    reqs.append(("solo", other, 5))
    reqs.append(("short", [rng.randrange(3, vocab) for _ in range(20)], 12))
    return reqs


@pytest.mark.slow
def test_sim_executor_reproduces_the_engines_decisions():
    from strata_jax.engine import Engine, EngineConfig

    # The serial loop on both sides: a pipelined real engine learns a step's time only when it
    # had to wait for it, which depends on the machine; the decisions would too.
    engine = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            page_size=16,
            device_tokens=4096,
            max_batch_tokens=128,
            max_batch_size=8,
            pipeline=False,
        ),
        start=False,
    )
    try:
        rec = _Recording(engine.executor)
        engine.core.executor = rec
        engine.core.plan_log = []
        work = _workload(engine.vocab_size)
        sinks = {}
        for rid, prompt, n in work:
            sinks[rid] = CollectingSink()
            engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid, sink=sinks[rid])
        engine.run_until_idle()
        outputs = {rid: [t for c in s.chunks for t in c.token_ids] for rid, s in sinks.items()}
        real_plans = engine.core.plan_log
        cache_config, sched_config, prior = engine.ctl.config, engine.scheduler.config, engine.scheduler.cost.prior
        eos, max_ctx = engine.eos_token_ids, engine.max_context_tokens
    finally:
        engine.shutdown()
    assert any(p.deferred for p in real_plans), "the workload must exercise delay-hit deferral"
    assert sum(1 for p in real_plans if p.prefill) > 3 and any(len(p.decode) > 1 for p in real_plans)

    from strata_jax.cache.controller import CacheController
    from strata_jax.scheduler.cost_model import CostModel
    from strata_jax.scheduler.scheduler import Scheduler
    from strata_jax.sim.cost import SimCostModel
    from strata_jax.sim.executor import SimClock, SimExecutor, SimTimer, StepTimes
    from strata_jax.sim.model_spec import load_model_spec
    from strata_jax.sim.profile import load_profile

    clock = SimClock()
    cost = SimCostModel(load_profile("h200"), load_model_spec("llama-3.1-8b"), cache_config.page_size)
    timer = SimTimer(clock, cost, "coalesced")
    ctl = CacheController.simulated(cache_config, clock=clock.now, timer=timer, page_bytes=4096)
    executor = SimExecutor(
        clock,
        cost,
        timer,
        layerwise=True,
        token_for=lambda rid, i: outputs[rid][i],
        replay=StepTimes(rec.extend_s, rec.decode_s),
    )
    core = EngineCore(
        Scheduler(sched_config, CostModel(prior)),
        ctl,
        executor,
        eos_token_ids=eos,
        max_context_tokens=max_ctx,
        pipeline=False,
    )
    core.plan_log = []
    for rid, prompt, n in work:
        core.admit(
            TrackedRequest(rid, prompt, "", SamplingParams(max_tokens=n, ignore_eos=True), CollectingSink(), None, 0.0)
        )
    while core.scheduler.has_work() or core.has_pending_step():
        core.step()
    assert core.plan_log == real_plans
    assert not executor.replay.extend and not executor.replay.decode  # every measured step was used once
