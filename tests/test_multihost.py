"""Two processes form one 4-device mesh with ``jax.distributed.initialize`` on this CPU.

The processes talk through a local coordinator on 127.0.0.1 and run their
collectives over gloo (``jax_cpu_collectives_implementation``), the CPU stand-in for
NCCL/RCCL across hosts.  Each holds 2 of the 4 devices; a tensor-parallel MLP split
over all 4 must give the numpy result in both.  docs/multihost.md is the design.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_form_one_mesh_and_agree_with_numpy():
    port, num_processes, local_devices = _free_port(), 2, 2
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its own device count
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(num_processes), str(port), str(local_devices)],
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
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert sorted(r["process_index"] for r in results) == [0, 1]
    for r in results:
        assert r["process_count"] == 2 and r["device_count"] == 4
        assert len(r["local_device_ids"]) == local_devices
        assert r["shard_of_down"] == [8, 16]  # each device holds a quarter of down's 32 rows
        assert r["max_abs_error"] < 1e-4
    assert set(results[0]["local_device_ids"]).isdisjoint(results[1]["local_device_ids"])
    assert abs(results[0]["result_checksum"] - results[1]["result_checksum"]) < 1e-4
