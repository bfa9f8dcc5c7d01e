"""``strata-jax demo``: one long document, several questions, the cache at work.

Shows what hierarchical caching buys a user: time to first token for the first
question (document computed from scratch) versus later questions whose document
prefix comes from the device (L1), host memory (L2) or storage (L3).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from strata_jax.api import SamplingParams

QUESTIONS = (
    "Who is the main subject of this text?",
    "Where was the subject born?",
    "Summarise the second paragraph.",
    "What happened later in life?",
    "List three places mentioned.",
    "What is the overall tone?",
)
_WORDS = "the of and a to in is was for on that with as by at from his her their city river year war school family work".split()


def synthetic_document(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append(rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(_WORDS).capitalize())
    return " ".join(words)[:num_chars]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a local Hugging Face folder")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="document length in tokens (default 2048)")
    parser.add_argument("--document", type=Path, default=None, help="text file to use as the document (default: synthetic)")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length per question (default 16)")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements to this JSON file")


def run_demo(args: argparse.Namespace) -> int:
    from strata_jax.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory(prefix="strata-demo-kv-") as storage_dir:
        engine = Engine(
            EngineConfig(
                model=args.model, tiers="L1+L2+L3", storage_dir=storage_dir, max_batch_size=1, max_batch_tokens=512,
                prefetch_policy="wait_complete", prefetch_min_tokens=0,
            )
        )
        try:
            rows = _ask(engine, args)
        finally:
            engine.shutdown()
    _print_table(rows, engine)
    if args.json:
        args.json.write_text(json.dumps({"questions": rows}, indent=2))
    return 0


def _ask(engine, args: argparse.Namespace) -> list[dict]:
    tok = engine.tokenizer
    text = args.document.read_text() if args.document else synthetic_document(args.doc_tokens * 6)
    doc_ids = tok.encode(text)[: args.doc_tokens]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    plan = [("cold", None), ("L1", None), ("L1", None), ("L2", "device"), ("L3", "host"), ("L1", None)]
    rows = []
    for i, (label, flush) in enumerate(plan):
        if flush == "device":
            engine.flush_cache("device")
        elif flush == "host":
            engine.flush_cache("device")
            engine.flush_cache("host")
        question = tok.encode("\n\nQuestion: " + QUESTIONS[i % len(QUESTIONS)] + "\nAnswer:")[1:]
        start = time.perf_counter()
        out = engine.generate([doc_ids + question], params)[0]
        total = time.perf_counter() - start
        decode_tps = (len(out.token_ids) - 1) / max(total - out.ttft_s, 1e-9)
        rows.append(
            {
                "question": i + 1,
                "expected_source": label,
                "prompt_tokens": len(doc_ids) + len(question),
                "cached": out.cached_tokens,
                "ttft_ms": out.ttft_s * 1e3,
                "decode_tokens_per_s": decode_tps,
                "answer": out.text,
            }
        )
    return rows


def _print_table(rows: list[dict], engine) -> None:
    print(f"\nmodel {engine.model_name}: one {rows[0]['prompt_tokens']}-token document, {len(rows)} questions\n")
    print(f"{'#':>2}  {'KV from':<8} {'L1 hit':>7} {'L2 hit':>7} {'L3 hit':>7} {'TTFT ms':>9} {'decode tok/s':>13}")
    for r in rows:
        c = r["cached"]
        print(
            f"{r['question']:>2}  {r['expected_source']:<8} {c['device']:>7} {c['host']:>7} {c['storage']:>7} "
            f"{r['ttft_ms']:>9.1f} {r['decode_tokens_per_s']:>13.1f}"
        )
    cold = rows[0]["ttft_ms"]
    for label in ("L1", "L2", "L3"):
        hits = [r["ttft_ms"] for r in rows if r["expected_source"] == label]
        if hits:
            print(f"TTFT with the document from {label}: {min(hits):.1f} ms vs {cold:.1f} ms cold ({cold / min(hits):.1f}x faster)")
    print("(the tiny model has random weights: its answers are noise; the timings are the point)")
