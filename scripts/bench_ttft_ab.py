"""Cold TTFT side by side: two checkouts (this one and, say, a worktree of the commit before)
each build an engine in its own subprocess and prefill fresh random prompts cold; the trees
alternate round by round (ABBA...), so a machine whose speed drifts weighs on both.

    git worktree add /tmp/before HEAD~1
    python scripts/bench_ttft_ab.py --before /tmp/before --model <model> --tokens 4096 [--chunk 512]
        [--prompts 2] [--rounds 2]

Prints each run's TTFTs, then both medians and their ratio (after / before).  The engine
runs L1 only, greedy, one sampled token; its context is the prompt plus that token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy as np
from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig
model, tokens, chunk, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
engine = Engine(EngineConfig(model=model, show_progress=False, tiers="L1", max_batch_tokens=chunk,
                             device_tokens=max(8192, 4 * (tokens + chunk)), max_context_tokens=tokens + 1))
rng = np.random.default_rng(0)
low, high = 3, max(4, min(engine.vocab_size, 32000) - 2)  # clear of the byte model's BOS/EOS, as bench prefill
greedy = SamplingParams(max_tokens=1, temperature=0.0)
engine.generate([rng.integers(low, high, 64).tolist()], greedy)  # a first request: anything lazy happens here
times = []
for _ in range(prompts):
    prompt = rng.integers(low, high, tokens).tolist()
    start = time.perf_counter()
    engine.generate([prompt], greedy)
    times.append(time.perf_counter() - start)
engine.shutdown()
print(json.dumps(times))
"""


def run_tree(tree: str, args: argparse.Namespace) -> list[float]:
    command = [sys.executable, "-c", CHILD, args.model, str(args.tokens), str(args.chunk), str(args.prompts)]
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(command, cwd="/", env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: the engine run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout (e.g. a worktree of the commit before)")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[1]), help="default: this checkout")
    parser.add_argument("--model", default="tiny", help="model (tiny, a HF folder or a GGUF)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--chunk", type=int, default=512, help="the engine's max_batch_tokens (default 512)")
    parser.add_argument("--prompts", type=int, default=2, help="cold prompts per engine (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="engines per tree, alternating (default 2)")
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after}
    times: dict[str, list[float]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for label in order:
            got = run_tree(trees[label], args)
            times[label] += got
            print(f"round {round_} {label}: " + ", ".join(f"{t:.2f} s" for t in got), flush=True)
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    print(
        f"{args.tokens} tokens, chunk {args.chunk}: before {before:.2f} s, after {after:.2f} s "
        f"(medians of {len(times['before'])}); after / before {after / before:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
