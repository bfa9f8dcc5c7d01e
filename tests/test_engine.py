"""End-to-end engine behaviour: identical tokens from every tier, HF parity under batching,
clean accounting after aborts/overload/bad input, streaming."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from hf_reference import make_hf_model

from strata_jax.api import InvalidRequestError, OverloadedError, SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.engine.sinks import CollectingSink

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _baseline(engine: Engine) -> dict:
    acc = engine.check_accounting()
    assert acc["locked_nodes"] == 0 and acc["transient_nodes"] == 0
    assert acc["device_request_pages"] == 0 and acc["live_requests"] == 0
    return acc


@pytest.fixture(scope="module")
def tiered_engine(tmp_path_factory):
    engine = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            page_size=16,
            device_tokens=4096,
            max_batch_tokens=128,
            max_batch_size=4,
            prefetch_policy="wait_complete",
            prefetch_min_tokens=0,
            storage_dir=str(tmp_path_factory.mktemp("kv")),
        )
    )
    yield engine
    engine.shutdown()


def test_same_tokens_from_every_tier(tiered_engine):
    e = tiered_engine
    doc = np.random.default_rng(0).integers(0, 256, size=300).tolist()
    prompt = doc + [7, 8, 9]
    cold = e.generate([prompt], GREEDY)[0]
    assert cold.cached_tokens == {"device": 0, "host": 0, "storage": 0} and cold.prompt_token_ids == prompt
    l1 = e.generate([prompt], GREEDY)[0]
    assert l1.cached_tokens["device"] == 288  # 18 full pages; the last partial page is recomputed
    e.flush_cache("device")
    l2 = e.generate([prompt], GREEDY)[0]
    assert l2.cached_tokens["host"] == 288 and l2.cached_tokens["device"] == 0
    e.flush_cache("device")
    e.flush_cache("host")
    l3 = e.generate([prompt], GREEDY)[0]
    assert l3.cached_tokens["storage"] == 288
    assert cold.token_ids == l1.token_ids == l2.token_ids == l3.token_ids
    _baseline(e)


def test_namespaces_never_share_cache(tiered_engine):
    e = tiered_engine
    prompt = np.random.default_rng(1).integers(0, 256, size=100).tolist()
    a = e.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    b = e.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    a2 = e.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert b.num_cached_tokens == 0 and a2.cached_tokens["device"] == 96
    assert a.token_ids == b.token_ids == a2.token_ids


@pytest.mark.parametrize("mixed_steps", [False, True])  # True: decode rows ride in the chunks' program
def test_engine_matches_hf_greedy_with_concurrent_requests(tmp_path, mixed_steps):
    hf = make_hf_model("qwen3", tmp_path / "m", seed=3)
    engine = Engine(
        EngineConfig(
            model=str(tmp_path / "m"),
            warmup=False,
            show_progress=False,
            page_size=4,
            device_tokens=512,
            max_batch_tokens=32,
            max_batch_size=4,
            max_context_tokens=256,
            mixed_steps=mixed_steps,
        )
    )
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 96, size=20).tolist()
    prompts = [shared + rng.integers(0, 96, size=n).tolist() for n in (3, 17, 40)] + [
        rng.integers(0, 96, size=9).tolist()
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = engine.generate(prompts, params)  # concurrent: chunked prefill (40+20 > 32) beside decodes
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()
    assert (engine.counters["mixed_steps"] > 0) is mixed_steps
    assert engine.scheduler.stats().mixed_rounds == engine.counters["mixed_steps"]
    # again, now with the shared prefix cached
    again = engine.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert sum(o.cached_tokens["device"] for o in again) > 0
    _baseline(engine)
    engine.shutdown()


def test_bad_requests_are_rejected_and_leave_accounting_at_baseline(tiered_engine):
    e = tiered_engine
    before = _baseline(e)
    with pytest.raises(InvalidRequestError, match="exceeds the context"):
        e.generate([[1] * (e.max_context_tokens - 4)], SamplingParams(max_tokens=16))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        e.generate([[1, 2, 10**6]])
    with pytest.raises(InvalidRequestError, match="empty"):
        e.generate([""])
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=-1)
    assert _baseline(e)["device_used_pages"] == before["device_used_pages"]


def test_abort_at_any_point_frees_everything(tiered_engine):
    e = tiered_engine
    rng = np.random.default_rng(5)
    ids = []
    for _ in range(6):
        ids.append(e.submit(rng.integers(0, 256, size=200).tolist(), SamplingParams(max_tokens=200, ignore_eos=True)))
    aborts = [e.abort(rid) for rid in ids]  # some still waiting, some prefilling or decoding; queued, never waited for
    assert all(f.result(timeout=60) for f in aborts)  # each was live when its abort ran
    assert e.abort("no-such-request").result(timeout=60) is False
    _baseline(e)


def test_overload_is_a_clear_error_and_accepted_requests_finish(tmp_path):
    engine = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            max_waiting=2,
            max_batch_tokens=64,
            max_batch_size=2,
            device_tokens=2048,
            tiers="L1",
        ),
        start=False,
    )
    accepted = [engine.submit([1, 2, 3, i], SamplingParams(max_tokens=3)) for i in range(2)]
    engine.admit_pending()  # this engine runs no thread
    with pytest.raises(OverloadedError, match="overloaded"):
        engine.submit([9, 9], SamplingParams(max_tokens=3))
    engine.run_until_idle()
    assert engine.cache_stats()["finished"] == len(accepted)
    _baseline(engine)
    engine.shutdown()


def test_stream_yields_incremental_chunks_and_cancel_aborts(tiered_engine):
    e = tiered_engine

    async def run():
        chunks = [c async for c in e.stream("Hello", SamplingParams(max_tokens=5, ignore_eos=True))]
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 5
        gen = e.stream("Cancel me please", SamplingParams(max_tokens=400, ignore_eos=True))
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # client went away: the engine aborts the request

    asyncio.run(run())
    _baseline(e)


def test_stop_strings_and_stop_token_ids(tiered_engine):
    e = tiered_engine
    free = e.generate(["Stop here"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(free.token_ids) == 12
    stop_id = free.token_ids[3]
    by_id = e.generate(["Stop here"], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1] and by_id.finish_reason == "stop"
    text = free.text
    if len(text) >= 3:
        stop = text[1:3]
        by_str = e.generate(["Stop here"], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))[0]
        assert by_str.text == text[: text.index(stop)] and by_str.finish_reason == "stop"


def test_generate_from_several_threads(tiered_engine):
    e = tiered_engine
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = e.generate([[10 + i] * 40], GREEDY)[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4
    for i in range(4):
        assert results[i] == e.generate([[10 + i] * 40], GREEDY)[0].token_ids


def test_retraction_under_l1_pressure_keeps_tokens_identical():
    """With L1 too small for four growing decodes, the newest is retracted (its KV goes to
    the tree and L2) and re-prefilled later: outputs equal an unpressured run."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=100).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    def run(device_tokens: int):
        engine = Engine(
            EngineConfig(
                model="tiny",
                warmup=False,
                show_progress=False,
                tiers="L1+L2",
                device_tokens=device_tokens,
                page_size=16,
                max_batch_tokens=128,
                max_batch_size=4,
            )
        )
        outs = engine.generate(prompts, params)
        retractions = engine.cache_stats()["retractions"]
        _baseline(engine)
        engine.shutdown()
        return [o.token_ids for o in outs], retractions

    roomy, no_retractions = run(4096)
    tight, retractions = run(448)
    assert no_retractions == 0 and retractions > 0
    assert tight == roomy


