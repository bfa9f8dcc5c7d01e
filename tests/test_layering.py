"""docs/design.md §2 layering: the scheduler and the tree are pure Python; strata_jax never imports serving;
pallas_kernels imports only jax and numpy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_scheduler_and_tree_import_without_jax():
    code = (
        "import sys, strata_jax.scheduler.scheduler, strata_jax.scheduler.policy, strata_jax.cache.radix_tree;"
        "bad = [m for m in ('jax', 'numpy', 'flax') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_strata_jax_never_imports_serving():
    offenders = [str(p) for p in (REPO / "strata_jax").rglob("*.py") if "serving" in _imports(p)]
    assert not offenders


def test_pallas_kernels_imports_only_jax_and_numpy():
    allowed = {
        "jax",
        "numpy",
        "ml_dtypes",
        "pallas_kernels",
        "__future__",
        "functools",
        "os",
        "dataclasses",
        "types",
        "collections",
        "math",
        "typing",
        "contextlib",
        "contextvars",
    }
    # native.py builds and loads the C++ kernel: the standard library's process, file and ctypes modules
    build = {"ctypes", "hashlib", "logging", "pathlib", "platform", "shutil", "subprocess", "tempfile"}
    for path in (REPO / "pallas_kernels").rglob("*.py"):
        extra = _imports(path) - allowed - (build if path.name == "native.py" else set())
        assert not extra, (path, extra)
