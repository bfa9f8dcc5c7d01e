"""Two processes form one 4-device mesh with ``jax.distributed.initialize`` on this CPU.

The processes talk through a local coordinator on 127.0.0.1 and run their
collectives over gloo (``jax_cpu_collectives_implementation``), the CPU stand-in for
NCCL/RCCL across hosts.  Each holds 2 of the 4 devices; a tensor-parallel MLP split
over all 4 must give the numpy result in both, and the engine's ModelRunner at tp 4
over the two processes the tokens and logits of a one-process tp 1 runner.
docs/multihost.md is the design.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_cluster(mode: str, num_processes: int = 2, local_devices: int = 2) -> list[dict]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its own device count
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(num_processes), str(port), str(local_devices), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(num_processes)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def test_two_processes_form_one_mesh_and_agree_with_numpy():
    local_devices = 2
    results = _run_cluster("mlp", 2, local_devices)
    assert sorted(r["process_index"] for r in results) == [0, 1]
    for r in results:
        assert r["process_count"] == 2 and r["device_count"] == 4
        assert len(r["local_device_ids"]) == local_devices
        assert r["shard_of_down"] == [8, 16]  # each device holds a quarter of down's 32 rows
        assert r["max_abs_error"] < 1e-4
    assert set(results[0]["local_device_ids"]).isdisjoint(results[1]["local_device_ids"])
    assert abs(results[0]["result_checksum"] - results[1]["result_checksum"]) < 1e-4


@pytest.mark.slow  # ~25 s of CPU, ~110 s wall on a loaded 2-core machine (two processes compiling)
def test_tp_runner_over_two_processes_matches_one_process():
    """The engine's ModelRunner with tp 4 over a mesh of 2 processes x 2 devices: the same
    greedy tokens and logits as a tp 1 runner in this process (same weights and inputs)."""
    import numpy as np

    sys.path.insert(0, str(WORKER.parent))
    from multihost_worker import runner_steps

    reference = runner_steps(None)
    results = _run_cluster("runner")
    for r in results:
        assert r["device_count"] == 4
        assert r["tokens"] == reference["tokens"]
        for got, want in zip(r["logits"], reference["logits"]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
