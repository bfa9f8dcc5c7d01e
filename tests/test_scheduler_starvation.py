"""No request waits forever (no jax): adversarial set-aside, deferral chains, random steady streams."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.scheduler import Scheduler, SchedulerConfig
from strata_jax.scheduler.testing import FakeCache, execute


def toks(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


def test_loading_bound_request_is_not_starved_by_a_stream_of_compute_bound_ones() -> None:
    # Every round brings compute-only requests that alone fill the batch; Algorithm 1 prefers
    # them over the loading-bound one, but it keeps its place and heads the next batch.
    sched = Scheduler(SchedulerConfig(max_batch_tokens=400, loading_bound_ratio=1.0))
    cache = FakeCache()
    cache.add_ready(toks(1, 3000), "host")
    sched.submit("c0", toks(2, 400))
    sched.submit("loader", toks(1, 3000) + [7])
    seed = 3
    scheduled_at = None
    for rnd in range(1, 6):
        for _ in range(3):
            sched.submit(f"c{seed}", toks(seed, 200))
            seed += 1
        plan = sched.schedule(cache)
        if "loader" in plan.prefill_ids:
            scheduled_at = rnd
            break
        execute(plan, sched, cache)
    assert scheduled_at == 2  # round 1: c0 (the head) fills the batch; round 2: loader is the head


def test_chain_of_deferrals_resolves_in_arrival_order() -> None:
    # r1 waits on r0's document, r2 on r1's longer one: each is served right after its owner.
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=8192)), FakeCache()
    base = toks(1, 500)
    prompts = {"r0": base + [1], "r1": base + toks(2, 300) + [2], "r2": base + toks(2, 300) + [3]}
    for rid, p in prompts.items():
        sched.submit(rid, p)
        cache.add_transient(rid, p)
    order = []
    for _ in range(6):
        plan = sched.schedule(cache)
        order.append(plan.prefill_ids)
        execute(plan, sched, cache, max_new_tokens=3)
    assert order[:3] == [("r0",), ("r1",), ("r2",)]
    assert sched.get("r2") is None or sched.get("r2").cached_tokens["device"] == 800
    assert not sched.has_work()


arrival = st.tuples(
    st.integers(0, 4),  # document id (shared prefixes)
    st.integers(0, 1200),  # document length used
    st.integers(1, 300),  # question length
    st.sampled_from(["device", "host", "storage", None]),  # where the document already is
    st.integers(1, 6),  # output tokens
)


@settings(max_examples=40, deadline=None)
@given(
    stream=st.lists(st.lists(arrival, max_size=3), min_size=1, max_size=25),
    policy=st.sampled_from(["strata", "fifo"]),
    ratio=st.sampled_from([None, 0.5, 5.0]),
    budget=st.sampled_from([512, 2048]),
)
def test_every_request_in_a_steady_stream_is_served_within_a_bounded_wait(stream, policy, ratio, budget) -> None:
    cfg = SchedulerConfig(policy=policy, max_batch_tokens=budget, loading_bound_ratio=ratio, max_prefill_batch_size=8)
    sched, cache = Scheduler(cfg), FakeCache(page_size=16)
    submitted: dict[str, int] = {}
    first: dict[str, int] = {}
    finished: set[str] = set()
    limits: dict[str, int] = {}
    work = 0
    rnd = 0
    while rnd < len(stream) or sched.has_work():
        if rnd < len(stream):
            for j, (doc_id, doc_len, q_len, tier, out) in enumerate(stream[rnd]):
                rid = f"r{rnd}_{j}"
                doc = toks(10 + doc_id, doc_len)
                if tier is not None and doc_len:
                    cache.add_ready(doc, tier)
                prompt = doc + toks(1000 + len(submitted), q_len)
                sched.submit(rid, prompt)
                cache.add_transient(rid, prompt)
                submitted[rid], limits[rid] = rnd, out
                work += -(-len(prompt) // budget) + out + 1
        plan = sched.schedule(cache)
        for rid in plan.prefill_ids:
            first.setdefault(rid, rnd)
        finished.update(execute(plan, sched, cache, max_new_tokens=limits))
        rnd += 1
        assert rnd <= len(stream) + work + 5, "the stream did not drain: some request waits forever"
    assert finished == set(submitted)
    # A request's wait is bounded by the work that arrived before it (FIFO-like), never unbounded.
    for rid, t0 in submitted.items():
        ahead = sum(1 for r, t in submitted.items() if t <= t0)
        assert first[rid] - t0 <= ahead * (1 + -(-(1200 + 300) // budget)) + 2
    assert all(sched.get(r) is None for r in submitted)
    stats = sched.stats()
    assert stats.finished == len(submitted) and stats.waiting == stats.deferred == 0
    if policy == "fifo":
        assert stats.deferrals == 0 and stats.set_asides == 0 and stats.decode_first_rounds == 0
