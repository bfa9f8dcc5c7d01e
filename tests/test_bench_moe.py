"""``strata-jax bench moe``: the command runs on a tiny layer and reports every path and ratio,
and the paths it times compute the same layer (the figures themselves are benchmarks, not
tests: no timing is asserted)."""

from __future__ import annotations

import argparse
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from test_moe import brute_force_moe

from strata_jax.bench import BENCHMARKS, load_benchmark
from strata_jax.bench.moe import (
    PATHS,
    LayerShape,
    combine,
    dense_path,
    grouped_path,
    loop_path,
    make_block,
    route_tokens,
    run_layer_bench,
)
from strata_jax.cli import main

TINY = LayerShape(hidden=48, experts=8, top_k=3, intermediate=40)
TINY_FLAGS = ["--hidden", "48", "--experts", "8", "--top-k", "3", "--intermediate", "40"]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(x / 2))


def test_registered_with_help_on_every_flag():
    assert BENCHMARKS["moe"] == "strata_jax.bench.moe"
    module = load_benchmark("moe")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in flags} >= {"hidden", "experts", "top_k", "intermediate", "tokens", "dtype", "repeats"}
    assert all(a.help for a in flags), [a.dest for a in flags if not a.help]
    assert module.DESCRIPTION


def test_cli_on_a_tiny_layer_prints_and_writes_every_path_and_ratio(tmp_path, capsys):
    path = tmp_path / "moe.json"
    argv = ["bench", "moe", *TINY_FLAGS, "--tokens", "1,13", "--repeats", "2", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for text in ("grouped", "dense", "loop", "block", "GFLOP/s", "grouped/dense", "grouped/loop", "target"):
        assert text in out, text
    report = json.loads(path.read_text())
    assert report["shape"] == {"hidden": 48, "experts": 8, "top_k": 3, "intermediate": 40, "dtype": "float32"}
    assert [p["tokens"] for p in report["points"]] == [1, 13] and report["skipped"] == []
    for point in report["points"]:
        assert set(point["ms"]) == set(PATHS) and point["rounds"] == 2
        assert point["expert_flops"] == 6 * point["tokens"] * 3 * 48 * 40
        assert point["loop_executed_flops"] == point["expert_flops"] * 8 // 3
        assert sum(point["group_sizes"]) == 3 * point["tokens"]
        assert point["experts_read"] == sum(1 for g in point["group_sizes"] if g)
        values = [point["ms"][n]["median"] for n in PATHS] + [point["expert_gflops"][n] for n in PATHS]
        values += list(point["ratios"].values())
        assert all(math.isfinite(v) and v > 0 for v in values)
        assert set(point["ratios"]) == {"grouped_vs_dense", "grouped_vs_loop", "grouped_vs_ragged_dot", "block_vs_loop"}
        # the timed paths computed the same layer
        assert max(point["rel_err"].values()) < 1e-5, point["rel_err"]
    assert report["grouped_method"] == "tiles"  # this CPU's


def test_no_block_flag_and_bad_arguments(tmp_path):
    path = tmp_path / "moe.json"
    argv = ["bench", "moe", *TINY_FLAGS, "--tokens", "4", "--repeats", "2", "--no-block", "--json", str(path)]
    assert main(argv) == 0
    point = json.loads(path.read_text())["points"][0]
    assert set(point["ms"]) == {"grouped", "ragged_dot", "dense", "loop"} and "block_vs_loop" not in point["ratios"]
    for bad in (["--tokens", "0"], ["--tokens", "a,b"], ["--top-k", "9"], ["--repeats", "1"]):
        with pytest.raises(SystemExit):
            main(["bench", "moe", *TINY_FLAGS, *bad])


def test_a_passed_deadline_skips_every_count_but_the_first():
    """The GPU check's time box: on a loaded machine its layer comparison may start after the
    deadline; the first count still runs (one measured row to report), the rest are skipped."""
    seen = []
    report = run_layer_bench(
        TINY, [2, 5, 9], repeats=2, time_limit_s=0.5, with_block=False, deadline=0.0, on_point=seen.append
    )
    assert [p["tokens"] for p in report["points"]] == [2] and report["skipped"] == [5, 9]
    assert len(seen) == 1 and seen[0] is report


@pytest.mark.parametrize("tokens", [1, 37])
def test_the_three_paths_compute_the_same_layer(tokens):
    """On one routed input: the engine's grouped experts (rows put back and weighted), the
    masked loop and the whole block all equal a float64 brute force; the dense chain is the
    grouped path with every row sent to expert 0 (same FLOPs, same matmuls)."""
    block = make_block(TINY, seed=tokens)
    x = jnp.asarray(np.random.default_rng(tokens).normal(size=(tokens, TINY.hidden)), jnp.float32)
    routed = route_tokens(block, x)
    assert int(np.sum(np.asarray(routed.group_sizes))) == tokens * TINY.top_k
    want = brute_force_moe(block, np.asarray(x))  # the bench's block renormalizes its top-k
    tol = dict(rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))

    grouped, lead = grouped_path(block)
    np.testing.assert_allclose(combine(grouped(*lead, routed.rows, routed.group_sizes), routed), want, **tol)
    ragged, ragged_lead = grouped_path(block, "ragged_dot")
    np.testing.assert_allclose(combine(ragged(*ragged_lead, routed.rows, routed.group_sizes), routed), want, **tol)
    loop, loop_lead = loop_path(block, block.experts.act_name)
    np.testing.assert_allclose(np.asarray(loop(*loop_lead, routed.x, routed.dense_weights)), want, **tol)
    np.testing.assert_allclose(np.asarray(block(x)), want, **tol)

    dense, dense_lead = dense_path(block, block.experts.act_name)
    all_to_expert_0 = jnp.asarray([tokens * TINY.top_k] + [0] * (TINY.experts - 1), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(dense(*dense_lead, routed.rows)),
        np.asarray(grouped(*lead, routed.rows, all_to_expert_0)),
        rtol=2e-5,
        atol=2e-5,
    )
