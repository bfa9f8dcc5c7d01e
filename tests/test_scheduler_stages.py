"""The Strata stages on hand-built queues (no jax): delay-hit deferral, Algorithm 1, bubble filling, fifo."""

from __future__ import annotations

import pytest

from strata_jax.scheduler import CostModel, CostPrior, RequestStatus, Scheduler, SchedulerConfig
from strata_jax.scheduler.policy import resolve_stages
from strata_jax.scheduler.scheduler import PREFETCH_PACE_SLACK
from strata_jax.scheduler.testing import FakeCache, execute


def doc(seed: int, n: int) -> list[int]:
    """A document of ``n`` tokens, disjoint from other seeds' documents."""
    return [seed * 100_000 + i for i in range(n)]


def q(seed: int, n: int = 20) -> list[int]:
    return [9_000_000 + seed * 1000 + i for i in range(n)]


def submit_uncached(sched: Scheduler, cache: FakeCache, rid: str, tokens: list[int]):
    """Submit a request and insert its uncomputed prompt as transient nodes, as the engine does."""
    req = sched.submit(rid, tokens)
    cache.add_transient(rid, tokens)
    return req


# ---------------------------------------------------------------- delay hit


def test_second_request_on_same_new_document_is_deferred_then_hits() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=4096)), FakeCache()
    a = submit_uncached(sched, cache, "a", doc(1, 1000) + q(1))
    b = submit_uncached(sched, cache, "b", doc(1, 1000) + q(2))

    p1 = sched.schedule(cache)
    assert p1.prefill_ids == ("a",)
    assert p1.deferred == ("b",)
    assert b.status is RequestStatus.DEFERRED
    assert sched.queue_order() == ("b",)
    assert sched.stats().deferrals == 1

    execute(p1, sched, cache, max_new_tokens=4)  # a's prefill lands: the document is now a device hit
    p2 = sched.schedule(cache)
    assert p2.prefill_ids == ("b",)
    (item,) = p2.prefill
    assert (item.start, item.device_hit_tokens, item.end) == (1000, 1000, 1020)
    assert b.cached_tokens == {"device": 1000, "host": 0, "storage": 0}
    assert p2.decode_ids == ("a",)
    assert a.status is RequestStatus.DECODING
    assert sched.stats().deferrals == 1  # one deferral episode


@pytest.mark.parametrize("config", [SchedulerConfig(policy="fifo"), SchedulerConfig(enable_delay_hit=False)])
def test_without_delay_hit_both_recompute_the_document(config: SchedulerConfig) -> None:
    sched, cache = Scheduler(config), FakeCache()
    submit_uncached(sched, cache, "a", doc(1, 1000) + q(1))
    submit_uncached(sched, cache, "b", doc(1, 1000) + q(2))
    p1 = sched.schedule(cache)
    assert p1.prefill_ids == ("a", "b") and p1.deferred == ()
    assert [i.start for i in p1.prefill] == [0, 0]
    assert sched.stats().recomputed_prompt_tokens == 2040


def test_delay_hit_recomputes_fewer_tokens_than_fifo() -> None:
    recomputed = {}
    for policy in ("strata", "fifo"):
        sched, cache = Scheduler(SchedulerConfig(policy=policy)), FakeCache()
        for i in range(4):
            submit_uncached(sched, cache, f"r{i}", doc(1, 800) + q(i))
        for _ in range(10):
            execute(sched.schedule(cache), sched, cache, max_new_tokens=2)
        assert not sched.has_work()
        recomputed[policy] = sched.stats().recomputed_prompt_tokens
    assert recomputed["strata"] == 800 + 4 * 20
    assert recomputed["fifo"] == 4 * 820


def test_short_transient_overlap_is_not_deferred() -> None:
    sched, cache = Scheduler(SchedulerConfig(delay_hit_threshold=100)), FakeCache()
    submit_uncached(sched, cache, "a", doc(1, 100) + q(1))  # only 100 shared tokens: not > threshold
    submit_uncached(sched, cache, "b", doc(1, 100) + q(2))
    assert sched.schedule(cache).prefill_ids == ("a", "b")