def test_bubble_filling_decodes_first_and_keeps_tokens_identical():
    """A slow link makes the L2 load of B's prefix outlast a decode step: the running decode of A
    is dispatched before B's load (a decode-first round) and every output is unchanged."""
    from strata_jax.cache.config import CacheConfig

    rng = np.random.default_rng(7)
    doc = rng.integers(0, 256, size=160).tolist()
    a_prompt = rng.integers(0, 256, size=20).tolist()
    b_prompt = doc + [1, 2, 3]
    a_params = SamplingParams(max_tokens=30, ignore_eos=True)
    slow_link = CacheConfig(page_size=16, device_tokens=2048, tiers="L1+L2", initial_bandwidth_bytes_per_s=1e4)
    engine = Engine(
        EngineConfig(
            model="tiny", warmup=False, show_progress=False, cache=slow_link, max_batch_tokens=64, max_batch_size=4
        ),
        start=False,
    )

    def run(prompt, params):
        sink = CollectingSink()
        engine.submit(prompt, params, sink=sink)
        return sink

    ref_b, ref_a = run(b_prompt, GREEDY), run(a_prompt, a_params)
    engine.run_until_idle()
    engine.flush_cache("device")  # b's document now lives in L2 only
    a = run(a_prompt, a_params)
    while engine.scheduler.stats().decoding == 0:  # a is decoding (step() admits it first) ...
        engine.step()
    b = run(b_prompt, GREEDY)  # ... when b arrives with its prefix in L2
    engine.run_until_idle()
    tokens = lambda sink: [t for c in sink.chunks for t in c.token_ids]  # noqa: E731
    assert tokens(a) == tokens(ref_a) and tokens(b) == tokens(ref_b)
    assert b.chunks[-1].cached_tokens["host"] == 160
    assert engine.scheduler.stats().decode_first_rounds > 0
    _baseline(engine)
    engine.shutdown()


def test_shutdown_lets_a_running_request_finish_and_returns():
    """``shutdown`` while a request runs: the request finishes within the grace period with
    all its tokens, and shutdown returns (its close call reaches the engine thread even
    though the thread has nothing else left to do when the request ends)."""
    engine = Engine(EngineConfig(model="tiny", warmup=False, show_progress=False, max_batch_tokens=64, tiers="L1"))
    sink = CollectingSink()
    engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=20, ignore_eos=True), sink=sink)
    done = threading.Thread(target=engine.shutdown, kwargs={"grace_s": 60.0}, daemon=True)
    done.start()
    done.join(90)
    assert not done.is_alive(), "shutdown hung"
    assert sink.wait(1) and sink.error is None, sink.error
    assert sum(len(c.token_ids) for c in sink.chunks) == 20 and sink.chunks[-1].finish_reason == "length", sink.chunks[
        -1
    ]
