"""``strata-jax bench spec``: decode tokens per second with speculative decoding vs without.

Two engines on the same model in one process, one with ``--speculative-config`` and one
without, run the same requests alternately (``--repeats`` times each, after a warm-up run
that compiles every program and puts the document in L1):

* **quoting**: questions about a document, asking for the sentences that answer them
  (prompt lookup's case: answers copy their prompt), at each of ``--batches``;
* **copying**: asking for a paragraph of the document repeated word for word (an edit or a
  citation: the most prompt lookup can get), at each of ``--batches``;
* **free**: stories without a document (little to copy: speculation must step aside and
  cost nothing), at each of ``--batches``;
* **burst**: ``--burst`` quoting and free requests at once (a large batch: verifying may
  cost more than it saves, and the engine must see that).

Reported per workload: decode tokens per second of each engine (the tokens after each
request's first, over the time from the first first token to the last token), their
ratio (medians over the repeats), the mean accepted length (tokens emitted per
verification), the rows that stepped aside, each engine's idle dispatches (steps
dispatched when the device had nothing queued: the host path not overlapped) per 100,
and whether every request's tokens were identical with and without speculation (greedy,
or sampled at ``--temperature`` under ``--seed``: a verification draws what decoding
draws; exit status 1 if not).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

DESCRIPTION = "decode tokens/s with speculative decoding vs without, same model, one run"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
DEMO_DOCUMENT = Path(__file__).resolve().parents[1] / "demo_data" / "loogle_picardo.json"
STORY_TOPICS = (
    "a dragon who learns to bake bread",
    "a lighthouse keeper and a lost whale",
    "a robot that collects old maps",
    "two rival gardeners in a small town",
    "a violin that plays by itself",
    "a fox who opens a library",
    "a storm that visits a desert city",
    "a child who can talk to clocks",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model (tiny, a HF folder or a GGUF; default tiny)")
    parser.add_argument(
        "--speculative-config", default=DEFAULT_SPEC, help=f"the speculating engine's config (default {DEFAULT_SPEC})"
    )
    parser.add_argument(
        "--document",
        type=Path,
        default=DEMO_DOCUMENT,
        help="a JSON file with 'text' and 'qa' [{'question': ..}] (default: the embedded LooGLE document)",
    )
    parser.add_argument("--doc-chars", type=int, default=4000, help="characters of the document used (default 4000)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes of the quoting/free runs")
    parser.add_argument("--burst", type=int, default=32, help="requests of the burst run (0: none; default 32)")
    parser.add_argument("--tokens", type=int, default=96, help="max_tokens per request (default 96)")
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the two engines (default 2)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default 0: greedy); tokens are still compared, under --seed",
    )
    parser.add_argument("--seed", type=int, default=0, help="every request's sampling seed (default 0)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def _idle(engine: Any) -> tuple[int, int]:
    """(idle dispatches, dispatches) of the engine's device so far."""
    device = engine.executor.device
    return device.idle_dispatches, device.dispatches


def decode_tokens_per_s(outs: list[Any]) -> float:
    """Tokens after each request's first over the time from the first first token to the
    last token (all requests submitted together, their times from submission)."""
    tokens = sum(max(0, len(o.token_ids) - 1) for o in outs)
    span = max(o.latency_s for o in outs) - min(o.ttft_s for o in outs)
    return tokens / span if span > 0 else 0.0


def _prompts(engine: Any, document: dict, doc_chars: int, n: int, kind: str) -> list[list[int]]:
    tok = engine.tokenizer
    questions = [q["question"] for q in document["qa"]]
    text = document["text"][:doc_chars]
    out = []
    for i in range(n):
        if kind == "quoting":
            content = (
                f"{text}\n\nQuestion: {questions[i % len(questions)]}\n"
                "Answer by quoting, word for word, the sentences of the text above that answer it."
            )
        elif kind == "copying":
            content = f"{text}\n\nRepeat paragraph {1 + i % 4} of the text above word for word."
        else:
            content = f"Write a long story about {STORY_TOPICS[i % len(STORY_TOPICS)]}."
        msgs = [{"role": "user", "content": content}]
        out.append(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))
    return out


