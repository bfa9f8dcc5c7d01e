"""The pipelined engine loop (step N+1 dispatched before step N's tokens are read) gives
exactly what the serial loop gives: the same tokens, text, finish reasons, logprobs and
cached-token counts, in every case the pipeline changes the bookkeeping of.

Each scenario is a script of submissions and aborts at given steps, run by hand
(``start=False``) on two engines that differ only in ``pipeline``."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.api import SamplingParams, StepFailedError
from strata_jax.engine import Engine, EngineConfig
from strata_jax.engine.sinks import CollectingSink

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(pipeline: bool, tmp_path, **overrides) -> Engine:
    config = dict(
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
        storage_dir=str(tmp_path / ("kv-pipe" if pipeline else "kv-serial")),
        pipeline=pipeline,
    )
    config.update(overrides)
    return Engine(EngineConfig(**config), start=False)


def _outcome(sink: CollectingSink):
    if sink.error is not None:
        return ("error", type(sink.error).__name__)
    chunks = sink.chunks
    last = chunks[-1]
    logprobs = [
        (lp.token_id, round(lp.logprob, 5), tuple((t, round(v, 5)) for t, v in lp.top))
        for c in chunks
        for lp in (c.logprobs or [])
    ]
    prompt_lps = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    prompt_lps = (
        [None if lp is None else (lp.token_id, round(lp.logprob, 5)) for lp in prompt_lps] if prompt_lps else None
    )
    return (
        [t for c in chunks for t in c.token_ids],
        "".join(c.text for c in chunks),
        last.finish_reason,
        dict(last.cached_tokens),
        last.completion_tokens,
        logprobs,
        prompt_lps,
    )


def _play(engine: Engine, script: list[tuple[int, str, object]]) -> dict[str, object]:
    """``script``: (step, "submit", (name, prompt, params[, follows])) or (step, "abort", name).
    Returns each request's outcome; checks the accounting is back at baseline."""
    sinks: dict[str, CollectingSink] = {}
    ids: dict[str, str] = {}
    step = 0
    pending = sorted(script, key=lambda e: e[0])
    while pending or engine.scheduler.has_work() or engine.core.has_pending_step():
        while pending and pending[0][0] <= step:
            _, action, arg = pending.pop(0)
            if action == "submit":
                name, prompt, params, *follows = arg
                sinks[name] = CollectingSink()
                leader = ids[follows[0]] if follows else None
                ids[name] = engine.submit(prompt, params, sink=sinks[name], follows=leader)
            else:
                engine.abort(ids[arg])
        engine.step()
        step += 1
        assert step < 5000
    acc = engine.check_accounting()
    assert acc["live_requests"] == 0 and acc["locked_nodes"] == 0 and acc["device_request_pages"] == 0, acc
    return {name: _outcome(sink) for name, sink in sinks.items()}


def _both(tmp_path, script, **overrides) -> dict[str, object]:
    results = []
    for pipeline in (False, True):
        engine = _engine(pipeline, tmp_path, **overrides)
        try:
            results.append(_play(engine, script))
            overlapped = engine.cache_stats()["overlapped_steps"]
            assert (overlapped > 0) if pipeline else (overlapped == 0)
        finally:
            engine.shutdown()
    serial, piped = results
    assert piped == serial
    return serial


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


def test_stops_length_stop_ids_and_stop_strings(tmp_path):
    free = _both(tmp_path, [(0, "submit", ("free", _prompt(1, 40), GREEDY))])["free"]
    tokens, text = free[0], free[1]
    stop_id = tokens[5]
    script = [
        (
            0,
            "submit",
            ("by_id", _prompt(1, 40), SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,))),
        ),
        (0, "submit", ("one", _prompt(2, 30), SamplingParams(max_tokens=1, ignore_eos=True))),
        (1, "submit", ("scoring", _prompt(3, 50), SamplingParams(max_tokens=0, prompt_logprobs=2))),
        (
            2,
            "submit",
            (
                "min_tokens",
                _prompt(1, 40),
                SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=8),
            ),
        ),
    ]
    if len(text) >= 6:
        script.append(
            (1, "submit", ("by_str", _prompt(1, 40), SamplingParams(max_tokens=12, ignore_eos=True, stop=(text[3:5],))))
        )
    out = _both(tmp_path, script)
    assert out["by_id"][0] == tokens[: tokens.index(stop_id) + 1] and out["by_id"][2] == "stop"
    assert out["one"][2] == "length" and len(out["one"][0]) == 1
    assert out["scoring"][0] == [] and out["scoring"][6] is not None
    if "by_str" in out:
        assert out["by_str"][2] == "stop" and out["by_str"][1] == text[: text.index(text[3:5])]


