"""Which rows verify (issue 38, adaptive): ``Speculator.choose`` against brute force over
every subset, the break-even from measured step times, the shadow scoring of rows that
step aside, and rows that flip between held and not mid-run in the engine."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from test_spec_engine import SPEC, _engine

from strata_jax.api import SamplingParams
from strata_jax.engine.speculation import Speculator, rows_bucket
from strata_jax.spec import parse_speculative_config

CONFIG = parse_speculative_config(SPEC)  # the engine tests' config


def _measured(decode: dict[int, float], verify: dict[int, float]) -> Speculator:
    spec = Speculator(CONFIG)
    for table, observe in ((decode, spec.observe_decode), (verify, spec.observe_verify)):
        for rows, seconds in table.items():
            observe(rows, 123.0)  # a program's first run is not kept
            observe(rows, seconds)
    return spec


def _rate_of(spec: Speculator, plain: int, gains: list[float], chosen: set[int], decode, verify) -> float:
    """Expected tokens per second of a step, computed directly from the tables."""
    n_verify = len(chosen)
    n_decode = plain + len(gains) - n_verify

    def seconds(table, rows):
        return 0.0 if rows == 0 else table[rows_bucket(rows)]

    tokens = plain + len(gains) + sum(gains[i] for i in chosen)
    return tokens / (seconds(decode, n_decode) + seconds(verify, n_verify))


@pytest.mark.parametrize("seed", range(12))
def test_choose_is_the_best_subset(seed):
    rng = np.random.default_rng(seed)
    buckets = [1, 2, 4, 8]
    decode = {b: 0.03 + 0.004 * b * rng.random() for b in buckets}
    verify = {b: decode[b] * rng.uniform(0.9, 3.5) for b in buckets}
    spec = _measured(decode, verify)
    n = int(rng.integers(1, 5))
    plain = int(rng.integers(0, 8 - n + 1))
    lengths = rng.integers(1, 5, size=n).tolist()
    for i in range(n):  # each row's running acceptance from one recorded verification
        kept = int(rng.integers(0, lengths[i] + 1))
        spec.accepted([7] * lengths[i], [7] * kept + [0] * (lengths[i] + 1 - kept), f"r{i}")
    gains = [min(float(lengths[i]), spec.acceptance(f"r{i}")) for i in range(n)]
    got = spec.choose(plain, [(f"r{i}", lengths[i]) for i in range(n)])
    best = max(
        _rate_of(spec, plain, gains, set(c), decode, verify)
        for k in range(n + 1)
        for c in itertools.combinations(range(n), k)
    )
    assert _rate_of(spec, plain, gains, {i for i in range(n) if got[i]}, decode, verify) == pytest.approx(best)


def test_unmeasured_programs_are_tried_first():
    spec = Speculator(CONFIG)
    assert spec.choose(3, [("a", 4), ("b", 4)]) == [True, True]  # no verification of 2 rows measured
    spec.observe_verify(2, 1.0)
    assert spec.choose(3, [("a", 4), ("b", 4)]) == [True, True]  # its first run is not kept
    spec.observe_verify(2, 1.0)
    assert spec.choose(3, [("a", 4), ("b", 4)]) == [False, False]  # now the decode of 5 rows is measured


def test_break_even_is_the_measured_ratio_less_one():
    spec = Speculator(CONFIG)
    assert spec.break_even() == 0.0
    spec = _measured({1: 0.04, 8: 0.10}, {1: 0.12, 8: 0.25})
    spec.observe_decode(1, 0.04)
    assert spec.break_even() == pytest.approx(0.12 / 0.04 - 1)
    spec.observe_decode(6, 0.10)  # the batch now: 6 rows, bucket 8
    assert spec.break_even() == pytest.approx(0.25 / 0.10 - 1)
    spec.observe_decode(6, float("nan"))  # never learned
    assert spec.break_even() == pytest.approx(0.25 / 0.10 - 1)


def _row(rid: str):
    return SimpleNamespace(request_id=rid, params=SamplingParams(max_tokens=64), grammar=None)


def test_rows_below_the_break_even_are_not_held_and_are_scored_by_shadow_proposals():
    spec = _measured({1: 0.04}, {1: 0.12})  # break-even: 2 accepted tokens
    spec.observe_decode(1, 0.04)
    row = _row("a")
    spec.accepted([1, 2, 3, 4], [9, 9, 9, 9, 9], "a")  # nothing accepted: estimate 0
    assert not spec.wants_token(row)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    output: list[int] = []
    # a shadow proposal is made every k + 1 = 5 tokens; copying the prompt's cycle matches it
    for token in [7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5]:
        output.append(token)
        spec.observe_token("a", token, prompt, output)
    assert spec.acceptance("a") > 0
    # a shadow scored all 4 proposed tokens: 4 accepted, weighed into the running estimate
    while not spec.wants_token(row):
        token = [7, 8, 5, 6][len(output) % 4]
        output.append(token)
        spec.observe_token("a", token, prompt, output)
        assert len(output) < 200
    spec.forget("a")
    assert spec.acceptance("a") == spec.acceptance("never seen")


def test_step_aside_rests_then_returns():
    spec = Speculator(CONFIG)
    row = _row("a")
    assert spec.wants_token(row)  # nothing measured: try
    spec.step_aside("a", [1, 2, 3])
    assert not spec.wants_token(row)
    output: list[int] = []
    for i in range(spec.rest_tokens):
        assert not spec.wants_token(row)
        output.append(10 + i)  # never what it proposed, nothing to look up: its rest runs to the end
        spec.observe_token("a", 10 + i, [4, 4], output)
    assert spec.wants_token(row)


def test_a_batch_size_where_every_candidate_was_declined_holds_no_row_for_a_while():
    """At a load where verifying does not pay, rows held only to be declined would cost every
    step its host/device overlap: after a decline no row is held at that batch size for a
    wait that doubles with each decline in a row, and one chosen verification ends it."""
    # 32 rows: a decode of 32 costs 0.30 s, a verification of 2 rows 0.16 s
    spec = _measured({32: 0.30, 16: 0.2, 2: 0.05}, {2: 0.16, 32: 1.2})
    rows = [_row(f"r{i}") for i in range(32)]
    assert all(spec.wants_token(r) for r in rows[:2])  # fresh rows: the benefit of the doubt
    waits = []
    for _ in range(3):
        assert spec.choose(30, [("r0", 4), ("r1", 4)]) == [False, False]  # 2 tokens each cannot pay
        steps = 0
        while not spec.wants_token(rows[5]):  # a row that never stepped aside
            spec.observe_decode(32, 0.30)
            steps += 1
            assert steps <= 1000
        waits.append(steps)
    assert waits == [spec.rest_tokens, 2 * spec.rest_tokens, 4 * spec.rest_tokens]
    # another batch size is not affected
    assert spec.choose(30, [("r0", 4), ("r1", 4)]) == [False, False]
    spec.observe_decode(16, 0.2)
    assert spec.wants_token(rows[5])
    # a verification chosen in a batch of this size ends its wait: the next decline waits the first wait
    copying = [f"c{i}" for i in range(32)]
    for rid in copying:
        spec.accepted([7] * 4, [7] * 4 + [0], rid)  # these copy: 4 accepted per proposal
    assert spec.choose(0, [(rid, 4) for rid in copying]) == [True] * 32
    spec.observe_decode(32, 0.30)
    assert spec.wants_token(rows[5])
    assert spec.choose(30, [("r0", 4), ("r1", 4)]) == [False, False]
    steps = 0
    while not spec.wants_token(rows[5]):
        spec.observe_decode(32, 0.30)
        steps += 1
    assert steps == spec.rest_tokens


class _Flipping(Speculator):
    """A break-even that flips on every call: rows go from held to not held between a
    dispatch and the read of its token (which once left a row held for ever)."""

    calls = 0

    def break_even(self) -> float:
        self.calls += 1
        return 0.0 if self.calls % 2 else 1e9


def test_rows_flipping_between_held_and_not_finish_with_the_same_tokens():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=20).tolist() * 3 for _ in range(4)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _engine(None)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    spec = _engine(SPEC)
    flipping = _Flipping(CONFIG)
    spec._call(lambda: setattr(spec.core, "speculator", flipping))
    try:
        got = [o.token_ids for o in spec.generate(prompts, params)]
        stats = spec.cache_stats()["speculation"]
    finally:
        spec.shutdown()
    assert got == want
    assert flipping.calls > 10
    c = flipping.counters
    assert (stats["drafts"], stats["accepted_tokens"]) == (c.drafts, c.accepted_tokens)
    assert (
        stats["accepted_per_position"] == c.accepted_per_position and stats["stepped_aside"] == flipping.stepped_aside
    )


def test_metrics_export_the_speculation_counters():
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from serving.metrics import EngineStatsCollector

    stats = {
        "speculation": {
            "drafts": 5,
            "draft_tokens": 20,
            "accepted_tokens": 9,
            "accepted_per_position": [4, 3, 2, 0],
            "mean_accepted_length": 2.8,
            "stepped_aside": 7,
            "break_even_accepted_tokens": 1.5,
        }
    }
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: SimpleNamespace(cache_stats=lambda: stats)))
    text = generate_latest(registry).decode()
    for line in (
        "strata_engine_speculation_drafts_total 5.0",
        "strata_engine_speculation_draft_tokens_total 20.0",
        "strata_engine_speculation_accepted_tokens_total 9.0",
        "strata_engine_speculation_stepped_aside_total 7.0",
        "strata_engine_speculation_mean_accepted_length 2.8",
        'strata_engine_speculation_accepted_per_position_total{position="0"} 4.0',
        'strata_engine_speculation_accepted_per_position_total{position="3"} 0.0',
    ):
        assert line in text, line
