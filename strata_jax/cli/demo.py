"""``strata-jax demo``: one long document, several questions, the cache at work.

Shows what hierarchical caching buys a user: time to first token for the first
question (document computed from scratch) versus later questions whose document
prefix comes from the device (L1), host memory (L2) or storage (L3).  With a real
model (one whose tokenizer has a chat template) the questions go through that
template, the answers are printed, and the default document is a real text: an
excerpt of a LooGLE document (``demo_data/loogle_picardo.json``) with its questions.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import textwrap
import time
from dataclasses import dataclass
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
LOOGLE_EXCERPT = Path(__file__).resolve().parents[1] / "demo_data" / "loogle_picardo.json"
TINY_MAX_TOKENS, CHAT_MAX_TOKENS = 16, 48
_WORDS = (
    "the of and a to in is was for on that with as by at from his her their city river year war school family work"
).split()


def synthetic_document(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append(rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(_WORDS).capitalize())
    return " ".join(words)[:num_chars]


@dataclass(frozen=True)
class Question:
    text: str
    reference: str | None = None  # the dataset's answer, shown beside the model's


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="tiny", help="'tiny' (embedded default), a local Hugging Face folder or a .gguf file"
    )
    parser.add_argument(
        "--doc-tokens", type=int, default=2048, help="cut the document to this many tokens (default 2048)"
    )
    parser.add_argument(
        "--document",
        type=Path,
        default=None,
        help="text file to use as the document (default: a LooGLE excerpt with its questions for chat models, "
        "synthetic text for the tiny model)",
    )
    parser.add_argument(
        "--question",
        action="append",
        default=None,
        help="a question to ask (repeatable; default: the document's or generic ones)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"answer length limit per question (default {TINY_MAX_TOKENS} for the tiny model, {CHAT_MAX_TOKENS} for "
        "chat models)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the measurements and answers to this JSON file"
    )
    from strata_jax.cli.generate import add_tp_argument

    add_tp_argument(parser)


def run_demo(args: argparse.Namespace) -> int:
    from strata_jax.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory(prefix="strata-demo-kv-") as storage_dir:
        engine = Engine(
            EngineConfig(
                model=args.model,
                tp=args.tp,
                tiers="L1+L2+L3",
                storage_dir=storage_dir,
                max_batch_size=1,
                max_batch_tokens=512,
                prefetch_policy="wait_complete",
                prefetch_min_tokens=0,
            )
        )
        try:
            rows = _ask(engine, args)
        finally:
            engine.shutdown()
    _print_table(rows, engine)
    if rows[0]["chat"]:
        _print_answers(rows)
    if args.json:
        args.json.write_text(json.dumps({"questions": rows}, indent=2))
    return 0


def _document(args: argparse.Namespace, chat: bool) -> tuple[str, list[Question]]:
    """The document text and the questions to ask about it."""
    if args.document is not None:
        text, questions = args.document.read_text(), [Question(q) for q in QUESTIONS]
    elif chat:
        excerpt = json.loads(LOOGLE_EXCERPT.read_text())
        text, questions = excerpt["text"], [Question(q["question"], q["reference_answer"]) for q in excerpt["qa"]]
    else:
        text, questions = synthetic_document(args.doc_tokens * 6), [Question(q) for q in QUESTIONS]
    if args.question:
        questions = [Question(q) for q in args.question]
    return text, questions


def _ask(engine, args: argparse.Namespace) -> list[dict]:
    tok = engine.tokenizer
    chat = bool(getattr(tok, "chat_template", None))
    text, questions = _document(args, chat)
    doc_ids = tok.encode(text)[: args.doc_tokens]
    if chat:  # the document first, so every question shares the prefix "template header + document"
        doc_text = tok.decode(doc_ids)
        # the rendered template carries its own special tokens (a BOS, if the model has one): encode
        # it without adding more, as transformers' apply_chat_template(tokenize=True) does
        prompts = [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": f"{doc_text}\n\nQuestion: {q.text}"}]),
                add_special_tokens=False,
            )
            for q in questions
        ]
        max_tokens = args.max_tokens or CHAT_MAX_TOKENS
        params = SamplingParams(max_tokens=max_tokens)
    else:
        prompts = [doc_ids + tok.encode("\n\nQuestion: " + q.text + "\nAnswer:")[1:] for q in questions]
        params = SamplingParams(max_tokens=args.max_tokens or TINY_MAX_TOKENS, ignore_eos=True)
    plan = [("cold", None), ("L1", None), ("L1", None), ("L2", "device"), ("L3", "host"), ("L1", None)]
    rows = []
    for i, (label, flush) in enumerate(plan):
        if flush == "device":
            engine.flush_cache("device")
        elif flush == "host":
            engine.flush_cache("device")
            engine.flush_cache("host")
        question = questions[i % len(questions)]
        start = time.perf_counter()
        out = engine.generate([prompts[i % len(prompts)]], params)[0]
        total = time.perf_counter() - start
        decode_tps = (len(out.token_ids) - 1) / max(total - out.ttft_s, 1e-9)
        rows.append(
            {
                "question": i + 1,
                "chat": chat,
                "text": question.text,
                "reference_answer": question.reference,
                "expected_source": label,
                "prompt_tokens": len(out.prompt_token_ids),
                "cached": out.cached_tokens,
                "ttft_ms": out.ttft_s * 1e3,
                "decode_tokens_per_s": decode_tps,
                "answer": out.text,
            }
        )
    return rows


def _print_answers(rows: list[dict]) -> None:
    print()
    for r in rows:
        print(f"Q{r['question']} ({r['expected_source']}): {r['text']}")
        print(
            textwrap.fill(r["answer"].strip() or "(empty)", 100, initial_indent="    A: ", subsequent_indent="       ")
        )
        if r["reference_answer"]:
            print(
                textwrap.fill(
                    r["reference_answer"], 100, initial_indent="    reference: ", subsequent_indent="               "
                )
            )


def _print_table(rows: list[dict], engine) -> None:
    print(
        f"\nmodel {engine.model_name}: one document, {len(rows)} questions ({rows[0]['prompt_tokens']}-token first "
        "prompt)\n"
    )
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
            print(
                f"TTFT with the document from {label}: {min(hits):.1f} ms vs {cold:.1f} ms cold "
                f"({cold / min(hits):.1f}x faster)"
            )
    if engine.model_name == "tiny":
        print("(the tiny model has random weights: its answers are noise; the timings are the point)")
