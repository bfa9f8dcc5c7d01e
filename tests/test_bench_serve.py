"""bench serve: JSON shape, dependent multi-turn requests, and the delay-hit effect in the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata_jax.api import SamplingParams
from strata_jax.bench import run_benchmark, workloads
from strata_jax.engine import Engine, EngineConfig


@pytest.mark.heavy  # 20-50 s on 2 cores; the default suite stays near 15 min
def test_serve_bench_multiturn_json(tmp_path):
    out = tmp_path / "serve.json"
    code = run_benchmark(
        "serve",
        [
            "--workload",
            "multiturn",
            "--clients",
            "2",
            "--rounds",
            "2",
            "--request-length",
            "20",
            "--output-len",
            "3",
            "--max-batch-tokens",
            "64",
            "--max-batch-size",
            "2",
            "--device-tokens",
            "1024",
            "--policy",
            "strata,fifo",
            "--json",
            str(out),
        ],
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["runs"]] == ["strata", "fifo"]
    for run in report["runs"]:
        assert run["requests"] == 4 and not run["errors"]
        assert run["compiles_after_warmup"] == 0
        assert run["ttft_p50"] <= run["ttft_p90"] <= run["ttft_p99"]
        # turn 2 of each client re-sends turn 1 + its answer: that prefix is served from cache
        assert sum(run["hit_tokens"].values()) >= 2 * 16


def test_mooncake_blocks_share_prefixes(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = workloads.mooncake_trace(
        250, path=trace, num_requests=10, max_input_tokens=4096, output_len=None, time_scale=1.0
    )
    assert len(a.prompt_ids) == 700 and len(b.prompt_ids) == 600
    assert a.prompt_ids[:512] == b.prompt_ids[:512] and a.prompt_ids[512:600] != b.prompt_ids[512:600]
    assert b.arrival_s == 0.01 and max(a.prompt_ids) < 250


def _recomputed(policy: str, prompts: list[list[int]]) -> tuple[int, int]:
    engine = Engine(
        EngineConfig(
            model="tiny",
            policy=policy,
            warmup=False,
            show_progress=False,
            tiers="L1",
            device_tokens=4096,
            max_batch_tokens=256,
            max_batch_size=4,
        ),
        start=False,
    )
    for p in prompts:
        engine.submit(p, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_until_idle()
    stats = engine.cache_stats()
    engine.shutdown()
    return stats["recomputed_tokens"], stats["deferrals"]


def test_strata_recomputes_less_than_fifo_on_a_shared_new_document():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 256, size=400).tolist()
    prompts = [doc + rng.integers(0, 256, size=8).tolist() for _ in range(4)]  # arrive together
    strata, deferrals = _recomputed("strata", prompts)
    fifo, _ = _recomputed("fifo", prompts)
    assert deferrals > 0
    assert strata < fifo
    assert strata <= 400 + 4 * 32  # the document once, plus each question's last pages
