"""The L1 pool with layer groups (``--kv-layer-groups``, ``GroupedPoolLayout``): page moves,
the model step and the engine's tiers give what the layer-first pool gives.

References: the layer-first pool (its own tests compare it with transformers and the
kernels' references) and transformers on the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import hf_logits, make_hf_model

from pallas_kernels.layout import GroupedPoolLayout, KVLayout
from strata_jax.api import SamplingParams
from strata_jax.cache.pools import DevicePool, HostPool
from strata_jax.cache.tier_format import TierFormat
from strata_jax.engine import Engine, EngineConfig
from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

TOL = 2e-4
LAYOUT = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, page_size=4)
LOCAL = (True, True, False, True, False)


@pytest.mark.parametrize("fmt", ["full", "int8", "fp8"])
def test_grouped_pool_moves_the_pages_the_layer_first_pool_moves(fmt):
    rng = np.random.default_rng(0)
    host_pages = rng.standard_normal(LAYOUT.page_first_shape(12)).astype(np.float32)
    tier = TierFormat.resolve(fmt, "float32")
    if tier.quantized:
        from pallas_kernels.quant_transfer import quantize_pages_reference

        q, scales = (np.asarray(a) for a in quantize_pages_reference(host_pages, fmt))
        host = HostPool.from_array(LAYOUT, q, scales, tier)
    else:
        host = HostPool.from_array(LAYOUT, host_pages, tier_format=tier)
    pools = {
        "layer-first": DevicePool(LAYOUT, 9, tier_format=tier),
        "grouped": DevicePool(LAYOUT, 9, tier_format=tier, grouped=GroupedPoolLayout(LAYOUT, LOCAL, 9, 9)),
    }
    local = pools["grouped"].local
    local.hand_out_in([4, 7, 0, 8, 2, 6, 1, 3, 5])  # local page ids unlike the global ones
    local.allocated(list(range(9)))
    src, dst = [3, 0, 7, 11, 5], [8, 2, 0, 5, 1]  # 5 pages: chunks of 4 + 1, the last padded
    for pool in pools.values():
        for staged in pool.load_from_host(host, src, dst, chunk_pages=4):
            staged.block_until_ready()
    backups = {name: [np.asarray(a) for a in pool.gather_tier(dst)] for name, pool in pools.items()}
    for want, got in zip(backups["layer-first"], backups["grouped"]):
        np.testing.assert_array_equal(got[: len(dst)], want[: len(dst)])
    grouped, first = pools["grouped"], np.asarray(pools["layer-first"].kv)
    kv = np.asarray(grouped.kv)
    base = grouped.grouped.page_base
    for layer in range(LAYOUT.num_layers):  # every row where the layout and the map say
        ids = local.array if LOCAL[layer] else np.arange(9)
        np.testing.assert_array_equal(kv[0][:, base[layer] + ids], first[layer])
    assert kv.shape == (1, 2, 45, 4, 2, 8) and grouped.moved == pools["layer-first"].moved


def _runner(model, backend: str, pages: int = 64) -> ModelRunner:
    """A runner over a grouped pool whose local pages are handed out in reverse, so every
    local layer reads other page ids than the global layers (through the step's map)."""
    config = RunnerConfig(
        page_size=4, num_device_pages=pages, max_batch_tokens=64, max_batch_size=4, max_context_tokens=256,
        kv_layer_groups=True, kernel_backend=backend,
    )  # fmt: skip
    layout = KVLayout(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, 4)
    grouped = GroupedPoolLayout(layout, model.config.local_layers, pages, pages)
    pool = DevicePool(layout, pages, grouped=grouped)
    pool.local.hand_out_in(list(range(pages))[::-1])
    pool.local.allocated(list(range(pages)))
    assert pool.local.array.tolist() == list(range(pages))[::-1]
    return ModelRunner(model, config, pool=pool)


@pytest.mark.parametrize(("kind", "backend"), [("gemma3", "auto"), ("gemma2", "interpret")])
def test_steps_on_grouped_pool_match_transformers(tmp_path, kind, backend):
    """A prompt crossing the window several times, then decodes, on scattered pages; gemma2
    with the Pallas kernels interpreted (the GPU path reads the one-layer pool at offsets)."""
    hf = make_hf_model(kind, tmp_path)
    model = load_model(str(tmp_path)).model
    rng = np.random.default_rng(5)
    ids = rng.integers(0, model.config.vocab_size, size=54).tolist()
    runner = _runner(model, backend)
    assert runner.pool.kv.shape[:2] == (1, 2)
    pages = rng.permutation(64)[: -(-len(ids) // 4)].tolist()
    got = [runner.step([SeqInput(ids[:40], 0, pages)], all_logits=True).logits]
    for pos in range(40, len(ids)):
        got.append(runner.step([SeqInput([ids[pos]], pos, pages)], all_logits=True).logits)
    got = np.concatenate(got)
    ref = hf_logits(hf, ids).numpy()
    assert np.abs(got - ref).max() <= TOL
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # the local layers' KV went to the pages' local ids (reversed), and only there
    kv, grouped = np.asarray(runner.pool.kv), runner.pool.grouped
    local_rows = 64 - 1 - np.asarray(pages)
    for layer, local in enumerate(model.config.local_layers):
        rows = kv[0][:, grouped.page_base[layer] : grouped.page_base[layer] + 64]  # [2, 64 pages, S, H, D]
        written = np.flatnonzero(np.abs(rows).reshape(2, 64, -1).max(axis=(0, 2)) > 0)
        assert sorted(written) == sorted(local_rows if local else pages), layer


def test_engine_tiers_on_grouped_pool_give_the_layer_first_tokens(tmp_path):
    from test_engine_kernels import assert_tiers_agree, tier_tokens

    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)  # tier_tokens' prompts use ids < 256

    def shuffle_local_ids(engine) -> None:  # noqa: ANN001
        pool = engine.ctl.device_pool
        assert pool.kv.shape[:2] == (1, 2)
        pool.local.hand_out_in(np.random.default_rng(3).permutation(pool.num_pages).tolist())

    def local_ids_differ(engine) -> None:  # noqa: ANN001  (the accounting check saw them follow the pages)
        array = engine.ctl.device_pool.local.array
        used = np.flatnonzero(array >= 0)
        assert len(used) and (array[used] != used).mean() > 0.9

    model = str(tmp_path / "model")
    layer_first = tier_tokens("auto", str(tmp_path / "kv0"), model=model)
    grouped = tier_tokens(
        "auto", str(tmp_path / "kv1"), model=model, kv_layer_groups=True, prepare=shuffle_local_ids, inspect=local_ids_differ
    )
    assert_tiers_agree(layer_first["tiers"])
    assert_tiers_agree(grouped["tiers"], layer_first["tiers"]["cold"][0])  # every tier: the layer-first tokens


def test_write_back_eviction_keeps_the_local_layers_kv(tmp_path):
    """Under write_back an evicted page is backed up to L2 on its way out: its local rows
    must be gathered before its local page is given back (and handed to another page)."""
    make_hf_model("gemma3", tmp_path / "model")
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(12)
    docs = [rng.integers(0, 96, size=200).tolist() for _ in range(3)]  # 12 full pages each, 28 in L1
    results = {}
    for groups in (False, True):
        engine = Engine(EngineConfig(
            model=str(tmp_path / "model"), warmup=False, show_progress=False, tiers="L1+L2", page_size=16,
            device_tokens=448, max_batch_tokens=64, max_batch_size=2, max_context_tokens=256, write_policy="write_back",
            kv_layer_groups=groups,
        ))  # fmt: skip
        try:
            if groups:
                engine.ctl.device_pool.local.hand_out_in(np.random.default_rng(4).permutation(28).tolist())
            cold = [engine.generate([d + [1]], greedy)[0] for d in docs]  # each evicts the one before to L2
            again = [engine.generate([d + [2]], greedy)[0] for d in docs]
            assert engine.ctl.counters["evicted_device_pages"] > 0
            assert again[0].cached_tokens["host"] == 192, again[0].cached_tokens  # came back from the write-back
            engine.check_accounting()
        finally:
            engine.shutdown()
        results[groups] = [o.token_ids for o in cold + again]
    assert results[True] == results[False]