def run(args: argparse.Namespace) -> int:
    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    document = json.loads(args.document.read_text())
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    largest = max([*batches, args.burst, 1])
    common = dict(
        model=args.model,
        show_progress=False,
        max_batch_size=largest,
        max_context_tokens=4096,
        device_tokens=max(32768, 2048 * largest),
        tiers="L1",
    )
    base = Engine(EngineConfig(**common))
    spec = Engine(EngineConfig(**common, speculative_config=args.speculative_config))
    if base.tokenizer is None:
        raise SystemExit("this benchmark needs a model with a tokenizer")
    speculator = spec.core.speculator
    assert speculator is not None  # (its config was given)
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=args.seed)
    runs: list[tuple[str, list[list[int]]]] = []
    for b in batches:
        for kind in ("copying", "quoting", "free"):
            runs.append((f"{kind} b{b}", _prompts(base, document, args.doc_chars, b, kind)))
    if args.burst:
        half = args.burst // 2
        burst = _prompts(base, document, args.doc_chars, half, "quoting")
        burst += _prompts(base, document, args.doc_chars, args.burst - half, "free")
        runs.append((f"burst {args.burst}", burst))
    for _, prompts in runs:  # warm: every program, the documents in L1
        base.generate(prompts, params)
        spec.generate(prompts, params)
    rows = []
    mismatched = 0
    print(
        f"{args.model}: {args.speculative_config}, max_tokens {args.tokens}, temperature {args.temperature}"
        f" (seed {args.seed}), {args.repeats} repeats"
    )
    for name, prompts in runs:
        rates: dict[str, list[float]] = {"base": [], "spec": []}
        counters = speculator.counters
        before = (counters.drafts, counters.accepted_tokens, speculator.stepped_aside)
        idle_before = {side: _idle(engine) for side, engine in (("base", base), ("spec", spec))}
        for _ in range(args.repeats):
            a = base.generate(prompts, params)
            b_out = spec.generate(prompts, params)
            rates["base"].append(decode_tokens_per_s(a))
            rates["spec"].append(decode_tokens_per_s(b_out))
            mismatched += sum(x.token_ids != y.token_ids for x, y in zip(a, b_out))
        drafts = counters.drafts - before[0]
        accepted = counters.accepted_tokens - before[1]
        base_rate, spec_rate = statistics.median(rates["base"]), statistics.median(rates["spec"])
        idle = {}
        for side, engine in (("base", base), ("spec", spec)):
            (idle_then, all_then), (idle_now, all_now) = idle_before[side], _idle(engine)
            idle[side] = 100 * (idle_now - idle_then) / max(1, all_now - all_then)
        row: dict[str, Any] = {
            "run": name,
            "requests": len(prompts),
            "base_tokens_per_s": base_rate,
            "spec_tokens_per_s": spec_rate,
            "base_runs": rates["base"],
            "spec_runs": rates["spec"],
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "verifications": drafts,
            "stepped_aside": speculator.stepped_aside - before[2],
            "ratio": spec_rate / base_rate if base_rate else 0.0,
            "idle_dispatches_per_100": idle,
        }
        rows.append(row)
        print(
            f"  {name:>12}: {row['spec_tokens_per_s']:7.1f} vs {row['base_tokens_per_s']:7.1f} tok/s = "
            f"{row['ratio']:.2f}x  (runs {', '.join(f'{x:.1f}' for x in rates['spec'])} vs "
            f"{', '.join(f'{x:.1f}' for x in rates['base'])}; mean accepted length {row['mean_accepted_length']:.2f} "
            f"over {drafts} verifications, {row['stepped_aside']} stepped aside; idle dispatches per 100: "
            f"{idle['spec']:.0f} vs {idle['base']:.0f})"
        )
    base.shutdown()
    spec.shutdown()
    kind = "greedy" if args.temperature == 0 else f"sampled (seed {args.seed})"
    print(f"{kind} tokens identical with and without speculation: {'yes' if not mismatched else 'NO'}", end="")
    print(f" ({mismatched} requests differ)" if mismatched else "")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "mismatched_requests": mismatched}, indent=2) + "\n")
    return 1 if mismatched else 0