def test_deferral_waits_for_a_chunked_owner_and_only_behind_earlier_requests() -> None:
    # a's document takes 3 chunks; b waits for all of them, then hits the whole document.
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=500)), FakeCache()
    submit_uncached(sched, cache, "a", doc(1, 1200) + q(1))
    submit_uncached(sched, cache, "b", doc(1, 1200) + q(2))
    seen = []
    for _ in range(4):
        plan = sched.schedule(cache)
        seen.append((plan.prefill_ids, plan.deferred))
        execute(plan, sched, cache, max_new_tokens=8)
    # a is never deferred on b (b arrived later); b is not batched (deferred, or not even
    # reached while a's chunks fill the budget) until a's prefill completes.
    assert [ids for ids, _ in seen[:3]] == [("a",)] * 3
    assert seen[3][0] == ("b",)
    assert sched.get("b").cached_tokens["device"] == 1200


def test_owner_abort_releases_the_deferred_request() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=2000)), FakeCache()
    submit_uncached(sched, cache, "a", doc(1, 1000) + q(1))
    submit_uncached(sched, cache, "b", doc(1, 1000) + q(2))
    plan = sched.schedule(cache)
    assert plan.deferred == ("b",)
    assert sched.abort("a") is RequestStatus.PREFILLING
    assert sched.on_prefill_dispatched("a", 1) is RequestStatus.ABORTED
    cache.drop("a")  # the engine removes a's transient nodes
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("b",) and plan.deferred == ()
    assert plan.prefill[0].start == 0  # nothing to hit: b computes the document itself


# ---------------------------------------------------------------- short prefills first


def two_documents_with_siblings(config: SchedulerConfig) -> tuple[Scheduler, FakeCache, list]:
    """Documents 1 and 2 (1200 tokens each), two questions on each, all arriving at once; plays
    the rounds until document 1's first question has its first token.  Returns the plans."""
    sched, cache = Scheduler(config), FakeCache()
    for rid, tokens in (
        ("a1", doc(1, 1200) + q(1)),
        ("a2", doc(1, 1200) + q(2)),
        ("b1", doc(2, 1200) + q(3)),
        ("b2", doc(2, 1200) + q(4)),
    ):
        submit_uncached(sched, cache, rid, tokens)
    plans = []
    while sched.get("a1").num_output_tokens == 0:
        plans.append(sched.schedule(cache))
        execute(plans[-1], sched, cache, max_new_tokens=64)
    return sched, cache, plans


def test_a_deferred_sibling_goes_ahead_of_the_next_documents_chunks() -> None:
    sched, cache, plans = two_documents_with_siblings(SchedulerConfig(max_batch_tokens=512))
    # a1's 1220 tokens: 512, 512, then its last 196 with b1's first 316.
    assert [[(i.request_id, i.new_tokens) for i in p.prefill] for p in plans] == [
        [("a1", 512)],
        [("a1", 512)],
        [("a1", 196), ("b1", 316)],
    ]
    plan = sched.schedule(cache)  # b1's chunk leaves room for a2 (20 tokens over a1's document on the device)
    assert [(i.request_id, i.start, i.new_tokens) for i in plan.prefill] == [("b1", 316, 492), ("a2", 1200, 20)]
    assert plan.prefill[1].device_hit_tokens == 1200


def test_without_short_first_the_sibling_waits_for_the_continuing_chunks() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=512, short_prefill_tokens=0)), FakeCache()
    for rid, tokens in (("a1", doc(1, 1200) + q(1)), ("a2", doc(1, 1200) + q(2)), ("b1", doc(2, 1200) + q(3))):
        submit_uncached(sched, cache, rid, tokens)
    for _ in range(3):
        execute(sched.schedule(cache), sched, cache, max_new_tokens=64)
    plan = sched.schedule(cache)
    assert [(i.request_id, i.new_tokens) for i in plan.prefill] == [("b1", 512)]  # a2 waits behind b1's chunks
    assert not resolve_stages(SchedulerConfig(policy="fifo")).short_first  # the baseline never reorders


