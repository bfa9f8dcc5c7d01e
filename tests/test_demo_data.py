"""The demo's bundled real text: every question it asks is answerable from the excerpt it ships."""

from __future__ import annotations

import argparse
import json

from strata_jax.cli.demo import LOOGLE_EXCERPT, QUESTIONS, _document


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"document": None, "question": None, "doc_tokens": 2048, **kw})


def test_chat_models_get_the_loogle_excerpt_with_answerable_questions():
    excerpt = json.loads(LOOGLE_EXCERPT.read_text())
    text, questions = _document(_args(), chat=True)
    assert text == excerpt["text"] and len(questions) == 6 == len(excerpt["qa"])
    assert excerpt["license"] == "CC BY-SA 4.0" and "LooGLE" in excerpt["source"]
    for fact in ("18 June 1919", "moved to Madrid", "Alvaro Picardo de Celis", "Jerez de la Frontera", "Charlemagne"):
        assert fact in text, fact  # the reference answers are in the text the model sees
    assert all(q.reference for q in questions)


def test_tiny_model_and_own_questions(tmp_path):
    text, questions = _document(_args(), chat=False)
    assert [q.text for q in questions] == list(QUESTIONS) and len(text) > 10_000  # synthetic
    doc = tmp_path / "doc.txt"
    doc.write_text("A short text.")
    text, questions = _document(_args(document=doc, question=["Why?", "How?"]), chat=True)
    assert text == "A short text." and [q.text for q in questions] == ["Why?", "How?"]
