"""A step that fails fails only the requests it touched; the engine checks itself and serves on.

The faults are injected by wrapping the engine's executor (test code only): a dispatch
that raises for one request, a token read that raises, a step that always raises.  The
real tiny engine runs its own loop thread (``start=True``), as under ``strata-jax serve``.
"""

from __future__ import annotations

import threading

import pytest

from strata_jax.api import EngineFailedError, SamplingParams, StepFailedError
from strata_jax.engine import Engine, EngineConfig
from strata_jax.engine.engine import MAX_CONSECUTIVE_STEP_FAILURES
from strata_jax.engine.sinks import CollectingSink

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7919) % 250 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            tiers="L1+L2",
            page_size=16,
            device_tokens=4096,
            max_batch_tokens=128,
            max_batch_size=4,
        ),
        start=True,
    )
    yield eng
    eng.shutdown()


def _tokens(out) -> list[int]:
    return list(out.token_ids)


def _wait(sink: CollectingSink) -> None:
    assert sink.wait(120), "the request never finished"


def test_a_failed_dispatch_fails_its_request_and_the_queued_one_goes_on(engine):
    first, queued, later = _prompt(1, 300), _prompt(2, 300), _prompt(3, 100)
    cold = {name: _tokens(engine.generate([p], GREEDY)[0]) for name, p in (("queued", queued), ("later", later))}
    engine.flush_cache("all")
    target = {"ids": set()}
    real = engine.executor.dispatch_extend
    calls = {"failed": 0}

    def failing(work, loads):
        if calls["failed"] == 0 and any(w.row.request_id in target["ids"] for w in work):
            calls["failed"] += 1
            raise RuntimeError("injected: the first chunk of this request cannot be dispatched")
        return real(work, loads)

    engine.executor.dispatch_extend = failing
    try:
        sinks = {"first": CollectingSink(), "queued": CollectingSink()}
        target["ids"].add(engine.submit(first, GREEDY, sink=sinks["first"], request_id="victim"))
        engine.submit(queued, GREEDY, sink=sinks["queued"], request_id="bystander")
        for sink in sinks.values():
            _wait(sink)
    finally:
        engine.executor.dispatch_extend = real
    assert calls["failed"] == 1
    err = sinks["first"].error
    assert isinstance(err, StepFailedError) and "RuntimeError" in str(err) and "injected" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    # 128-token steps: the victim's first chunk filled the failed step, the bystander was still queued
    assert sinks["queued"].error is None
    assert [t for c in sinks["queued"].chunks for t in c.token_ids] == cold["queued"]
    assert engine.fatal_error is None
    assert _tokens(engine.generate([later], GREEDY)[0]) == cold["later"]
    acc = engine.check_accounting()
    assert acc["live_requests"] == 0 and acc["locked_nodes"] == 0 and acc["device_request_pages"] == 0
    assert engine.counters["failed"] >= 1


def test_a_failed_token_read_fails_that_step_and_the_engine_serves_on(engine):
    prompt = _prompt(4, 200)
    cold = _tokens(engine.generate([prompt], GREEDY)[0])
    real = engine.executor.collect
    calls = {"n": 0}

    def failing(pending):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: reading a step's tokens failed")
        return real(pending)

    engine.executor.collect = failing
    sink = CollectingSink()
    try:
        engine.submit(prompt, GREEDY, sink=sink)
        _wait(sink)
    finally:
        engine.executor.collect = real
    assert isinstance(sink.error, StepFailedError)
    # the failed step may have published prefixes it never computed: they are gone, so the retry recomputes
    again = engine.generate([prompt], GREEDY)[0]
    assert _tokens(again) == cold
    assert engine.fatal_error is None


def test_steps_that_keep_failing_stop_the_engine_and_tell_the_server(tmp_path):
    eng = Engine(
        EngineConfig(model="tiny", warmup=False, show_progress=False, tiers="L1", page_size=16, device_tokens=2048),
        start=True,
    )
    told = threading.Event()
    seen: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        seen.append(exc)
        told.set()

    eng.on_fatal = on_fatal

    def always(work, loads):
        raise RuntimeError("injected: every dispatch fails")

    eng.executor.dispatch_extend = always
    try:
        errors = []
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            sink = CollectingSink()
            try:
                eng.submit(_prompt(10 + i, 40), GREEDY, sink=sink)
            except EngineFailedError as exc:
                errors.append(exc)
                break
            _wait(sink)
            errors.append(sink.error)
        assert told.wait(30), "the engine never reported that it stopped"
        assert all(isinstance(e, (StepFailedError, EngineFailedError)) for e in errors), errors
        assert "in a row" in str(seen[0])
        assert eng.fatal_error is seen[0]
        with pytest.raises(EngineFailedError):
            eng.submit(_prompt(20, 40), GREEDY)
        assert eng.cache_stats()["device_pool"]["used_pages"] == 0  # calls are still answered after it stopped
    finally:
        eng.shutdown(grace_s=1.0)


def test_an_unrecoverable_error_stops_the_engine_at_once():
    import jax

    from strata_jax.engine.engine import unrecoverable_step_error

    assert unrecoverable_step_error(MemoryError())
    assert unrecoverable_step_error(jax.errors.JaxRuntimeError("INTERNAL: device lost"))
    assert not unrecoverable_step_error(ZeroDivisionError("float division by zero"))
    assert not unrecoverable_step_error(RuntimeError("a storage backend hiccup"))
