"""One process of tests/test_multihost.py: joins a 2-process JAX cluster on this CPU and
runs a tensor-parallel MLP over the 4-device mesh the two processes form together.

Usage: python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES [mlp|runner]
Prints one JSON line: what this process saw and the result it holds.  ``runner``: the
engine's ``ModelRunner`` with tp over every device of the cluster runs a prefill and a
decode step of ``RUNNER_CONFIG`` (the test compares them with a one-process tp 1 run).
"""

from __future__ import annotations

import json
import sys


def runner_steps(mesh) -> dict:
    """A prefill of two sequences then a decode step; tokens and logits (the test's reference
    calls this with mesh=None)."""
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

    config = ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
    )
    runner = ModelRunner(
        random_model(config, seed=11),
        RunnerConfig(page_size=4, num_device_pages=32, max_batch_tokens=32, max_batch_size=2, max_context_tokens=64),
        mesh=mesh,
    )
    prefill = runner.step(
        [SeqInput(list(range(1, 12)), 0, [0, 1, 2]), SeqInput(list(range(5, 10)), 0, [3, 4])], all_logits=True
    )
    first = [int(t) for t in prefill.next_tokens]
    decode = runner.step([SeqInput([first[0]], 11, [0, 1, 2]), SeqInput([first[1]], 5, [3, 4])], all_logits=True)
    return {
        "tokens": first + [int(t) for t in decode.next_tokens],
        "logits": [prefill.logits.tolist(), decode.logits.tolist()],
    }


def main() -> int:
    process_id, num_processes, port, local_devices = (int(a) for a in sys.argv[1:5])
    mode = sys.argv[5] if len(sys.argv) > 5 else "mlp"
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    if mode == "runner":
        result = runner_steps(mesh)
        result.update(process_index=jax.process_index(), device_count=jax.device_count())
        print(json.dumps(result), flush=True)
        jax.distributed.shutdown()
        return 0
    rng = np.random.default_rng(0)  # same seed in every process: every process knows the global values
    hidden, inter, tokens = 16, 32, 8
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    gate = rng.standard_normal((hidden, inter), dtype=np.float32) * 0.2
    up = rng.standard_normal((hidden, inter), dtype=np.float32) * 0.2
    down = rng.standard_normal((inter, hidden), dtype=np.float32) * 0.2

    def global_array(value: np.ndarray, spec: P) -> jax.Array:
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    # Megatron MLP: gate/up split by columns, down by rows; XLA inserts the all-reduce (gloo here).
    args = (
        global_array(x, P()),
        global_array(gate, P(None, "tp")),
        global_array(up, P(None, "tp")),
        global_array(down, P("tp", None)),
    )
    mlp = jax.jit(
        lambda x, g, u, d: (jax.nn.silu(x @ g) * (x @ u)) @ d,
        out_shardings=NamedSharding(mesh, P()),
    )
    out = mlp(*args)
    local = np.asarray(out.addressable_shards[0].data)
    expected = (x @ gate) / (1 + np.exp(-(x @ gate))) * (x @ up) @ down
    print(
        json.dumps(
            {
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "device_count": jax.device_count(),
                "local_device_ids": [d.id for d in jax.local_devices()],
                "shard_of_down": list(args[3].addressable_shards[0].data.shape),
                "max_abs_error": float(np.max(np.abs(local - expected))),
                "result_checksum": float(np.sum(local)),
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
