"""The engine's commands work on a base install (no `serve` extra); a command whose extra is
missing (`serve`, `gguf`, `sim`) says which to install, in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Make the serve extra's modules unimportable, then run the console script's main().
SCRIPT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        blocked = ('uvicorn', 'fastapi', 'grpc', 'grpc_health', 'grpc_reflection', 'prometheus_client', 'gguf')
        if name.split('.')[0] in blocked + ('matplotlib',):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from serving.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_generate_works_and_serve_explains_the_missing_extra():
    ok = _run("generate", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"token_ids"' in ok.stdout
    for argv in (["serve"], ["serve", "--model", "model.gguf", "--port", "8000"], ["serve", "--help"]):
        serve = _run(*argv)  # flags of serve are not known without the extra: the extra is named, not the flags
        assert serve.returncode == 2, (argv, serve.stdout, serve.stderr)
        lines = serve.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'strata-jax[serve]'" in lines[0], (argv, serve.stderr)
        assert "unrecognized arguments" not in serve.stderr


def test_gguf_and_sim_commands_name_their_extras(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # the file exists; reading it needs the gguf package
    gen = _run("generate", "--model", str(model), "--prompt-ids", "1,2", "--max-tokens", "1")
    lines = gen.stderr.strip().splitlines()
    assert gen.returncode == 2 and len(lines) == 1 and "strata-jax[gguf]" in lines[0], gen.stderr
    sim = _run(
        "simulate",
        "--workload",
        "sharegpt",
        "--systems",
        "strata",
        "--rates",
        "1",
        "--num-requests",
        "3",
        "--no-progress",
        "--plot",
        str(tmp_path / "x.png"),
    )
    lines = sim.stderr.strip().splitlines()
    assert sim.returncode != 0 and len(lines) == 1 and "strata-jax[sim]" in lines[0], sim.stderr
    assert "sharegpt on" not in sim.stdout  # refused before simulating
