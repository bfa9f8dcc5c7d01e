"""The client scripts (scripts/lm_eval_chat.sh, scripts/load_chat.sh) and their local lm-eval task.

Running the clients themselves needs their virtualenvs and the real model (minutes), so it is
done by hand (numbers in docs/serving.md); here: the scripts parse, the task file is what
lm-eval reads, its data is well formed, and its scorer scores answers as a reader would.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TASK = SCRIPTS / "lm_eval_task"


def load_task_yaml(path: Path) -> dict:
    """An lm-eval task file as lm-eval reads it (``!function x.y`` -> ``("function", "x.y")``)."""
    yaml = pytest.importorskip("yaml")  # pyyaml comes with lm-eval; not a dependency of this project

    class FunctionTag(yaml.SafeLoader):
        pass

    FunctionTag.add_constructor("!function", lambda loader, node: ("function", loader.construct_scalar(node)))
    return yaml.load(path.read_text(), Loader=FunctionTag)


def load_module(path: Path):  # noqa: ANN201
    """A task's Python helper (its scorer), loaded from its file as lm-eval does."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["chat_clients_common.sh", "lm_eval_chat.sh", "load_chat.sh", "lm_eval_tiers.sh"])
def test_scripts_parse(name):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_task_yaml_and_data():
    task = load_task_yaml(TASK / "strata_capitals.yaml.in")
    assert task["output_type"] == "generate_until" and task["dataset_path"] == "json"
    assert task["dataset_kwargs"]["data_files"]["test"] == "@DATA_FILE@"  # filled in by lm_eval_chat.sh
    assert task["process_results"] == ("function", "capitals_metrics.process_results")
    assert {m["metric"] for m in task["metric_list"]} == {"exact_match", "contains_answer"}
    rows = [json.loads(line) for line in (TASK / "capitals.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(set(r) == {"country", "capital"} for r in rows)
    assert len({r["country"] for r in rows}) == len(rows)


def test_task_scorer():
    metrics = load_module(TASK / "capitals_metrics.py")
    doc = {"country": "Mexico", "capital": "Mexico City"}
    assert metrics.process_results(doc, ["Mexico City."]) == {"exact_match": 1.0, "contains_answer": 1.0}
    assert metrics.process_results(doc, ["The capital is Mexico City"]) == {"exact_match": 0.0, "contains_answer": 1.0}
    assert metrics.process_results(doc, ["Mexico"]) == {"exact_match": 0.0, "contains_answer": 0.0}
    paris = {"country": "France", "capital": "Paris"}
    assert metrics.process_results(paris, ["Parisian"]) == {"exact_match": 0.0, "contains_answer": 0.0}
