"""Scores of the strata_capitals lm-eval task: exact match and "the answer names the capital"."""

from __future__ import annotations

import re


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z ]", "", text.lower()).strip()


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    answer, capital = _normalize(results[0]), _normalize(doc["capital"])
    return {
        "exact_match": float(answer == capital),
        "contains_answer": float(re.search(rf"\b{re.escape(capital)}\b", answer) is not None),
    }
