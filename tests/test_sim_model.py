"""Simulator pieces against plain re-implementations: cost model formulas, link paths,
profiles, the load-or-recompute stage, the online fit's running sums, and a whole run."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from strata_jax.scheduler import CostModel, CostPrior, Scheduler, SchedulerConfig
from strata_jax.scheduler.cost_model import _OnlineLinearModel
from strata_jax.scheduler.testing import FakeCache
from strata_jax.sim.cost import SimCostModel
from strata_jax.sim.model_spec import load_model_spec
from strata_jax.sim.profile import ProfileError, load_profile

H200 = load_profile("h200")
LLAMA8B = load_model_spec("llama-3.1-8b")


@pytest.fixture(scope="module")
def shared_data():
    """The team's shared/data (LooGLE, Mooncake traces) beside the clone, as CI lays it."""
    from strata_jax.sim import workloads as W

    try:
        return W.find_data_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"needs the shared data beside the repository ({exc})")


def test_model_spec_bytes_match_the_published_shapes():
    assert LLAMA8B.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert 7.9e9 < LLAMA8B.config.num_parameters < 8.1e9
    tp4 = load_model_spec("llama-3.1-70b-tp4")
    assert tp4.tp == 4 and tp4.kv_bytes_per_token == 80 * 2 * 2 * 128 * 2  # 8 KV heads over 4 ranks
    assert 69e9 < tp4.config.num_parameters < 72e9


def test_naive_path_reaches_strata_22_percent_at_page_32_and_coalesced_75():
    cost = SimCostModel(H200, LLAMA8B, page_size=32)
    assert cost.link_efficiency(1, "naive") == pytest.approx(0.22, abs=0.005)
    assert cost.link_efficiency(1000, "naive") == pytest.approx(0.22, abs=0.005)  # per-copy cost: no amortisation
    assert cost.link_efficiency(1000, "coalesced") == pytest.approx(0.75, abs=0.01)
    assert cost.link_efficiency(1, "coalesced") < cost.link_efficiency(10, "coalesced")  # the fixed overhead amortises
    small = SimCostModel(H200, LLAMA8B, page_size=8)  # smaller pages, smaller copies: worse
    assert small.link_efficiency(100, "naive") < 0.1


def test_extend_and_decode_times_follow_the_formulas():
    cost = SimCostModel(H200, LLAMA8B, page_size=32)
    c, p = LLAMA8B.config, H200
    items = [(1000, 0), (50, 20000)]
    body = c.num_parameters - 2 * c.vocab_size * c.hidden_size
    linear = (2 * body * 1050 + 2 * 2 * c.vocab_size * c.hidden_size) / (p.matmul_flops_per_s * p.matmul_efficiency)
    pairs = 1000 * 500 + 50 * (20000 + 25)
    attn = 4 * c.num_layers * c.num_heads * c.head_dim * pairs / (p.matmul_flops_per_s * p.attention_efficiency)
    assert cost.extend_seconds(items) == pytest.approx(p.step_overhead_s + linear + attn, rel=1e-9)
    read = c.num_parameters * 2 + 64 * 20000 * LLAMA8B.kv_bytes_per_token
    assert cost.decode_seconds(64, 64 * 20000) == pytest.approx(
        p.step_overhead_s + read / (p.hbm_bytes_per_s * p.hbm_efficiency), rel=1e-9
    )
    assert 700_000 < cost.device_kv_tokens() < 900_000  # (141 GB * 0.85 - 16 GB) / 128 KiB


def test_profile_errors_name_the_file_and_field(tmp_path):
    raw = json.loads(H200.to_json())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**raw, "link_gbps": 1}))
    with pytest.raises(ProfileError, match="unknown field.*link_gbps"):
        load_profile(bad)
    del raw["hbm_bytes"]
    bad.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match=r"bad.json: missing field\(s\) hbm_bytes"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="unknown hardware profile 'h9000'"):
        load_profile("h9000")
    assert load_profile("gh200").link_peak_bytes_per_s == 450e9


