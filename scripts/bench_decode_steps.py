"""Decode step times through the engine on the real SmolLM2 (float32): random prompts of
``--context`` tokens prefilled into L1, then ``--steps`` decode steps at each batch size;
prints the median step as the executor stamped it (the time the scheduler's cost model
learns from).  Compare settings by running it twice, e.g.:

    python scripts/bench_decode_steps.py --batches 1,16
    STRATA_NATIVE_KERNELS=0 python scripts/bench_decode_steps.py --batches 1,16
    python scripts/bench_decode_steps.py --layer-weights stacked
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_model import smollm2_gguf_path

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=1950, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    parser.add_argument("--layer-weights", default="auto", help="EngineConfig.layer_weights")
    args = parser.parse_args()
    engine = Engine(
        EngineConfig(
            model=str(smollm2_gguf_path()), dtype="float32", layer_weights=args.layer_weights, show_progress=False
        )
    )
    print(f"native decode attention: {engine.runner.native_kernels}; layer weights: {engine.runner.layer_weights}")
    steps: list[tuple[int, float]] = []
    cost = engine.scheduler.cost
    observe = cost.observe_decode

    def record(rows: int, context: int, seconds: float) -> None:
        steps.append((rows, seconds))
        observe(rows, context, seconds)

    cost.observe_decode = record
    rng = np.random.default_rng(0)

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    try:
        for rows in (int(b) for b in args.batches.split(",")):
            engine.flush_cache()
            prompts = [rng.integers(100, 40000, args.context).tolist() for _ in range(rows)]
            engine.generate(prompts, greedy(1))  # prefilled, held in L1
            steps.clear()
            engine.generate(prompts, greedy(args.steps + 1))
            times = [s for r, s in steps if r == rows]
            step = statistics.median(times)
            print(
                f"decode {rows:2d} rows, {args.context}-token contexts: {len(times)} steps, median {step * 1e3:.1f} ms "
                f"({rows / step:.1f} tok/s)"
            )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