def test_short_first_skips_loads_and_long_prompts_and_takes_at_most_half_the_budget() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=100, short_prefill_tokens=30)), FakeCache()
    cache.add_ready(doc(3, 64), "host")
    submit_uncached(sched, cache, "long", doc(1, 400))
    execute(sched.schedule(cache), sched, cache)  # long is now a continuing prefill
    sched.submit("loads", doc(3, 64) + q(1, 10))  # short to compute, but loads its prefix from the host
    sched.submit("big", q(2, 31))  # over the threshold
    for i in range(4):
        sched.submit(f"s{i}", q(10 + i, 20))
    plan = sched.schedule(cache)
    # long's chunk leaves 40 of the 50 tokens short prefills may take to s0 and s1.
    assert [(i.request_id, i.new_tokens) for i in plan.prefill] == [("long", 60), ("s0", 20), ("s1", 20)]
    assert sched.queue_order()[:2] == ("loads", "big")  # the skipped keep their places


@pytest.mark.parametrize("batch_size,admitted", [(2, ("long",)), (3, ("short", "long"))])
def test_short_first_looks_only_at_the_first_batch_size_candidates(batch_size: int, admitted: tuple) -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=100, max_prefill_batch_size=batch_size)), FakeCache()
    submit_uncached(sched, cache, "long", doc(1, 400))
    execute(sched.schedule(cache), sched, cache)
    for i in (1, 2):
        sched.submit(f"new{i}", q(i, 300))
    sched.submit("short", q(9, 20))  # third in the queue
    assert set(sched.schedule(cache).prefill_ids) == set(admitted)  # long's chunk fills the rest


def test_short_prefills_never_take_the_continuing_chunks_slots_or_pages() -> None:
    """A queue full of short prompts cannot stop a long prompt mid-prefill: it keeps a batch
    slot and the first claim on device pages."""
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=100, max_prefill_batch_size=2)), FakeCache()
    submit_uncached(sched, cache, "long", doc(1, 400))
    execute(sched.schedule(cache), sched, cache)
    for round_ in range(3):
        for i in range(2):
            sched.submit(f"s{round_}{i}", q(10 * round_ + i, 20))
        plan = sched.schedule(cache)
        got = [(i.request_id, i.new_tokens) for i in plan.prefill]
        assert got[0] == ("long", 80) and len(got) == 2 and got[1][1] == 20  # the oldest short one beside it
        execute(plan, sched, cache)
    assert sched.get("long").computed == 100 + 3 * 80
    # little device room: the long prompt's chunk first, the short one only in what is left
    sched2, cache2 = Scheduler(SchedulerConfig(max_batch_tokens=100)), FakeCache(free_tokens=1 << 30)
    submit_uncached(sched2, cache2, "long", doc(1, 400))
    execute(sched2.schedule(cache2), sched2, cache2)
    sched2.submit("s", q(1, 20))
    cache2.free_tokens = 80
    plan = sched2.schedule(cache2)
    assert [(i.request_id, i.new_tokens) for i in plan.prefill] == [("long", 80)]


def test_short_prefill_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="short_prefill_tokens"):
        SchedulerConfig(short_prefill_tokens=-1)


# ---------------------------------------------------------------- Algorithm 1


def algorithm1_queue(sched: Scheduler, cache: FakeCache) -> None:
    """h: head, loads D0 (400 host) for 50 new; r1 and r6 load 800 and 2000 for little compute;
    r2, r3, r5 compute only; b shares h's load (a bundle hit) and sits at the back."""
    cache.add_ready(doc(0, 400), "host")
    cache.add_ready(doc(1, 800), "host")
    cache.add_ready(doc(2, 2000), "host")
    sched.submit("h", doc(0, 400) + q(0, 50))
    sched.submit("r1", doc(1, 800) + q(1, 20))
    sched.submit("r2", q(2, 300))
    sched.submit("r3", q(3, 200))
    sched.submit("r5", q(5, 100))
    sched.submit("r6", doc(2, 2000) + q(6, 50))
    sched.submit("b", doc(0, 400) + q(7, 30))


def test_algorithm1_head_first_bundle_hits_set_aside_and_backfill() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=700, loading_bound_ratio=2.0)), FakeCache()
    algorithm1_queue(sched, cache)
    plan = sched.schedule(cache)
    # head first (though loading-bound itself), its bundle hit right after it, compute-bound
    # requests in order, then the set-aside requests in order while room is left.
    assert plan.prefill_ids == ("h", "b", "r2", "r3", "r5", "r1")
    by_id = {i.request_id: i for i in plan.prefill}
    assert by_id["b"].bundled and not by_id["r2"].bundled
    assert by_id["r1"].set_aside and not by_id["r2"].set_aside
    assert plan.set_aside == ("r1", "r6")
    assert sum(i.new_tokens for i in plan.prefill) == 700
    assert [i.request_id for i in plan.loads] == ["h", "b", "r1"]
    assert plan.est_load_s == pytest.approx(sched.cost.load_seconds(400 + 800))  # b shares h's load
    # r6 did not fit: it keeps its place and heads the next batch.
    assert sched.queue_order() == ("r6",)
    execute(plan, sched, cache, max_new_tokens=5)
    assert sched.schedule(cache).prefill_ids == ("r6",)
    stats = sched.stats()
    assert (stats.set_asides, stats.bundle_hits) == (2, 1)