def test_layerwise_overlap_and_stall_accounting():
    from strata_jax.api import SamplingParams
    from strata_jax.cache.handles import TransferHandle
    from strata_jax.engine.executor import ExtendChunk
    from strata_jax.engine.requests import TrackedRequest
    from strata_jax.engine.sinks import CollectingSink
    from strata_jax.sim.executor import SimClock, SimExecutor, SimTimer

    cost = SimCostModel(H200, LLAMA8B, page_size=32)
    for layerwise in (False, True):
        clock = SimClock()
        timer = SimTimer(clock, cost, "naive")
        ex = SimExecutor(clock, cost, timer, layerwise=layerwise, token_for=lambda r, i: 0)
        h = TransferHandle("load", "a", 600, 0, 0.0)
        h.landed_at = timer.land_time("load", 600, 0, 0.0)
        row = TrackedRequest("a", [1] * 19250, "", SamplingParams(), CollectingSink(), None, 0.0)
        out = ex.collect(ex.dispatch_extend([ExtendChunk(row, [1] * 50, 19200)], [h]))
        compute = cost.extend_seconds([(50, 19200)])
        expect = max(compute, h.landed_at + compute / 32) if layerwise else h.landed_at + compute
        assert out.seconds == pytest.approx(expect)
        assert ex.stats.stall_s == pytest.approx(expect - compute)
        assert ex.stats.stall_s / ex.stats.prefill_s > 0.9  # a short question on a loaded document waits on the link


def _load_or_recompute_plan(link_bytes_per_s: float, host_tokens: int):
    prior = CostPrior(bytes_per_token=131072, link_bytes_per_s=link_bytes_per_s, transfer_overhead_s=1e-3)
    sched = Scheduler(SchedulerConfig(max_batch_tokens=8192, enable_load_or_recompute=True), CostModel(prior))
    cache = FakeCache()
    prompt = list(range(host_tokens + 40))
    cache.add_ready(prompt[:host_tokens], "host")
    sched.submit("r", prompt)
    return sched, sched.schedule(cache), prior


def test_load_or_recompute_picks_the_cheaper_and_counts_it():
    # A short host prefix over a slow link: recomputing 64 tokens beats loading 8 MiB plus the overhead.
    sched, plan, prior = _load_or_recompute_plan(1e9, 64)
    (item,) = plan.prefill
    cost = CostModel(prior)
    load = cost.load_seconds(64) + prior.transfer_overhead_s
    recompute = cost.extend_seconds(104, 0) - cost.extend_seconds(40, 64)
    assert load > recompute
    assert (item.start, item.load_host_tokens, item.recomputed_cached_tokens) == (0, 0, 64)
    assert (sched.stats().load_or_recompute_recomputed, sched.stats().load_or_recompute_tokens) == (1, 64)
    # A long prefix over a fast link: loading wins (and nothing is counted).
    sched, plan, prior = _load_or_recompute_plan(50e9, 16384)
    (item,) = plan.prefill
    assert (item.start, item.load_host_tokens, item.recomputed_cached_tokens) == (16384, 16384, 0)
    assert sched.stats().load_or_recompute_recomputed == 0
    # Off (the default, as in Strata): always load.
    sched = Scheduler(SchedulerConfig(), CostModel(CostPrior(link_bytes_per_s=1e9, transfer_overhead_s=1e-3)))
    cache = FakeCache()
    cache.add_ready(list(range(64)), "host")
    sched.submit("r", list(range(104)))
    assert sched.schedule(cache).prefill[0].load_host_tokens == 64


def test_online_fit_with_running_sums_matches_a_direct_ridge_solve():
    rng = random.Random(3)
    prior, window, weight = (4e-3, 3e-5, 1e-9), 16, 0.01
    model = _OnlineLinearModel(prior, window, weight)
    samples = []
    for _ in range(200):  # 200 > 4 * window: the periodic re-summation runs too
        x = (1.0, rng.uniform(1, 8192), rng.uniform(1e3, 1e9))
        y = 2e-3 + 4e-5 * x[1] + 2e-9 * x[2] + rng.gauss(0, 1e-4)
        model.observe(x, max(0.0, y))
        samples.append((x, max(0.0, y)))
        w = samples[-window:]
        X = np.array([s[0] for s in w])
        Y = np.array([s[1] for s in w])
        scale, ys = np.abs(X).max(axis=0), Y.max()
        A = X / scale
        b = Y / ys
        pr = np.array(prior) * scale / ys
        theta = np.linalg.solve(A.T @ A + weight * np.eye(3), A.T @ b + weight * pr)
        if (theta >= 0).all():  # the non-negative active set is then inactive
            np.testing.assert_allclose(model.coeffs, theta * ys / scale, rtol=1e-6, atol=1e-12)


def test_a_small_loogle_run_finishes_every_request_with_exact_accounting(shared_data):
    from strata_jax.sim import workloads as W
    from strata_jax.sim.runner import SimSetup, simulate
    from strata_jax.sim.systems import get_system

    setup = SimSetup(LLAMA8B, H200, device_tokens=120_000, host_tokens=2_000_000)
    reqs = W.loogle(num_requests=80, rate=4.0, seed=1, data_dir=shared_data, docs=8, distance="max")
    results = {}
    for name in ("hicache", "strata", "l1-only"):
        results[name] = r = simulate(reqs, get_system(name), setup, 4.0)
        assert r.finished == 80
        assert 0 <= r.load_stall_fraction < 1 and 0 < r.hit_rate < 1
    assert results["l1-only"].extra["loaded_pages"] == 0
    assert results["hicache"].extra["loaded_pages"] > 0  # documents cycle through L2
    assert results["strata"].ttft_mean < results["hicache"].ttft_mean
    assert results["hicache"].load_stall_fraction > results["strata"].load_stall_fraction


