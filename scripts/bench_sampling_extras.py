"""Decode step time with and without the sampling extras, side by side with a base commit.

    python scripts/bench_sampling_extras.py [--model PATH|tiny] [--batch 16] [--steps 40]
        [--base-checkout DIR] [--rounds 3]

Three variants, each timed in its own subprocess, interleaved over ``--rounds`` rounds
(A B C A B C ...) so machine noise hits all alike; reported as medians and ratios:

* ``base``:  the runner of ``--base-checkout`` (the commit before the extras; a git
  worktree of it), a batch asking for nothing;
* ``none``:  this checkout, a batch asking for nothing (must not be slower than base);
* ``all``:   this checkout, every row with repetition/frequency/presence penalties, a
  logit_bias, min_tokens masking and 20 top logprobs (must cost at most 15% more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _child(model: str, batch: int, steps: int, extras: bool) -> float:
    import time

    import jax
    import numpy as np

    from strata_jax.models.loader import load_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

    loaded = load_model(model, show_progress=False)
    context = 256
    page = 16
    pages_per_seq = context // page
    cfg = RunnerConfig(page_size=page, num_device_pages=batch * pages_per_seq + 1, max_batch_tokens=max(64, 2 * batch),
                       max_batch_size=batch, max_context_tokens=context)  # fmt: skip
    runner = ModelRunner(loaded.model, cfg)
    vocab = loaded.config.vocab_size
    kw: list[dict] = [{} for _ in range(batch)]
    if extras:
        from strata_jax.runtime.logits_processors import initial_bias, initial_flags

        for i in range(batch):
            slot = runner.sampling.acquire()
            runner.sampling.seed(slot, initial_flags(vocab, list(range(i, i + 64)), [0]), initial_bias(vocab, {5: 1.0, 7: -2.0}))
            kw[i] = dict(sampling_slot=slot, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                         min_tokens_active=True, logprobs=True)  # fmt: skip
    tokens = [1] * batch
    start = 64

    def step(pos: int):
        seqs = [
            SeqInput([tokens[i]], pos, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)), **kw[i])
            for i in range(batch)
        ]
        return runner.step(seqs)

    for w in range(3):  # compile + warm
        step(start + w)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        out = step(start + 3 + s)
        times.append(time.perf_counter() - t0)
        tokens[:] = [int(t) for t in out.next_tokens]
    jax.effects_barrier()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base-checkout", default=None, help="a checkout of the base commit (git worktree)")
    ap.add_argument("--child", choices=["none", "all"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"step_s": _child(args.model, args.batch, args.steps, args.child == "all")}))
        return
    variants = [("none", REPO), ("all", REPO)]
    if args.base_checkout:
        variants.insert(0, ("base", Path(args.base_checkout).resolve()))
    results: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, root in variants:
            child = "none" if name == "base" else name
            env = dict(os.environ, PYTHONPATH=str(root))
            cmd = [sys.executable, str(REPO / "scripts" / "bench_sampling_extras.py"), "--child", child,
                   "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps)]  # fmt: skip
            out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
            value = json.loads(out.stdout.strip().splitlines()[-1])["step_s"]
            results[name].append(value)
            print(f"round {r + 1} {name:>4}: {value * 1e3:8.2f} ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(json.dumps({"median_ms": {k: round(v * 1e3, 3) for k, v in med.items()}}, indent=None))
    if "base" in med:
        print(f"none / base = {med['none'] / med['base']:.3f}  (asks for nothing: must not be slower)")
    print(f"all / none  = {med['all'] / med['none']:.3f}  (every row asks: at most 1.15)")


if __name__ == "__main__":
    main()
