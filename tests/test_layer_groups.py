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
    local.attach(list(range(9)))
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
        page_size=4,
        num_device_pages=pages,
        max_batch_tokens=64,
        max_batch_size=4,
        max_context_tokens=256,
        kernel_backend=backend,
    )
    layout = KVLayout(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, 4)
    grouped = GroupedPoolLayout(layout, model.config.local_layers, pages, pages)
    pool = DevicePool(layout, pages, grouped=grouped)
    pool.local.hand_out_in(list(range(pages))[::-1])
    pool.local.attach(list(range(pages)))
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
        "auto",
        str(tmp_path / "kv1"),
        model=model,
        kv_layer_groups=True,
        prepare=shuffle_local_ids,
        inspect=local_ids_differ,
    )
    assert_tiers_agree(layer_first["tiers"])
    assert_tiers_agree(grouped["tiers"], layer_first["tiers"]["cold"][0])  # every tier: the layer-first tokens


def test_trimmed_local_pages_give_the_layer_first_tokens_from_every_tier(tmp_path):
    """A local-layer pool of 13 pages for 128 global ones (``kv_local_ratio=0.1``): local KV
    outside the running windows is trimmed, loads move only the window's, and every tier
    still gives the layer-first engine's tokens with the same hits."""
    from test_engine_kernels import assert_tiers_agree, tier_tokens

    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    seen = {}

    def inspect(engine) -> None:  # noqa: ANN001
        ctl = engine.ctl
        seen.update(
            evicted=ctl.device_pool.local.evicted, local_pages=ctl.device_pool.local.num_pages, **ctl.bytes_per_token()
        )

    model = str(tmp_path / "model")
    layer_first = tier_tokens("auto", str(tmp_path / "kv0"), model=model)
    trimmed = tier_tokens(
        "auto", str(tmp_path / "kv1"), model=model, kv_layer_groups=True, kv_local_ratio=0.1, inspect=inspect
    )
    assert_tiers_agree(trimmed["tiers"], layer_first["tiers"]["cold"][0])
    assert seen["local_pages"] == 13 and seen["evicted"] > 0, seen
    # 1 of 4 layers global; of the 3 local ones only each prefix's window page came back
    # from L2/L3: the document's 9 pages and the short prompt's 2 pages, one window page each
    full = seen["device_bytes_per_token"]
    assert seen["load_bytes_per_token"] == pytest.approx(full * (1 / 4 + 3 / 4 * 2 / 11)), seen


def test_write_back_eviction_keeps_the_local_layers_kv(tmp_path):
    """Under write_back an evicted page is backed up to L2 on its way out: its local rows
    must be gathered before its local page is given back (and handed to another page)."""
    make_hf_model("gemma3", tmp_path / "model")
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(12)
    docs = [rng.integers(0, 96, size=200).tolist() for _ in range(3)]  # 12 full pages each, 28 in L1
    results = {}
    for groups in (False, True):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path / "model"),
                warmup=False,
                show_progress=False,
                tiers="L1+L2",
                page_size=16,
                device_tokens=448,
                max_batch_tokens=64,
                max_batch_size=2,
                max_context_tokens=256,
                write_policy="write_back",
                kv_layer_groups=groups,
            )
        )
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


