"""One process of tests/test_multihost.py: joins a 2-process JAX cluster on this CPU and
runs a tensor-parallel MLP over the 4-device mesh the two processes form together.

Usage: python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES
Prints one JSON line: what this process saw and the result it holds.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    process_id, num_processes, port, local_devices = (int(a) for a in sys.argv[1:5])
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
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("tp",))
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