def test_fifo_takes_the_same_queue_in_order() -> None:
    sched, cache = Scheduler(SchedulerConfig(policy="fifo", max_batch_tokens=700, loading_bound_ratio=2.0)), FakeCache()
    algorithm1_queue(sched, cache)
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("h", "r1", "r2", "r3", "r5", "r6")
    assert plan.prefill[-1].new_tokens == 30 and not plan.prefill[-1].is_last_chunk  # chunked to the budget
    assert plan.set_aside == () and not any(i.bundled for i in plan.prefill)
    assert sched.queue_order() == ("b",)


def test_balanced_batch_off_fills_in_order_but_still_defers() -> None:
    cfg = SchedulerConfig(max_batch_tokens=700, loading_bound_ratio=2.0, enable_balanced_batch=False)
    sched, cache = Scheduler(cfg), FakeCache()
    algorithm1_queue(sched, cache)
    assert sched.schedule(cache).prefill_ids == ("h", "r1", "r2", "r3", "r5", "r6")


def test_loading_bound_predicate_from_the_cost_model() -> None:
    # No fixed ratio: load time (bytes / bandwidth) is compared with fitted compute time.
    slow_link = CostModel(CostPrior(link_bytes_per_s=1e9))  # 800 tokens x 128 KiB = 0.1 s
    fast_link = CostModel(CostPrior(link_bytes_per_s=1e12))
    orders = {}
    for name, cost in (("slow", slow_link), ("fast", fast_link)):
        sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=2000), cost), FakeCache()
        cache.add_ready(doc(1, 800), "host")
        sched.submit("h", q(0, 100))
        sched.submit("loader", doc(1, 800) + q(1, 10))
        sched.submit("compute", q(2, 200))
        orders[name] = sched.schedule(cache).prefill_ids
    assert orders["slow"] == ("h", "compute", "loader")
    assert orders["fast"] == ("h", "loader", "compute")


# ---------------------------------------------------------------- bubble filling


def decoding_request(sched: Scheduler, cache: FakeCache, rid: str = "d") -> None:
    sched.submit(rid, q(50, 16))
    execute(sched.schedule(cache), sched, cache, max_new_tokens=100)
    assert sched.get(rid).status is RequestStatus.DECODING


@pytest.mark.parametrize(
    ("config", "decode_first"),
    [
        (SchedulerConfig(), True),
        (SchedulerConfig(enable_bubble_filling=False), False),
        (SchedulerConfig(policy="fifo"), False),
    ],
)
def test_loading_bound_prefill_runs_the_decode_batch_first(config: SchedulerConfig, decode_first: bool) -> None:
    sched, cache = Scheduler(config), FakeCache()
    decoding_request(sched, cache)
    cache.add_ready(doc(1, 4000), "host")  # 4000 x 128 KiB over 25 GB/s ~ 21 ms > one decode step
    sched.submit("p", doc(1, 4000) + q(1, 10))
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("p",) and plan.decode_ids == ("d",)
    assert plan.est_load_s > plan.est_decode_s
    assert plan.decode_first is decode_first


def test_prefill_first_when_its_kv_is_on_the_device_or_the_load_is_short() -> None:
    sched, cache = Scheduler(), FakeCache()
    decoding_request(sched, cache)
    cache.add_ready(doc(1, 4000), "device")
    cache.add_ready(doc(2, 32), "host")  # ~0.2 ms of load: shorter than a decode step
    sched.submit("p", doc(1, 4000) + q(1, 10))
    sched.submit("s", doc(2, 32) + q(2, 10))
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("p", "s")
    assert not plan.decode_first