def test_trimmed_pages_reach_l2_and_l3_as_global_only(tmp_path):
    """Pages whose local KV was trimmed are backed up to L2 and written to L3 as global-only
    (a flag per L2 page, a header flag per L3 object): a reuse whose window was kept hits
    all of it, one whose window was trimmed recomputes, and a layer-first server sharing
    the L3 store misses the global-only objects instead of decoding them; every answer is
    the cold one."""
    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(8)
    doc = rng.integers(0, 256, size=128).tolist()  # 8 pages of 16; the window (16) needs 1 page
    again, branch = doc + [4, 5, 6], doc[:64] + [7, 8, 9]

    def engine(groups: bool, storage: str) -> Engine:
        return Engine(
            EngineConfig(
                model=str(tmp_path / "model"),
                warmup=False,
                show_progress=False,
                tiers="L1+L2+L3",
                page_size=16,
                device_tokens=1024,
                max_batch_tokens=64,
                max_batch_size=2,
                max_context_tokens=256,
                write_policy="write_back",
                storage_dir=str(tmp_path / storage),
                prefetch_policy="wait_complete",
                prefetch_min_tokens=0,
                kv_layer_groups=groups,
            )
        )

    cold = engine(False, "cold")
    try:
        want = [o.token_ids for o in (cold.generate([again], greedy)[0], cold.generate([branch], greedy)[0])]
    finally:
        cold.shutdown()

    grouped = engine(True, "shared")
    try:
        grouped.generate([doc + [1, 2, 3]], greedy)
        ctl = grouped.ctl
        pages = ctl.page_table(doc)
        ctl.local_pages.device.detach(pages[:6])  # trimmed: only the last two pages keep local KV
        before = dict(ctl.device_pool.moved)
        grouped.flush_cache("device")  # write-back to L2
        # the device->host copy moved 8 pages' global layer (1 of 4) and 2 pages' local layers
        moved = {k: ctl.device_pool.moved[k] - before[k] for k in before}
        assert moved["backed_up_pages"] == 8
        assert moved["backed_up_bytes"] == ctl.page_bytes * (8 * 1 + 2 * 3) // 4, moved
        host_pages = [p for node in ctl.tree.iter_nodes() if node.host for p in node.host]
        assert sorted(ctl.local_pages.on_host(p) for p in host_pages) == [False] * 6 + [True] * 2
        grouped.flush_cache("host")  # write-back to L3
        got_again = grouped.generate([again], greedy)[0]
        assert got_again.cached_tokens["storage"] == 128, got_again.cached_tokens
        got_branch = grouped.generate([branch], greedy)[0]
        assert sum(got_branch.cached_tokens.values()) == 0, got_branch.cached_tokens  # its window was trimmed
        assert [got_again.token_ids, got_branch.token_ids] == want
        grouped.check_accounting()
    finally:
        grouped.shutdown()

    layer_first = engine(False, "shared")
    try:
        got = layer_first.generate([again], greedy)[0]
        assert got.token_ids == want[0] and got.cached_tokens["storage"] == 0, got.cached_tokens
        assert layer_first.ctl.counters["storage_format_misses"] > 0
    finally:
        layer_first.shutdown()


def test_documents_with_questions_on_a_tight_local_pool(tmp_path):
    """Four documents, three rounds of questions, two requests at a time, on a local-layer
    pool of 16 pages for 64 global ones (about two documents' worth): local KV is trimmed
    and reused where its window survived; every answer is the layer-first engine's."""
    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    rng = np.random.default_rng(9)
    docs = [rng.integers(0, 256, size=112).tolist() for _ in range(4)]  # 7 pages each
    rounds = [[d + rng.integers(0, 256, size=5).tolist() for d in docs] for _ in range(3)]
    results, stats = {}, {}
    for groups in (False, True):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path / "model"),
                warmup=False,
                show_progress=False,
                tiers="L1+L2",
                page_size=16,
                device_tokens=1024,
                max_batch_tokens=64,
                max_batch_size=2,
                max_context_tokens=256,
                kv_layer_groups=groups,
                kv_local_ratio=0.25 if groups else 1.0,
            )
        )
        try:
            outs = [o for prompts in rounds for o in engine.generate(prompts, greedy)]
            engine.check_accounting()
            stats[groups] = {
                "hit": sum(o.cached_tokens["device"] + o.cached_tokens["host"] for o in outs),
                "evicted": engine.ctl.device_pool.local.evicted if groups else 0,
            }
        finally:
            engine.shutdown()
        results[groups] = [o.token_ids for o in outs]
    assert results[True] == results[False]
    # trimmed, yet lazily enough that every document's end kept its window: no hit lost
    assert stats[True]["evicted"] > 0 and stats[True]["hit"] == stats[False]["hit"] > 0, stats