def test_joins_finishes_aborts_logprobs_and_penalties(tmp_path):
    lp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    pen = SamplingParams(
        max_tokens=14,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        logit_bias={65: 5.0, 66: -100.0},
    )
    sampled = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=40, seed=3)
    script = [
        (0, "submit", ("a", _prompt(10, 60), GREEDY)),
        (0, "submit", ("b", _prompt(11, 200), SamplingParams(max_tokens=40, ignore_eos=True))),
        (1, "submit", ("lp", _prompt(12, 33), lp)),
        (3, "submit", ("pen", _prompt(13, 25), pen)),
        (4, "abort", "b"),  # mid-decode, beside the others
        (5, "submit", ("late", _prompt(14, 70), GREEDY)),  # joins while others finish
        (6, "submit", ("sampled", _prompt(15, 20), sampled)),
        (7, "submit", ("gone", _prompt(16, 300), GREEDY)),
        (7, "abort", "gone"),  # aborted before it ran
    ]
    out = _both(tmp_path, script)
    assert out["b"] == ("error", "RequestAbortedError") and out["gone"] == ("error", "RequestAbortedError")
    assert len(out["lp"][5]) == 10 and all(len(top) == 3 for _t, _l, top in out["lp"][5])
    assert all(len(out[k][0]) == 12 for k in ("a", "late"))


def test_n_choices_and_every_tier(tmp_path):
    doc = _prompt(20, 160)
    choice = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7)
    script = [
        (0, "submit", ("c0", doc + [1, 2], choice.for_choice(0))),
        (0, "submit", ("c1", doc + [1, 2], choice.for_choice(1), "c0")),
        (0, "submit", ("c2", doc + [1, 2], choice.for_choice(2), "c0")),
    ]
    out = _both(tmp_path, script)
    assert out["c1"][3]["device"] == 160 and len({tuple(out[c][0]) for c in ("c0", "c1", "c2")}) == 3
    # the same document from L1, then L2, then L3 (flushing between), in both loops
    by_loop = {}
    for pipeline in (False, True):
        engine = _engine(pipeline, tmp_path / f"tiers-{pipeline}")
        try:
            runs = [_play(engine, [(0, "submit", ("q", doc + [9, 9, 9], GREEDY))])["q"]]  # computes the document
            for flush in (None, "device", "host"):
                if flush == "host":
                    engine.flush_cache("device")
                if flush is not None:
                    engine.flush_cache(flush)
                runs.append(_play(engine, [(0, "submit", ("q", doc + [9, 9, 9], GREEDY))])["q"])
            cold = _play(engine, [(0, "submit", ("cold", _prompt(21, 60), GREEDY))])["cold"]
        finally:
            engine.shutdown()
        assert [r[3] for r in runs] == [
            {"device": 0, "host": 0, "storage": 0},
            {"device": 160, "host": 0, "storage": 0},
            {"device": 0, "host": 160, "storage": 0},
            {"device": 0, "host": 0, "storage": 160},
        ]
        assert runs[0][0] == runs[1][0] == runs[2][0] == runs[3][0] and cold[0]
        by_loop[pipeline] = (runs, cold)
    assert by_loop[True] == by_loop[False]