def test_pending_prefetch_counts_as_unlanded_load() -> None:
    sched, cache = Scheduler(), FakeCache()
    decoding_request(sched, cache)
    cache.add_ready(doc(1, 4000), "storage")
    sched.submit("p", doc(1, 4000) + q(1, 10))
    cache.pending.add("p")
    plan = sched.schedule(cache)
    assert plan.prefill[0].load_storage_tokens == 4000
    assert plan.decode_first


# ---------------------------------------------------------------- waiting for an L3 prefetch


def _prefetching(landed: int, waited_s: float, storage_bytes_per_s: float) -> tuple[Scheduler, FakeCache]:
    """One request whose 2,000-token document is in L3, its prefetch in flight."""
    cost = CostModel(CostPrior(bytes_per_token=1000, storage_bytes_per_s=storage_bytes_per_s))
    sched, cache = Scheduler(SchedulerConfig(wait_for_prefetch=True), cost), FakeCache()
    cache.add_ready(doc(1, 2000), tier="storage")
    sched.submit("a", doc(1, 2000) + q(1))
    cache.prefetches["a"] = (landed, 2000, waited_s)
    return sched, cache


def test_waits_for_a_prefetch_that_lands_sooner_than_recomputing() -> None:
    sched, cache = _prefetching(landed=500, waited_s=0.0, storage_bytes_per_s=1e12)
    rest_fetch = sched.cost.storage_seconds(1500)
    assert rest_fetch < sched.cost.extend_seconds(1500, 500)  # the premise, from the same model
    plan = sched.schedule(cache)
    assert plan.prefill_ids == () and sched.stats().prefetch_waits == 1 and sched.stats().prefetch_wait_rounds == 1
    assert sched.stats().deferrals == 0  # not a delay-hit deferral
    sched.schedule(cache)
    assert sched.stats().prefetch_waits == 1 and sched.stats().prefetch_wait_rounds == 2
    del cache.prefetches["a"]  # landed
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("a",) and plan.prefill[0].load_storage_tokens == 2000
    assert sched.stats().prefetch_not_waited == 0


def test_a_prefetch_wait_seen_while_short_prefills_go_first_is_still_a_prefetch_wait() -> None:
    """With a long prompt mid-prefill, the short-first pass classifies the queue before the
    batch forms; a request held for its prefetch then is counted as such, not deferred."""
    sched, cache = _prefetching(landed=500, waited_s=0.0, storage_bytes_per_s=1e12)
    sched.submit("long", doc(2, 5000))
    sched.config = SchedulerConfig(wait_for_prefetch=True, max_batch_tokens=1000)
    first = sched.schedule(cache)
    assert first.prefill_ids == ("long",)  # "a" waits for its prefetch
    execute(first, sched, cache)
    plan = sched.schedule(cache)  # "long" continues: the short-first pass runs
    assert plan.prefill_ids == ("long",)
    stats = sched.stats()
    assert stats.prefetch_waits == 1 and stats.prefetch_wait_rounds == 2 and stats.deferrals == 0
    assert sched.get("a").status is RequestStatus.WAITING


def test_does_not_wait_when_recomputing_is_sooner_by_the_rate_or_by_its_own_pace() -> None:
    sched, cache = _prefetching(landed=500, waited_s=0.0, storage_bytes_per_s=1e3)  # 1.5 MB at 1 KB/s
    assert sched.cost.storage_seconds(1500) > sched.cost.extend_seconds(1500, 500)
    assert sched.schedule(cache).prefill_ids == ("a",)
    assert sched.stats().prefetch_not_waited == 1 and sched.stats().prefetch_waits == 0
    # slower than the measured rate says: its own pace (500 tokens in 100 s) decides
    sched, cache = _prefetching(landed=500, waited_s=100.0, storage_bytes_per_s=1e12)
    assert 1500 * 100.0 / 500 > sched.cost.extend_seconds(1500, 500)
    assert sched.schedule(cache).prefill_ids == ("a",)
    assert sched.stats().prefetch_not_waited == 1
    sched, cache = _prefetching(landed=1900, waited_s=1e-3, storage_bytes_per_s=1e12)  # a fast one nearly done
    assert sched.schedule(cache).prefill_ids == () and sched.stats().prefetch_waits == 1