def test_a_load_whose_window_finds_every_local_page_pinned_gives_its_pages_back(tmp_path):
    """A load needs local pages for its window; when running requests' windows pin them
    all, it raises ``CacheFullError`` and frees the device pages it took (nothing leaks),
    and the same load succeeds once the pins go."""
    from strata_jax.cache.controller import CacheFullError

    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    engine = Engine(
        EngineConfig(
            model=str(tmp_path / "model"),
            warmup=False,
            show_progress=False,
            tiers="L1+L2",
            page_size=16,
            device_tokens=1024,
            max_batch_tokens=64,
            max_batch_size=2,
            max_context_tokens=256,
            kv_layer_groups=True,
            kv_local_ratio=0.25,
        )
    )
    try:
        doc = np.random.default_rng(3).integers(0, 256, size=128).tolist()
        engine.generate([doc + [1]], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.flush_cache("device")
        ctl, local = engine.ctl, engine.ctl.local_pages.device
        blockers = ctl.alloc_device(local.num_pages)
        ctl.attach_local(blockers)
        local.pin("blocker", blockers)
        match = ctl.match_prefix(doc)
        assert match.host_tokens == 128, match
        ctl.lock(match.last_node)
        free = ctl.device_alloc.num_free
        with pytest.raises(CacheFullError, match="pinned by running requests"):
            ctl.load(match, "r")
        assert ctl.device_alloc.num_free == free
        local.unpin("blocker")
        handle = ctl.load(match, "r")
        assert handle is not None and handle.num_pages == 8
        ctl.wait(handle)
        ctl.unlock(match.last_node)
        ctl.device_alloc.free(blockers)
        engine.check_accounting()
    finally:
        engine.shutdown()


def test_device_kv_bytes_a_running_request_holds(tmp_path):
    """``cache_stats()["running_device_kv_bytes"]``: a running request holds every page's
    global layers and the local layers of the pages its window still reads (``first_needed_page``
    of the position a page before its next one, to its last page); layer-first, every layer."""
    from strata_jax.engine.sinks import CollectingSink

    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)  # 4 layers, 1 global; window 16
    layer_page = 2 * 16 * 2 * 32 * 4  # K and V, page 16, 2 KV heads, head_dim 32, float32
    held = {}
    for groups in (False, True):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path / "model"),
                warmup=False,
                show_progress=False,
                tiers="L1",
                page_size=16,
                dtype="float32",
                device_tokens=1024,
                max_batch_tokens=64,
                max_batch_size=2,
                max_context_tokens=512,
                kv_layer_groups=groups,
            ),
            start=False,
        )
        try:
            ctl = engine.ctl
            pages = ctl.alloc_device(20)
            ctl.attach_local(pages)
            ctl.pin_local("r", pages, next_position=300)
            # next position 300: from the window of position 284 on, i.e. page (284 - 16 + 1) // 16 = 16
            want = 20 * 4 * layer_page if not groups else (20 * 1 + (20 - 16) * 3) * layer_page
            assert ctl.device_kv_bytes("r", pages) == want
            ctl.unpin_local("r")
            ctl.device_alloc.free(pages)

            # Driven step by step on this thread (start=False): the stats are read after the
            # first token, while the request decodes, whatever the machine's load.
            sink = CollectingSink()
            engine.submit(list(range(1, 201)), SamplingParams(max_tokens=8, ignore_eos=True), sink=sink)
            engine.admit_pending()
            for _ in range(100):
                engine.step()
                if any(c.token_ids for c in sink.chunks):
                    break
            assert any(c.token_ids for c in sink.chunks) and not any(c.finished for c in sink.chunks)
            held[groups] = engine.cache_stats()["running_device_kv_bytes_by_request"]
        finally:
            engine.shutdown()
    # 200 prompt tokens, decoding: 13 pages; grouped keeps 1 or 2 window pages of local KV
    (first,) = held[False]
    assert first["bytes"] == 13 * 4 * layer_page, held
    (grouped,) = held[True]
    assert grouped["bytes"] in ((13 + 2 * 3) * layer_page, (13 + 3 * 3) * layer_page), held


