"""scripts/lm_eval_tiers.sh and its lm-eval task scripts/lm_eval_tier_task/ (issue 20: accuracy
with a long shared prefix read back from a quantized L2).

Running it needs lm-eval's virtualenv and the real model (minutes; numbers in docs/serving.md);
here: the script parses, the task file is what lm-eval reads, the data is well formed (every
prompt starts with the same long block, every answer is one of its choices), and the scorer
scores answers as a reader would.  No lm-eval, no model, no network.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_client_scripts import load_module, load_task_yaml

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TASK = SCRIPTS / "lm_eval_tier_task"


@pytest.fixture(scope="module")
def tier_task():
    return load_module(TASK / "tier_task.py")


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASK / name).read_text().splitlines()]


def test_task_yaml():  # (test_client_scripts.test_scripts_parse parses lm_eval_tiers.sh)
    task = load_task_yaml(TASK / "strata_tier_mc.yaml.in")
    assert task["task"] == "strata_tier_mc"
    assert task["output_type"] == "generate_until" and task["dataset_path"] == "json"
    assert task["dataset_kwargs"]["data_files"]["test"] == "@DATA_FILE@"  # filled in by lm_eval_tiers.sh
    assert task["doc_to_text"] == ("function", "tier_task.doc_to_text")
    assert task["process_results"] == ("function", "tier_task.process_results")
    gen = task["generation_kwargs"]
    assert (
        gen["until"] == ["\n"] and gen["do_sample"] is False and gen["temperature"] == 0.0 and gen["max_gen_toks"] <= 32
    )
    assert {m["metric"] for m in task["metric_list"]} == {"exact_match", "valid_choice"}


@pytest.mark.parametrize("name", ["questions.jsonl", "shots.jsonl"])
def test_data_well_formed(name):
    rows = _rows(name)
    assert all(set(r) == {"question", "choices", "answer"} for r in rows)
    assert all(len(r["choices"]) == 4 and len(set(r["choices"])) == 4 and r["answer"] in r["choices"] for r in rows)
    assert all("\n" not in r["question"] and all("\n" not in c for c in r["choices"]) for r in rows)
    assert len({r["question"] for r in rows}) == len(rows)


def test_questions_share_a_long_prefix(tier_task):
    questions, shots = _rows("questions.jsonl"), _rows("shots.jsonl")
    assert len(questions) >= 50  # one question is < 2 points
    assert not {q["question"] for q in questions} & {s["question"] for s in shots}  # no answer given away
    prompts = [tier_task.doc_to_text(q) for q in questions]
    assert all(p.startswith(tier_task.PREFIX) and p.endswith("\nA:") for p in prompts)
    # >= 600 tokens: a byte-level BPE tokenizer never merges across a word / number / punctuation
    # boundary, so each such piece is at least one token (SmolLM2's tokenizer: 868 tokens;
    # lm_eval_tiers.sh counts them and checks each question after the first got the 864 of the
    # block's full pages from L2).
    assert len(re.findall(r"[A-Za-z]+|[0-9]+|[^\w\s]+", tier_task.PREFIX)) >= 600
    assert len(tier_task.SHOTS) == len(shots)
    assert (
        prompts[0].removeprefix(tier_task.PREFIX)
        == "Q: What is the capital of France? (Lyon, Paris, Brussels, Rome)\nA:"
    )
    # the shots are worked examples in the same format, each answered on its own line
    assert all(f"{tier_task.format_question(s)} {s['answer']}\n" in tier_task.PREFIX for s in shots)


def test_scorer(tier_task):
    doc = {
        "question": "What is the capital of Mexico?",
        "choices": ["Cancun", "Mexico City", "Havana", "Lima"],
        "answer": "Mexico City",
    }
    assert tier_task.process_results(doc, [" Mexico City"]) == {"exact_match": 1.0, "valid_choice": 1.0}
    assert tier_task.process_results(doc, [" mexico city."]) == {"exact_match": 1.0, "valid_choice": 1.0}
    assert tier_task.process_results(doc, [" Havana"]) == {"exact_match": 0.0, "valid_choice": 1.0}
    assert tier_task.process_results(doc, [" Mexico"]) == {"exact_match": 0.0, "valid_choice": 0.0}
    assert tier_task.process_results(doc, [" The capital is Mexico City"]) == {"exact_match": 0.0, "valid_choice": 0.0}
    num = {"question": "What is 1 + 1?", "choices": ["1", "2", "3", "4"], "answer": "2"}
    assert tier_task.process_results(num, [" 2"])["exact_match"] == 1.0
    assert tier_task.process_results(num, [" 1, 2"])["exact_match"] == 0.0