@pytest.mark.parametrize("pipeline", [False, True])
def test_retraction_under_pressure_reads_the_step_in_flight_first(tmp_path, pipeline):
    """A round that may retract drains the pipeline: the retracted request's tokens are all known."""
    prompts = [_prompt(30 + i, 100) for i in range(4)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    script = [(0, "submit", (f"r{i}", p, params)) for i, p in enumerate(prompts)]
    roomy_engine = _engine(pipeline, tmp_path / "roomy", tiers="L1+L2")
    try:
        roomy = _play(roomy_engine, script)
    finally:
        roomy_engine.shutdown()
    tight_engine = _engine(pipeline, tmp_path / "tight", tiers="L1+L2", device_tokens=448)
    try:
        tight = _play(tight_engine, script)
        stats = tight_engine.cache_stats()
    finally:
        tight_engine.shutdown()
    assert stats["retractions"] > 0
    if pipeline:
        assert stats["pipeline_drains"] > 0
    assert [tight[k][0] for k in sorted(tight)] == [roomy[k][0] for k in sorted(roomy)]


@pytest.mark.slow  # two engines on the real model, ~40 decode steps each
def test_real_model_pipelined_equals_serial(smollm2_gguf, tmp_path):
    """SmolLM2 answering chat questions (ending on its own EOS), with a stop string, logprobs,
    penalties, two sampled choices and an abort: the pipelined loop's outputs are the serial loop's."""
    from strata_jax.models.loader import load_model

    tok = load_model(smollm2_gguf, show_progress=False).tokenizer

    def chat(q):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))

    free = SamplingParams(max_tokens=40)
    script = [
        (0, "submit", ("capital", chat("What is the capital of France?"), free)),
        (0, "submit", ("count", chat("Count from one to five."), free)),
        (1, "submit", ("stop", chat("Name three colors."), SamplingParams(max_tokens=40, stop=(",",)))),
        (1, "submit", ("lp", chat("Say hello."), SamplingParams(max_tokens=12, logprobs=2))),
        (
            2,
            "submit",
            (
                "pen",
                chat("Repeat the word cat."),
                SamplingParams(max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.5),
            ),
        ),
        (
            3,
            "submit",
            ("s0", chat("Tell me a fact."), SamplingParams(max_tokens=10, temperature=0.7, seed=1).for_choice(0)),
        ),
        (
            3,
            "submit",
            ("s1", chat("Tell me a fact."), SamplingParams(max_tokens=10, temperature=0.7, seed=1).for_choice(1), "s0"),
        ),
        (4, "submit", ("gone", chat("Write a long story."), SamplingParams(max_tokens=40))),
        (9, "abort", "gone"),
    ]
    out = _both(
        tmp_path,
        script,
        model=smollm2_gguf,
        tiers="L1+L2",
        device_tokens=4096,
        max_batch_tokens=256,
        max_batch_size=8,
        max_context_tokens=1024,
    )
    assert out["capital"][2] == "stop" and "Paris" in out["capital"][1]  # ended on the model's own EOS
    assert out["stop"][2] == "stop" and "," not in out["stop"][1]
    assert out["gone"] == ("error", "RequestAbortedError")


def test_a_failure_sent_while_a_step_is_read_loses_no_token(tmp_path):
    """A failure goes out at once (e.g. a parked request refused on admission while a finishing
    request frees its slot); the tokens of the step being read still all reach their streams."""
    from strata_jax.api import EngineUnavailableError
    from strata_jax.engine.output import FailEvent
    from strata_jax.engine.requests import TrackedRequest

    script = [(0, "submit", (name, _prompt(40 + i, 30), GREEDY)) for i, name in enumerate(("a", "b", "c"))]
    reference = _both(tmp_path, script)
    engine = _engine(True, tmp_path / "again")
    core = engine.core
    accept = core._accept
    bystander = CollectingSink()
    other = TrackedRequest("bystander", [1, 2], "", GREEDY, bystander, None, 0.0)

    def accept_then_fail(t, token, logprob, now, events):
        accept(t, token, logprob, now, events)
        core._fail([FailEvent(other.stream, EngineUnavailableError("refused"))])  # mid-read, as admit() would

    core._accept = accept_then_fail
    try:
        got = _play(engine, script)
    finally:
        engine.shutdown()
    assert got == reference
    assert isinstance(bystander.error, EngineUnavailableError)


def test_a_failed_step_fails_its_requests_and_drops_what_it_may_have_cached(tmp_path):
    engine = _engine(True, tmp_path, tiers="L1+L2")
    try:
        doc = _prompt(50, 96)
        good = _play(engine, [(0, "submit", ("x", doc, GREEDY))])["x"]
        engine.flush_cache("all")
        collect = engine.core.executor.collect
        calls = {"n": 0}

        def failing(pending):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("device lost")
            return collect(pending)

        engine.core.executor.collect = failing
        sink = CollectingSink()
        engine.submit(doc, GREEDY, sink=sink)
        for _ in range(200):
            try:
                engine.step()
            except RuntimeError:
                engine.core.fail_step(RuntimeError("device lost"))  # what the engine loop does
            if sink.wait(0):
                break
        assert isinstance(sink.error, StepFailedError) and isinstance(sink.error.__cause__, RuntimeError)
        stats = engine.cache_stats()
        assert stats["device_pool"]["used_pages"] == 0 and stats["host_pool"]["used_pages"] == 0
        again = _play(engine, [(0, "submit", ("x", doc, GREEDY))])["x"]
        assert again[0] == good[0] and again[3] == {"device": 0, "host": 0, "storage": 0}  # recomputed, not hit
    finally:
        engine.shutdown()
