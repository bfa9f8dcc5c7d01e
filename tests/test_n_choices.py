"""n > 1: one prefill, n decodes over the prompt's pages shared through the tree."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.engine.output import collect
from strata_jax.engine.sinks import CollectingSink

PAGE = 4


@pytest.fixture(scope="module")
def engine():
    e = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            page_size=PAGE,
            max_batch_tokens=64,
            max_batch_size=4,
            device_tokens=1024,
            tiers="L1",
        ),
        start=False,
    )
    yield e
    e.shutdown()


def test_choices_share_the_prompt_pages(engine):
    n = 4
    ids = np.random.default_rng(0).integers(1, 250, 42).tolist()  # 10 full pages + 2 tokens
    full = len(ids) // PAGE
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    sinks, leader = [], None
    for i in range(n):
        sink = CollectingSink()
        rid = engine.submit(ids, params.for_choice(i), sink=sink, follows=leader)
        leader = leader or rid
        sinks.append((rid, sink))
    engine.admit_pending()
    prefix_tables: dict[str, list[int]] = {}
    peak_pages = 0
    while engine.scheduler.has_work() or engine.core.has_pending_step():
        engine.step()
        live = engine.core.live_requests.values()
        for t in live:
            if t.output_ids:
                prefix_tables.setdefault(t.request_id, list(t.page_table[:full]))
        if len(live) == n:
            peak_pages = max(peak_pages, len({p for t in live for p in t.page_table}))
    outs = [collect(rid, sink.chunks) for rid, sink in sinks]
    assert len(prefix_tables) == n
    tables = list(prefix_tables.values())
    assert all(t == tables[0] for t in tables[1:]), tables  # the same physical pages, not copies
    # only the last partial page (+ the decodes) is per choice: 10 shared pages, then per choice
    # the partial page holding tokens 40..47 (2 prompt + 6 generated) -> at most 10 + 4*1 pages
    assert 0 < peak_pages <= full + n * (-(-(len(ids) % PAGE + 6) // PAGE))
    for out in outs[1:]:
        assert out.cached_tokens["device"] == full * PAGE  # hit the leader's published prefix
    assert outs[0].cached_tokens["device"] == 0
    assert engine.check_accounting()["live_requests"] == 0


def test_choice_seeds_are_distinct_and_reproducible(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    engine_run = lambda: [o.token_ids for o in _run_choices(engine, [1, 2, 3, 4, 5], params, 3)]  # noqa: E731
    first, again = engine_run(), engine_run()
    assert first == again
    assert len({tuple(c) for c in first}) == 3
    single = _run_choices(engine, [1, 2, 3, 4, 5], params, 1)[0].token_ids
    assert single == first[0]  # choice 0 is the request as sent


def _run_choices(engine, ids, params, n):
    sinks, leader = [], None
    for i in range(n):
        sink = CollectingSink()
        rid = engine.submit(ids, params.for_choice(i), sink=sink, follows=leader)
        leader = leader or rid
        sinks.append((rid, sink))
    engine.run_until_idle()
    return [collect(rid, sink.chunks) for rid, sink in sinks]


def test_n_limits():
    with pytest.raises(InvalidRequestError, match="n must be"):
        Engine.generate_choices(None, [1], SamplingParams(), 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="n must be"):
        Engine.generate_choices(None, [1], SamplingParams(), 17)  # type: ignore[arg-type]
