"""The jitted steps update the donated KV pool and sequence tables in place: no full copy in the compiled program."""

from __future__ import annotations

import re

import jax
import pytest

from pallas_kernels import native
from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import random_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig
from strata_jax.runtime.sharding import make_mesh

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


@pytest.mark.parametrize("tp", [1, 2])  # tp 2: the pool split on its 2 KV heads over 2 devices
@pytest.mark.parametrize("tokens", [1, 5])  # decode bucket (T == B) and extend bucket
def test_step_program_never_copies_the_pool(tokens, tp):
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    mesh = make_mesh(tp) if tp > 1 else None
    runner = ModelRunner(
        random_model(CONFIG),
        RunnerConfig(page_size=4, num_device_pages=97, max_batch_tokens=32, max_batch_size=2, max_context_tokens=128),
        mesh=mesh,
    )
    hlo = runner.lower_step(tokens, 1, decode=tokens == 1).compile().as_text()
    heads = CONFIG.num_kv_heads // tp  # a device's shard of the pool
    pool_shapes = {f"3,2,97,4,{heads},16", f"3,2,388,{heads},16"}  # the pool and its flat-slot view
    pool_lines = [line for line in hlo.splitlines() if any(f"[{s}]" in line for s in pool_shapes)]
    copies = [
        line
        for line in pool_lines
        if re.search(r"\b(copy|all-gather|all-reduce|all-to-all|collective-permute)\(", line)
    ]
    assert not copies, copies[:3]
    # the per-sequence page table (8 slots x 32 pages) is updated in place too
    table = f"s32[{runner.seqs.num_slots},{runner.config.max_pages_per_seq}]"
    table_copies = [line for line in hlo.splitlines() if table in line and re.search(r"\bcopy\(", line)]
    if native.available() and tokens == 1:
        # With the native decode kernel in the layer loop, XLA copies the (small: rows x
        # pages int32) table before the step's page updates instead of ordering them after
        # the row gather; the pool stays in place (above).
        assert "strata_paged_decode_attention" in hlo
        assert len(table_copies) <= 2, table_copies[:3]
    else:
        assert not table_copies, table_copies[:3]
    assert "input_output_alias" in hlo or "must-alias" in hlo or "may-alias" in hlo
    if tp > 1:
        assert pool_lines, "the sharded program should hold the pool at its per-device shape"
        assert "all-reduce" in hlo  # row-parallel o_proj / down_proj partial sums


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tokens", [1, 5])
def test_step_program_never_copies_a_pool_with_layer_groups(tokens, tp):
    """The grouped pool (one layer of rows, read at per-layer offsets; local layers through
    the step's page map) is updated in place by the layer scan as well."""
    import dataclasses

    from pallas_kernels.layout import KVLayout
    from strata_jax.cache.pools import DevicePool
    from strata_jax.runtime.model_runner import grouped_pool_layout
    from strata_jax.runtime.sharding import pool_sharding

    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices")
    config = dataclasses.replace(CONFIG, layer_windows=(8, 0, 8))
    mesh = make_mesh(tp) if tp > 1 else None
    layout = KVLayout(3, 2, 16, 4)
    pool = DevicePool(
        layout, 97, pool_sharding(mesh) if mesh else None, grouped=grouped_pool_layout(config, layout, 97)
    )
    pool.local.attach(list(range(97)))
    runner = ModelRunner(
        random_model(config),
        RunnerConfig(
            page_size=4,
            num_device_pages=97,
            max_batch_tokens=32,
            max_batch_size=2,
            max_context_tokens=128,
        ),
        pool=pool,
        mesh=mesh,
    )
    args = runner.program_arguments(tokens, 1, decode=tokens == 1)
    assert "local_map" in args[5]
    hlo = runner.lower_step(tokens, 1, decode=tokens == 1).compile().as_text()
    heads = 2 // tp
    pool_shapes = {f"1,2,291,4,{heads},16", f"1,2,1164,{heads},16"}  # 3 x 97 rows, and a flat-slot view
    pool_lines = [line for line in hlo.splitlines() if any(f"[{s}]" in line for s in pool_shapes)]
    assert pool_lines
    copies = [
        line
        for line in pool_lines
        if re.search(r"\b(copy|all-gather|all-reduce|all-to-all|collective-permute)\(", line)
    ]
    assert not copies, copies[:3]