def test_warmup_computes_every_document_once_and_is_left_out_of_the_metrics(shared_data):
    from strata_jax.sim import workloads as W
    from strata_jax.sim.runner import SimSetup, simulate
    from strata_jax.sim.systems import get_system

    setup = SimSetup(LLAMA8B, H200, device_tokens=120_000, host_tokens=2_000_000)
    cold = W.loogle(num_requests=80, rate=4.0, seed=1, data_dir=shared_data, docs=8, distance="max")
    warm = W.loogle(num_requests=80, rate=4.0, seed=1, data_dir=shared_data, docs=8, distance="max", warmup=True)
    assert [r.warmup for r in warm] == [True] * 8 + [False] * 80
    assert [(r.prompt, r.arrival_s, r.group) for r in warm[8:]] == [(r.prompt, r.arrival_s, r.group) for r in cold]
    docs = {r.group: r.prompt for r in warm[:8]}
    assert all(r.output_len == 1 for r in warm[:8]) and len(docs) == 8
    assert all(r.prompt[: len(docs[r.group])] == docs[r.group] for r in cold)
    for name in ("hicache", "strata"):
        c, w = simulate(cold, get_system(name), setup, 4.0), simulate(warm, get_system(name), setup, 4.0)
        assert w.finished == c.finished == 80 and w.extra["warmup_requests"] == 8 and w.extra["warmup_s"] > 0
        # every measured question finds its whole document cached (page-aligned): nothing is recomputed
        expected_hits = sum(len(docs[r.group]) // setup.page_size * setup.page_size for r in cold)
        assert sum(w.extra["hit_tokens"].values()) == expected_hits
        assert w.hit_rate == pytest.approx(expected_hits / sum(len(r.prompt) for r in cold))
        assert w.hit_rate > c.hit_rate and w.ttft_mean < c.ttft_mean


def test_workload_shapes(shared_data):
    from strata_jax.sim import workloads as W

    data = shared_data
    mn = W.loogle(num_requests=40, rate=math.inf, seed=0, data_dir=data, docs=5, distance="min")
    mx = W.loogle(num_requests=40, rate=math.inf, seed=0, data_dir=data, docs=5, distance="max")
    assert [r.group for r in mn[:3]] == ["doc0"] * 3
    assert [r.group for r in mx[:5]] == [f"doc{i}" for i in range(5)]
    assert len(mn) == len(mx) == 40 and len({r.group for r in mx}) == 5
    trace = W.mooncake(num_requests=50, path=data / "mooncake" / "conversation_trace.jsonl", speedup=2.0)
    raw = [json.loads(line) for line in (data / "mooncake" / "conversation_trace.jsonl").read_text().splitlines()[:50]]
    assert [r.arrival_s for r in trace] == [row["timestamp"] / 1000 / 2.0 for row in raw]
    assert trace[0].prompt[:512] == trace[1].prompt[:512]  # equal leading hash ids share a prefix
    mt = W.multiturn(num_requests=20, rate=1.0, seed=0, rounds=4)
    assert sum(r.depends_on is None for r in mt) == 5
    assert all(r.prompt == r.new_tokens and len(r.prompt) == 512 for r in mt if r.depends_on is None)


def test_a_multiturn_run_grows_each_conversation_by_its_answers():
    """Each turn's prompt is the previous turn's prompt + its answer + the new message, so
    a later turn finds the whole history cached (up to the last full page)."""
    from strata_jax.sim import workloads as W
    from strata_jax.sim.runner import SimSetup, simulate
    from strata_jax.sim.systems import get_system

    reqs = W.multiturn(num_requests=12, rate=1.0, seed=0, rounds=3, request_length=100, output_len=20)
    setup = SimSetup(LLAMA8B, H200, device_tokens=100_000, host_tokens=1_000_000)
    r = simulate(reqs, get_system("strata"), setup, 1.0)
    assert r.finished == 12
    # turn k's prompt: k * 100 message tokens + (k - 1) * 20 answer tokens; the history before the
    # new message is cached up to its last full page (page 32), minus the final answer token,
    # whose KV is never computed (it is sampled, not fed back, when the turn ends)
    expected_prompt = sum(k * 100 + (k - 1) * 20 for k in (1, 2, 3)) * 4
    expected_hits = sum(((k - 1) * 120 - 1) // 32 * 32 for k in (2, 3)) * 4
    assert r.extra["requests"] == 12
    assert sum(r.extra["hit_tokens"].values()) == expected_hits
    assert r.hit_rate == pytest.approx(expected_hits / expected_prompt)


def test_simulate_cli_writes_the_documented_json_and_plot(tmp_path, capsys):
    from strata_jax.cli import main

    out, png = tmp_path / "runs.json", tmp_path / "fig.png"
    argv = [
        "simulate",
        "--workload",
        "sharegpt",
        "--num-requests",
        "30",
        "--rates",
        "2,8",
        "--systems",
        "hicache,strata",
        "--json",
        str(out),
        "--no-progress",
    ]
    pytest.importorskip("matplotlib")
    assert main(argv + ["--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"runs", "wall_s"} and len(doc["runs"]) == 4
    keys = {
        "system",
        "rate",
        "ttft_mean",
        "ttft_p99",
        "throughput_rps",
        "output_tps",
        "load_stall_fraction",
        "hit_rate",
    }
    assert all(keys <= set(r) and r["finished"] == 30 for r in doc["runs"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "sustained rate" in capsys.readouterr().out
    assert main(["simulate", "--systems", "vllm", "--no-progress"]) == 2
    assert "unknown system 'vllm'" in capsys.readouterr().err


def test_calibrate_turns_its_timings_into_the_profile_fields(monkeypatch):
    """--calibrate: each profile field is the documented formula over the measured times
    (timings replaced by known values), and the profile round-trips through load_profile."""
    pytest.importorskip("jax")
    from strata_jax.sim import calibrate as C

    times = iter([2e-2, 1e-2, 512 * 5e-5, 4e-3, 1e-3])  # coalesced, peak, 512 naive copies, matmul, elementwise
    monkeypatch.setattr(C, "_median", lambda fn, repeats=5: next(times))
    prof = C.calibrate(H200, progress=False)
    page_bytes = 8 * 2 * 32 * 8 * 128 * 4  # 8 layers x K,V x page 32 x 8 heads x dim 128, float32 on CPU
    nbytes, block = 256 * page_bytes, 32 * 8 * 128 * 4
    peak = nbytes / 1e-2
    assert prof.link_peak_bytes_per_s == pytest.approx(peak)
    assert prof.coalesced_efficiency == pytest.approx(min(1.0, nbytes / 2e-2 / peak)) == pytest.approx(0.5)
    assert prof.naive_copy_overhead_s == pytest.approx(5e-5 - block / peak)
    assert prof.matmul_flops_per_s == pytest.approx(2 * 1024**3 / 4e-3)
    assert prof.hbm_bytes_per_s == pytest.approx(2 * (64 << 20) / 1e-3)
    assert prof.attention_efficiency == pytest.approx(H200.attention_efficiency / H200.matmul_efficiency)
    assert (prof.host_kv_bytes, prof.step_overhead_s) == (H200.host_kv_bytes, H200.step_overhead_s)
    assert prof.name.startswith("calibrated:")


def test_calibrate_cli_writes_a_profile_the_simulator_runs_on(tmp_path):
    """The real measurement on this machine: a loadable profile with sane values, usable by simulate."""
    pytest.importorskip("jax")
    from strata_jax.cli import main
    from strata_jax.sim import workloads as W
    from strata_jax.sim.runner import SimSetup, simulate
    from strata_jax.sim.systems import get_system

    path = tmp_path / "calibrated.json"
    assert main(["simulate", "--calibrate", str(path), "--no-progress"]) == 0
    prof = load_profile(str(path))
    assert 0 < prof.coalesced_efficiency <= 1 and prof.naive_copy_overhead_s >= 0
    assert 1e8 < prof.link_peak_bytes_per_s < 1e13 and 1e8 < prof.hbm_bytes_per_s < 1e13
    assert 1e8 < prof.matmul_flops_per_s < 1e15
    reqs = W.sharegpt(num_requests=20, rate=4.0, seed=0)
    result = simulate(reqs, get_system("strata"), SimSetup(LLAMA8B, prof), 4.0)
    assert result.finished == 20 and result.ttft_mean > 0


def test_simulated_systems_run_the_papers_stages_without_short_first() -> None:
    from strata_jax.scheduler.policy import resolve_stages
    from strata_jax.sim.systems import SYSTEMS

    for name, system in SYSTEMS.items():
        stages = resolve_stages(SchedulerConfig(**system.scheduler_kwargs()))
        assert not stages.short_first, name
    assert resolve_stages(SchedulerConfig()).short_first  # the engine's default has it
