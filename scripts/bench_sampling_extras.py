"""Decode step time with and without the sampling extras, side by side with a base commit.

    python scripts/bench_sampling_extras.py [--model PATH|tiny] [--batch 16] [--steps 40]
        [--base-checkout DIR] [--rounds 3] [--temperature T]

Three variants, reported as medians and ratios:

* ``base``:  the runner of ``--base-checkout`` (the commit before the extras, e.g. a
  ``git archive`` of it), a batch asking for nothing;
* ``none``:  this checkout, a batch asking for nothing (must not be slower than base);
* ``all``:   this checkout, every row with repetition/frequency/presence penalties, a
  logit_bias, min_tokens masking and 20 top logprobs (must cost at most 15% more).

``none`` and ``all`` run in one process on one runner, alternating blocks of steps;
``base`` runs in its own process; base and this checkout alternate over ``--rounds``
so machine noise hits all alike.
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


def _child(model: str, batch: int, steps: int, variants: list[str], temperature: float) -> dict[str, float]:
    import time

    import jax

    from strata_jax.models.loader import load_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

    loaded = load_model(model, show_progress=False)
    context, page = 256, 16
    pages_per_seq = context // page
    cfg = RunnerConfig(
        page_size=page,
        num_device_pages=batch * pages_per_seq + 1,
        max_batch_tokens=max(64, 2 * batch),
        max_batch_size=batch,
        max_context_tokens=context,
    )
    runner = ModelRunner(loaded.model, cfg)
    vocab = loaded.config.vocab_size
    sampling = {"temperature": temperature, "rng_key": (1, 2)} if temperature > 0 else {}
    kws: dict[str, list[dict]] = {"none": [dict(sampling) for _ in range(batch)]}
    if "all" in variants:
        from strata_jax.runtime.logits_processors import initial_bias, initial_flags

        kws["all"] = []
        for i in range(batch):
            slot = runner.sampling.acquire()
            runner.sampling.seed(
                slot, initial_flags(vocab, list(range(i, i + 64)), [0]), initial_bias(vocab, {5: 1.0, 7: -2.0})
            )
            kws["all"].append(
                dict(
                    sampling_slot=slot,
                    repetition_penalty=1.2,
                    frequency_penalty=0.5,
                    presence_penalty=0.3,
                    min_tokens_active=True,
                    logprobs=True,
                    **sampling,
                )
            )
    tokens = [1] * batch
    pos = 64

    def step(kw: list[dict]) -> None:
        nonlocal pos
        pages = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
        out = runner.step([SeqInput([tokens[i]], pos, pages[i], **kw[i]) for i in range(batch)])
        tokens[:] = [int(t) for t in out.next_tokens]
        pos = 64 + (pos - 63) % (context - 80)  # stay inside the pages

    for name in variants:  # compile + warm
        for _ in range(3):
            step(kws[name])
    times: dict[str, list[float]] = {name: [] for name in variants}
    block = 5
    for _ in range(max(1, steps // block)):
        for name in variants:
            for _ in range(block):
                t0 = time.perf_counter()
                step(kws[name])
                times[name].append(time.perf_counter() - t0)
    jax.effects_barrier()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="every row samples at this temperature (0: greedy)")
    ap.add_argument("--base-checkout", default=None, help="a checkout of the base commit (git worktree)")
    ap.add_argument("--child", choices=["base", "new"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(
            json.dumps(
                _child(
                    args.model,
                    args.batch,
                    args.steps,
                    ["none"] if args.child == "base" else ["none", "all"],
                    args.temperature,
                )
            )
        )
        return
    procs = [("new", REPO)]
    if args.base_checkout:
        procs.insert(0, ("base", Path(args.base_checkout).resolve()))
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for child, root in procs:
            env = dict(os.environ, PYTHONPATH=str(root))
            cmd = [
                sys.executable,
                str(REPO / "scripts" / "bench_sampling_extras.py"),
                "--child",
                child,
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--steps",
                str(args.steps),
                "--temperature",
                str(args.temperature),
            ]
            out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True)
            for name, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
                key = "base" if child == "base" else name
                results.setdefault(key, []).append(value)
                print(f"round {r + 1} {key:>4}: {value * 1e3:8.2f} ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(json.dumps({"median_ms": {k: round(v * 1e3, 3) for k, v in med.items()}}, indent=None))
    if "base" in med:
        print(f"none / base = {med['none'] / med['base']:.3f}  (asks for nothing: must not be slower)")
    print(f"all / none  = {med['all'] / med['none']:.3f}  (every row asks: at most 1.15)")


if __name__ == "__main__":
    main()
