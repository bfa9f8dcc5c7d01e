"""Request life cycle (no jax): chunked prefill, overload, abort in each state, L1 accounting, retraction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.api import InvalidRequestError, OverloadedError
from strata_jax.scheduler import (
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    SchedulerStateError,
    UnknownRequestError,
    available_policies,
)
from strata_jax.scheduler.testing import FakeCache, execute

S = RequestStatus


def toks(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


# ---------------------------------------------------------------- chunked prefill


def test_long_prompt_is_chunked_to_the_token_budget_beside_decodes() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=1000)), FakeCache()
    sched.submit("d", toks(1, 10))
    execute(sched.schedule(cache), sched, cache, max_new_tokens=100)
    long = sched.submit("long", toks(2, 2500))
    chunks = []
    for _ in range(3):
        plan = sched.schedule(cache)
        (item,) = plan.prefill
        chunks.append((item.start, item.end, item.is_last_chunk))
        assert plan.decode_ids == ("d",)  # decoding continues between chunks
        assert long.status is S.PREFILLING
        execute(plan, sched, cache, max_new_tokens=100)
    assert chunks == [(0, 1000, False), (1000, 2000, False), (2000, 2500, True)]
    assert long.status is S.DECODING and long.num_output_tokens == 1


def test_chunk_continues_before_new_requests_and_shares_the_budget() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=1000)), FakeCache()
    sched.submit("a", toks(1, 1500))
    execute(sched.schedule(cache), sched, cache)
    sched.submit("b", toks(2, 800))
    plan = sched.schedule(cache)
    assert [(i.request_id, i.start, i.end) for i in plan.prefill] == [("a", 1000, 1500), ("b", 0, 500)]


def test_results_must_match_the_plan_and_values_may_come_later() -> None:
    sched, cache = Scheduler(), FakeCache()
    sched.submit("a", toks(1, 10))
    with pytest.raises(SchedulerStateError):
        sched.on_prefill_dispatched("a", 1)  # nothing dispatched yet
    sched.schedule(cache)
    # the pipelined engine reports a chunk done when it is dispatched, before its token's value is known
    assert sched.on_prefill_dispatched("a") is S.DECODING
    a = sched.get("a")
    assert a.generated == 1 and a.output_token_ids == [] and a.seq_len == 11
    plan = sched.schedule(cache)
    assert plan.decode_ids == ("a",)
    assert sched.on_decode_dispatched("a") is S.DECODING and a.generated == 2 and a.seq_len == 12
    with pytest.raises(SchedulerStateError):
        sched.on_decode_dispatched("a")  # no decode in flight any more
    with pytest.raises(UnknownRequestError):
        sched.on_decode_dispatched("nope", 1)


def test_a_decode_is_retracted_only_with_every_token_value_known() -> None:
    sched, cache = Scheduler(), FakeCache(page_size=4)
    for rid, seed in (("old", 1), ("new", 2)):
        sched.submit(rid, toks(seed, 8))
    plan = sched.schedule(cache)
    for item in plan.prefill:
        sched.on_prefill_dispatched(item.request_id)  # dispatched: the values are not known yet
    cache.free_tokens, cache.evictable_tokens = 4, 0  # their next KV slot opens a page: one must go
    with pytest.raises(SchedulerStateError, match="1 tokens generated, 0 known"):
        sched.schedule(cache)
    sched2, cache2 = Scheduler(), FakeCache(page_size=4)
    for rid, seed in (("old", 1), ("new", 2)):
        sched2.submit(rid, toks(seed, 8))
    for item in sched2.schedule(cache2).prefill:
        sched2.on_prefill_dispatched(item.request_id)
        item.request.add_output(7)  # the engine read the token back
    cache2.free_tokens, cache2.evictable_tokens = 4, 0
    plan = sched2.schedule(cache2)
    assert [r.request_id for r in plan.retract] == ["new"]
    assert sched2.get("new").prefill_tokens == tuple(toks(2, 8)) + (7,)


def test_fully_cached_prompt_still_computes_its_last_page() -> None:
    sched, cache = Scheduler(), FakeCache(page_size=16)
    cache.add_ready(toks(1, 64), "device")
    sched.submit("a", toks(1, 64))
    (item,) = sched.schedule(cache).prefill
    assert (item.start, item.end, item.device_hit_tokens) == (48, 64, 48)


# ---------------------------------------------------------------- overload and validation


def test_overload_raises_a_clear_error_and_recovers() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_waiting=2)), FakeCache()
    sched.submit("a", [1])
    sched.submit("b", [2])
    with pytest.raises(OverloadedError, match="max_waiting=2"):
        sched.submit("c", [3])
    assert sched.get("c") is None and sched.num_waiting == 2
    sched.schedule(cache)  # the queue drains into the running batch
    sched.submit("c", [3])


def test_invalid_submissions_and_config() -> None:
    sched = Scheduler()
    with pytest.raises(InvalidRequestError):
        sched.submit("a", [])
    sched.submit("a", [1])
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.submit("a", [1])
    with pytest.raises(SchedulerConfigError, match="unknown scheduler policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(SchedulerConfigError):
        SchedulerConfig(max_batch_tokens=0)
    with pytest.raises(SchedulerConfigError):
        SchedulerConfig(loading_bound_ratio=-1.0)
    assert set(available_policies()) == {"strata", "fifo"}


# ---------------------------------------------------------------- abort in each state


def test_abort_waiting_and_deferred_requests_free_no_device_kv() -> None:
    sched, cache = Scheduler(), FakeCache()
    for rid in ("a", "b", "w"):
        sched.submit(rid, toks(1, 500) + [rid == "b", 7])
        cache.add_transient(rid, sched.get(rid).prefill_tokens)
    sched.schedule(cache)
    assert sched.get("b").status is S.DEFERRED and sched.get("w").status is S.DEFERRED
    sched.submit("x", toks(9, 5))
    assert sched.abort("x") is S.WAITING
    assert sched.abort("b") is S.DEFERRED
    assert sched.queue_order() == ("w",)
    assert "b" not in sched.schedule(cache).prefill_ids + sched.schedule(cache).decode_ids


def test_abort_in_flight_prefill_and_decode_are_released_after_the_step() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=100)), FakeCache()
    sched.submit("d", toks(2, 10))
    sched.submit("p", toks(1, 300))
    execute(sched.schedule(cache), sched, cache, max_new_tokens=100)  # d prefilled, p: first chunk only
    plan = sched.schedule(cache)
    assert plan.prefill_ids == ("p",) and plan.decode_ids == ("d",)  # p's second chunk in flight
    assert sched.abort("p") is S.PREFILLING
    assert sched.on_prefill_dispatched("p") is S.ABORTED  # the late result is swallowed
    assert sched.on_decode_dispatched("d", 3) is S.DECODING
    plan = sched.schedule(cache)
    assert plan.decode_ids == ("d",)
    assert sched.abort("d") is S.DECODING
    assert sched.on_decode_dispatched("d", 5) is S.ABORTED
    assert sched.schedule(cache).is_empty and not sched.has_work()
    assert sched.stats().aborted == 2


def test_abort_between_steps_is_not_in_flight_and_unknown_ids_are_ignored() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_batch_tokens=100)), FakeCache()
    sched.submit("p", toks(1, 300))
    execute(sched.schedule(cache), sched, cache)
    assert sched.abort("p") is S.PREFILLING
    assert sched.abort("p") is None and sched.abort("never") is None
    sched.submit("f", toks(2, 4))
    assert execute(sched.schedule(cache), sched, cache, max_new_tokens=1) == ["f"]
    assert sched.abort("f") is None  # already finished
    sched.submit("p", toks(3, 4))  # ids are reusable once released


# ---------------------------------------------------------------- L1 accounting and retraction


def test_prefill_is_chunked_to_free_device_memory_and_evicts_when_needed() -> None:
    cache = FakeCache(free_tokens=100, evictable_tokens=0)
    sched = Scheduler()
    sched.submit("a", toks(1, 500))
    (item,) = sched.schedule(cache).prefill
    assert item.new_tokens == 100

    cache = FakeCache(free_tokens=100, evictable_tokens=400)
    sched = Scheduler()
    sched.submit("a", toks(1, 500))
    plan = sched.schedule(cache)
    assert plan.prefill[0].new_tokens == 500 and plan.evict_device_tokens == 400


def test_head_that_cannot_load_its_prefix_blocks_the_queue_without_loss() -> None:
    cache = FakeCache(free_tokens=50)
    cache.add_ready(toks(1, 400), "host")
    sched = Scheduler()
    sched.submit("big", toks(1, 400) + [1])
    sched.submit("small", toks(2, 10))
    plan = sched.schedule(cache)
    assert plan.prefill == () and sched.queue_order() == ("big", "small")
    cache.free_tokens = 1000
    assert sched.schedule(cache).prefill_ids == ("big", "small")


def test_decodes_that_cannot_grow_retract_the_newest_with_its_kv_kept() -> None:
    sched, cache = Scheduler(), FakeCache(page_size=4)
    for rid, seed in (("old", 1), ("new", 2)):
        sched.submit(rid, toks(seed, 8))
    execute(sched.schedule(cache), sched, cache, max_new_tokens=100)
    # both hold 8 prompt tokens + 1 sampled: their next KV slot (position 8) opens a page
    cache.free_tokens, cache.evictable_tokens = 4, 0
    plan = sched.schedule(cache)
    assert plan.decode_ids == ("old",) and [r.request_id for r in plan.retract] == ["new"]
    new = sched.get("new")
    assert new.status is S.WAITING and sched.queue_order() == ("new",)
    assert new.prefill_tokens == tuple(toks(2, 8)) + (0,)  # prompt + output so far
    assert plan.prefill == ()  # its KV is still on the device this step
    execute(plan, sched, cache, max_new_tokens=100)  # engine backs "new" up to L2
    cache.free_tokens = 100
    plan = sched.schedule(cache)
    (item,) = plan.prefill
    assert item.request_id == "new" and item.load_host_tokens == 8 and (item.start, item.end) == (8, 9)
    execute(plan, sched, cache, max_new_tokens=100)
    assert new.status is S.DECODING and new.output_token_ids == [0, 0]
    assert sched.stats().retractions == 1


@settings(max_examples=60, deadline=None)
@given(
    free=st.integers(0, 3000),
    evictable=st.integers(0, 3000),
    prompts=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 900), st.sampled_from(["device", "host", None])),
        min_size=1,
        max_size=8,
    ),
    policy=st.sampled_from(["strata", "fifo"]),
)
def test_a_plan_never_overcommits_device_memory(free, evictable, prompts, policy) -> None:
    cache = FakeCache(free_tokens=free, evictable_tokens=evictable)
    sched = Scheduler(SchedulerConfig(policy=policy, max_batch_tokens=2048))
    for i, (doc_id, n, tier) in enumerate(prompts):
        doc = toks(10 + doc_id, 600)
        if tier is not None:
            cache.add_ready(doc, tier)
        sched.submit(f"r{i}", doc + toks(100 + i, n))
    plan = sched.schedule(cache)
    # page_size 1, so everything is counted exactly once per distinct prefix token:
    loaded_or_locked = len({tok for item in plan.prefill for tok in item.request.prefill_tokens[: item.start]})
    computed = sum(item.new_tokens for item in plan.prefill)
    assert computed + loaded_or_locked <= free + evictable
    assert plan.evict_device_tokens <= evictable
    assert sum(item.new_tokens for item in plan.prefill) <= 2048


def test_one_round_matches_at_most_max_lookahead_queued_requests() -> None:
    sched, cache = Scheduler(SchedulerConfig(max_lookahead=2, max_prefill_batch_size=1)), FakeCache()
    for i in range(5):
        sched.submit(f"r{i}", toks(i, 10))
    assert sched.schedule(cache).prefill_ids == ("r0",)
    assert cache.match_calls <= 2
    assert sched.queue_order() == ("r1", "r2", "r3", "r4")


def test_the_caches_request_room_bounds_new_starts() -> None:
    """``CacheView.new_request_room`` (an engine with sliding-window layers: local pages
    for the windows) caps how many requests start in a round, under max_running_requests."""
    sched = Scheduler(SchedulerConfig(max_batch_tokens=1000, max_prefill_batch_size=8, max_running_requests=8))
    cache = FakeCache(request_room=1)
    for i in range(4):
        sched.submit(f"r{i}", toks(i + 1, 50))
    plan = sched.schedule(cache)
    assert [i.request_id for i in plan.prefill] == ["r0"]
    execute(plan, sched, cache, max_new_tokens=3)
    cache.request_room = 0
    assert not sched.schedule(cache).prefill  # no room while r0 runs: none (r0 decodes)
    cache.request_room = 2
    plan = sched.schedule(cache)
    assert [i.request_id for i in plan.prefill] == ["r1", "r2"]
    cache.request_room = None  # no cache limit: max_running_requests alone
    execute(plan, sched, cache, max_new_tokens=3)
    assert [i.request_id for i in sched.schedule(cache).prefill] == ["r3"]