def test_l2_with_layer_groups_holds_more_documents_in_the_same_bytes(tmp_path):
    """``--kv-host-local-ratio 0.25`` on a model with 3 of 4 layers windowed: a host page
    costs 1/4 + 3/4 x 1/4 of a full one, so the same L2 bytes hold 73 pages instead of 32.
    Six documents of 7 pages asked in turn (two rounds, L1 holds two): the layer-first L2
    cannot keep them all and recomputes, the grouped one serves every second question from
    L2, its small local pool keeping the window before each document's end; same tokens."""
    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(21)
    docs = [rng.integers(0, 256, size=112).tolist() for _ in range(6)]  # 7 pages each
    rounds = [[d + rng.integers(0, 256, size=4).tolist() for d in docs] for _ in range(2)]
    results, stats = {}, {}
    for groups in (False, True):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path / "model"),
                warmup=False,
                show_progress=False,
                tiers="L1+L2",
                page_size=16,
                device_tokens=256,
                hicache_ratio=2.0,
                max_batch_tokens=64,
                max_batch_size=1,
                max_context_tokens=192,
                kv_layer_groups=groups,
                kv_host_local_ratio=0.25 if groups else None,
            )
        )
        try:
            outs = [engine.generate([p], greedy)[0] for prompts in rounds for p in prompts]
            engine.check_accounting()
            ctl = engine.ctl
            stats[groups] = {
                "host_pages": ctl.host_alloc.num_pages,
                "host_bytes": ctl.transfers.host_pool.nbytes,
                "second_round_host_hits": sum(o.cached_tokens["host"] for o in outs[6:]),
                "local_host_evicted": ctl.transfers.host_pool.local.evicted if groups else 0,
            }
        finally:
            engine.shutdown()
        results[groups] = [o.token_ids for o in outs]
    assert results[True] == results[False]
    first, grouped = stats[False], stats[True]
    assert first["host_pages"] == 32 and grouped["host_pages"] == 73, stats
    assert grouped["host_bytes"] <= first["host_bytes"], stats
    assert grouped["second_round_host_hits"] == 6 * 112 > first["second_round_host_hits"], stats
    assert grouped["local_host_evicted"] > 0, stats


@pytest.mark.parametrize("admission", [True, False], ids=["local_room_admission", "without_it"])
def test_concurrent_requests_on_a_local_pool_for_one_window(tmp_path, admission):
    """Six requests at once on 6 local pages (one request's window and chunk): the scheduler
    starts only what the local pages can hold (``new_request_room``), so every request
    finishes with the layer-first engine's tokens.  Without that admission the running
    windows pin every local page and steps fail with "out of device KV memory"."""
    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    rng = np.random.default_rng(31)
    prompts = [rng.integers(0, 256, size=60).tolist() for _ in range(6)]
    results = {}
    for groups in (False, True):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path / "model"),
                warmup=False,
                show_progress=False,
                tiers="L1",
                page_size=16,
                device_tokens=1024,
                max_batch_tokens=64,
                max_batch_size=4,
                max_context_tokens=256,
                kv_layer_groups=groups,
                kv_local_ratio=0.1 if groups else 1.0,
            )
        )
        try:
            if groups:
                assert engine.ctl.device_pool.local.num_pages == 6
                if not admission:
                    engine.ctl.new_request_room = lambda step_tokens: None
            try:
                results[groups] = [o.token_ids for o in engine.generate(prompts, params)]
            except Exception as exc:  # noqa: BLE001 - the run without admission
                results[groups] = exc
            engine.check_accounting()
        finally:
            engine.shutdown()
    if admission:
        assert results[True] == results[False]
    else:
        assert isinstance(results[True], Exception) and "out of device KV memory" in str(results[True]), results[True]


def test_a_model_whose_every_layer_is_windowed_hits_every_tier(tmp_path):
    """Mistral with a sliding window on every layer: no global layer at all.  With layer
    groups (and their L2) every tier still hits and gives the layer-first engine's tokens."""
    from test_engine_kernels import assert_tiers_agree, tier_tokens

    make_hf_model("mistral_window", tmp_path / "model", vocab_size=256)
    model = str(tmp_path / "model")
    layer_first = tier_tokens("auto", str(tmp_path / "kv0"), model=model)
    grouped = tier_tokens("auto", str(tmp_path / "kv1"), model=model, kv_layer_groups=True, kv_local_ratio=0.5)
    assert_tiers_agree(grouped["tiers"], layer_first["tiers"]["cold"][0])