def test_a_few_pages_landed_late_are_no_pace_to_give_up_on() -> None:
    """5 of 2,000 tokens landed after 10 ms, five times what the rate says the whole takes
    (the reads' start-up; objects land in batches): extrapolated, 4 s; the time taken plus
    the rate's estimate says it lands far sooner than recomputing, so the request waits.  A
    store that stays stuck is given up once that sum passes the recompute."""
    sched, cache = _prefetching(landed=5, waited_s=0.01, storage_bytes_per_s=1e9)
    recompute = sched.cost.extend_seconds(1995, 5)
    assert 0.01 > PREFETCH_PACE_SLACK * sched.cost.storage_seconds(2000)  # past the slack: pace is asked
    assert 1995 * 0.01 / 5 > recompute > 0.01 + sched.cost.storage_seconds(1995)  # the premise
    assert sched.schedule(cache).prefill_ids == () and sched.stats().prefetch_waits == 1
    sched, cache = _prefetching(landed=5, waited_s=recompute + 1.0, storage_bytes_per_s=1e9)
    assert sched.schedule(cache).prefill_ids == ("a",) and sched.stats().prefetch_not_waited == 1


def test_without_wait_for_prefetch_the_progress_is_never_asked() -> None:
    sched, cache = Scheduler(SchedulerConfig()), FakeCache()
    cache.add_ready(doc(1, 2000), tier="storage")
    sched.submit("a", doc(1, 2000) + q(1))
    cache.prefetches["a"] = (0, 2000, 0.0)
    assert sched.schedule(cache).prefill_ids == ("a",)
    assert sched.stats().prefetch_waits == 0 and sched.stats().prefetch_not_waited == 0


# ---------------------------------------------------------------- mixed steps


def test_mixed_step_leaves_a_token_per_decode_row_and_carries_them() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=256, enable_mixed_steps=True)), FakeCache()
    decoding_request(sched, cache, "d1")
    decoding_request(sched, cache, "d2")  # (a mixed round already: d2's prompt beside d1's decode)
    before = sched.stats().mixed_rounds
    sched.submit("p", doc(1, 4000))
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("p",) and set(plan.decode_ids) == {"d1", "d2"}
    assert plan.mixed and not plan.decode_first
    assert plan.prefill[0].new_tokens == 256 - 2  # the chunk and the two rows fill the 256-token program
    assert sched.stats().mixed_rounds == before + 1


@pytest.mark.parametrize(
    "config",
    [SchedulerConfig(max_batch_tokens=256), SchedulerConfig(max_batch_tokens=256, policy="fifo")],
)
def test_without_mixed_steps_the_chunk_takes_the_whole_budget(config: SchedulerConfig) -> None:
    assert not resolve_stages(config).mixed_steps
    sched, cache = Scheduler(config), FakeCache()
    decoding_request(sched, cache)
    sched.submit("p", doc(1, 4000))
    plan = sched.schedule(cache)
    assert not plan.mixed and plan.prefill[0].new_tokens == 256
    assert sched.stats().mixed_rounds == 0


def test_mixed_only_when_the_cost_model_says_one_program_is_cheaper() -> None:
    # A device where a decode row is nearly free and a prompt token is dear: the rows would cost
    # more as tokens of the extend than the whole decode program, so the step stays two programs.
    prior = CostPrior(extend_coeffs=(1e-3, 1e-2, 0.0), decode_coeffs=(1e-4, 1e-6, 0.0))
    sched = Scheduler(SchedulerConfig(max_batch_tokens=256, enable_mixed_steps=True), CostModel(prior))
    cache = FakeCache()
    decoding_request(sched, cache)
    sched.submit("p", doc(1, 4000))
    plan = sched.schedule(cache)
    est_mixed = sched.cost.batch_extend_seconds([(255, 0), (1, sched.get("d").seq_len)])
    assert est_mixed > plan.est_prefill_s + plan.est_decode_s
    assert not plan.mixed and plan.decode_ids == ("d",)


def test_a_decode_first_round_is_never_mixed() -> None:
    sched, cache = Scheduler(SchedulerConfig(enable_mixed_steps=True)), FakeCache()
    decoding_request(sched, cache)
    cache.add_ready(doc(1, 4000), "host")  # a load that outlasts a decode step: bubble filling
    sched.submit("p", doc(1, 4000) + q(1, 10))
    plan = sched.schedule(cache)
    assert plan.decode_first and not plan.mixed
