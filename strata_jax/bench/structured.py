"""``strata-jax bench structured``: what a JSON-schema constraint costs a decode step.

One engine, one run: a batch of ``--batch`` requests decoded free, then the same batch with
every row under a JSON schema (an array of numbers, long enough to decode ``--tokens``
tokens), alternating ``--repeats`` times.  Reported: decode time per token of a request
(from its first token to its last, over the tokens after the first) for each, and their
ratio.  A constrained row costs the mask computed on the host (llguidance) while the step
before runs, its upload, and the masking in the sampling step; in the pipelined engine
it also waits for its last token before its next step is dispatched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DESCRIPTION = "decode time per token with every row JSON-schema constrained vs free, same engine, one run"

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}
    },
    "required": ["values"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model (tiny, a HF folder or a GGUF; default tiny)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="free / constrained alternations (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def _per_token(outs) -> float:
    return statistics.median((o.latency_s - o.ttft_s) / max(1, len(o.token_ids) - 1) for o in outs)


def run(args: argparse.Namespace) -> int:
    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig
    from strata_jax.structured import StructuredOutput

    engine = Engine(
        EngineConfig(
            model=args.model,
            show_progress=False,
            max_batch_size=max(8, args.batch),
            device_tokens=16384,
            max_context_tokens=max(512, 4 * args.tokens),
            tiers="L1",
        )
    )
    constraint = StructuredOutput.json_schema(SCHEMA)
    prompts = [f"Write numbers, list {i}: " for i in range(args.batch)]
    if engine.tokenizer is None:
        raise SystemExit("this benchmark needs a model with a tokenizer")
    free = [SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=1.0, seed=i) for i in range(args.batch)]
    held = [
        SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, structured=constraint)
        for i in range(args.batch)
    ]
    engine.generate(prompts, free)  # warm: every program and the grammar tokenizer
    engine.generate(prompts, held)
    rows = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        a = engine.generate(prompts, free)
        t1 = time.perf_counter()
        b = engine.generate(prompts, held)
        t2 = time.perf_counter()
        rows.append(
            {
                "free_ms_per_token": 1e3 * _per_token(a),
                "constrained_ms_per_token": 1e3 * _per_token(b),
                "free_wall_s": t1 - t0,
                "constrained_wall_s": t2 - t1,
                "constrained_tokens": statistics.median(len(o.token_ids) for o in b),
            }
        )
        assert all(json.loads(o.text) for o in b if o.finish_reason == "stop")
    engine.shutdown()
    free_ms = statistics.median(r["free_ms_per_token"] for r in rows)
    held_ms = statistics.median(r["constrained_ms_per_token"] for r in rows)
    print(f"{args.model}, batch {args.batch}, {args.tokens} tokens per request, {args.repeats} alternations")
    for r in rows:
        print(
            f"  free {r['free_ms_per_token']:.2f} ms/token   constrained {r['constrained_ms_per_token']:.2f} ms/token "
            f"({r['constrained_tokens']:.0f} tokens; wall {r['free_wall_s']:.2f} s / {r['constrained_wall_s']:.2f} s)"
        )
    print(f"constrained / free: {held_ms / free_ms:.2f}x (medians {held_ms:.2f} / {free_ms:.2f} ms per token)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ratio": held_ms / free_ms}, indent=2) + "\n")
    return 0
