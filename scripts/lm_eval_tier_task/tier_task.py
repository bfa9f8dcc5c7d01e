"""Prompts and scores of the strata_tier_mc lm-eval task (scripts/lm_eval_tiers.sh).

Every prompt is the same long many-shot block (``PREFIX``: an instruction line and the 36
worked examples of shots.jsonl, about 700 tokens of SmolLM2's tokenizer) followed by one
question of questions.jsonl with its four choices and ``A:``; the model answers greedily up
to the newline.  The shared block is what the server keeps in its cache: after the first
question it comes back from L2, in whatever ``--kv-tier-format`` the server uses, so the
answers depend on KV that went through that format.

Scores: ``exact_match`` (the answer, normalized, is the right choice) and ``valid_choice``
(the answer is one of the four choices, right or wrong).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTRUCTION = "Answer each question with one of the choices given in brackets.\n\n"


def format_question(doc: dict) -> str:
    return f"Q: {doc['question']} ({', '.join(doc['choices'])})\nA:"


def _load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


SHOTS = _load_jsonl(HERE / "shots.jsonl")
PREFIX = INSTRUCTION + "".join(f"{format_question(s)} {s['answer']}\n" for s in SHOTS)


def doc_to_text(doc: dict) -> str:
    return PREFIX + format_question(doc)


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9 ]", " ", text.lower())).strip()


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    answer = _normalize(results[0])
    return {
        "exact_match": float(answer == _normalize(doc["answer"])),
        "valid_choice": float(answer in {_normalize(c) for c in doc["choices"]}),
    }
