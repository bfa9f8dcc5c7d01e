"""LoRA adapters: outputs equal transformers + peft on the same base and adapter, batched
across adapters, with KV namespaced by the adapter's content in every tier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import hf_logits, make_hf_model

pytest.importorskip("peft", reason="the LoRA references need peft (pip install -e '.[test]')")
from lora_reference import ALL_MODULES, save_random_adapter  # noqa: E402

from strata_jax.api import InvalidRequestError, SamplingParams  # noqa: E402
from strata_jax.lora.peft_adapter import AdapterError, load_peft_adapter  # noqa: E402
from strata_jax.models.loader import load_model  # noqa: E402
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput  # noqa: E402

# (rank, alpha, rsLoRA, targets, seed): two ranks, rsLoRA on and off, all seven modules and a subset
ADAPTERS = {
    "a8rs": (8, 16, True, ALL_MODULES, 1),
    "a4": (4, 8, False, ALL_MODULES, 2),
    "attn": (4, 4, False, ["q_proj", "v_proj", "o_proj"], 3),
    "mlp16": (16, 32, True, ["gate_proj", "up_proj", "down_proj"], 4),
}


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """A random GQA model (qwen2: 4 heads, 2 KV heads, qkv bias) and four adapters on it."""
    root = tmp_path_factory.mktemp("lora")
    base = make_hf_model("qwen2", root / "base")
    refs = {name: save_random_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}
    return root, base.eval(), refs


def _runner(model, slots: int = 4, rank: int = 16) -> ModelRunner:
    config = RunnerConfig(
        page_size=4,
        num_device_pages=128,
        max_batch_tokens=128,
        max_batch_size=8,
        max_context_tokens=128,
        max_loras=slots,
        max_lora_rank=rank,
    )
    return ModelRunner(model, config)


def test_runner_logits_equal_peft_per_adapter_and_in_one_mixed_step(gqa):
    root, base, refs = gqa
    loaded = load_model(str(root / "base"))
    runner = _runner(loaded.model)
    assert runner.lora is not None
    names = list(ADAPTERS)
    for slot, name in enumerate(names):
        runner.lora.install(slot, load_peft_adapter(name, root / name, loaded.config, max_rank=16))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, loaded.config.vocab_size, size=n).tolist() for n in (23, 17, 30, 9, 26)]
    slots = [0, 1, 2, 3, -1]  # four adapters and the base model, one step
    seqs, next_page = [], 0
    for ids, slot in zip(prompts, slots):
        pages = list(range(next_page, next_page + -(-len(ids) // 4)))
        next_page += len(pages)
        seqs.append(SeqInput(ids, 0, pages, adapter_slot=slot))
    logits = runner.step(seqs, all_logits=True).logits
    offset = 0
    for ids, slot in zip(prompts, slots):
        ours = logits[offset : offset + len(ids)]
        offset += len(ids)
        with torch.no_grad():
            ref = hf_logits(base if slot < 0 else refs[names[slot]], ids).numpy()
            plain = hf_logits(base, ids).numpy()
        assert np.abs(ours - ref).max() <= 1e-4, names[slot] if slot >= 0 else "base"
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
        if slot >= 0:
            assert np.abs(ref - plain).max() > 0.05  # the adapter changes the output: the check can fail


@pytest.mark.parametrize(
    "slots",
    [
        [2, 2, 2],  # one adapter, the bucket's fourth row padding: that adapter's columns only
        [1, -1],  # an adapter beside a base row: every slot's columns, masked per token
        [-1, -1, -1],  # base rows only: no LoRA work at all
    ],
)
def test_runner_steps_of_one_adapter_mixed_and_none_equal_peft(gqa, slots):
    root, base, refs = gqa
    loaded = load_model(str(root / "base"))
    runner = _runner(loaded.model)
    assert runner.lora is not None
    names = list(ADAPTERS)
    for slot, name in enumerate(names):
        runner.lora.install(slot, load_peft_adapter(name, root / name, loaded.config, max_rank=16))
    rng = np.random.default_rng(len(slots))
    prompts = [rng.integers(0, loaded.config.vocab_size, size=n).tolist() for n in (11, 14, 9)[: len(slots)]]
    seqs = [
        SeqInput(ids, 0, list(range(8 * i, 8 * i + 4)), adapter_slot=s)
        for i, (ids, s) in enumerate(zip(prompts, slots))
    ]
    logits = runner.step(seqs, all_logits=True).logits
    offset = 0
    for ids, slot in zip(prompts, slots):
        with torch.no_grad():
            ref = hf_logits(base if slot < 0 else refs[names[slot]], ids).numpy()
        assert np.abs(logits[offset : offset + len(ids)] - ref).max() <= 1e-4, slot
        offset += len(ids)
    decode = [SeqInput([5], len(ids), s.page_ids, adapter_slot=s.adapter_slot) for ids, s in zip(prompts, seqs)]
    nxt = runner.step(decode, all_logits=True).logits  # a decode step in the same mode
    for i, (ids, slot) in enumerate(zip(prompts, slots)):
        with torch.no_grad():
            ref = hf_logits(base if slot < 0 else refs[names[slot]], [*ids, 5]).numpy()[-1]
        assert np.abs(nxt[i] - ref).max() <= 1e-4, slot


def test_step_mode_against_brute_force():
    import itertools

    import jax.numpy as jnp

    from strata_jax.models.lora import MIXED, NONE, SINGLE, step_mode

    for tokens in itertools.product([-2, -1, 0, 1, 3], repeat=4):
        adapters = {t for t in tokens if t >= 0}
        if not adapters:
            want = NONE
        elif len(adapters) == 1 and -1 not in tokens:
            want = SINGLE
        else:
            want = MIXED
        mode, slot = step_mode(jnp.asarray(tokens, jnp.int32))
        assert int(mode) == want, tokens
        if want == SINGLE:
            assert int(slot) == adapters.pop(), tokens


def test_reader_identity_follows_content_not_name(gqa, tmp_path):
    root, _, _ = gqa
    config = load_model(str(root / "base")).config
    first = load_peft_adapter("x", root / "a4", config, max_rank=16)
    shutil.copytree(root / "a4", tmp_path / "renamed")
    again = load_peft_adapter("y", tmp_path / "renamed", config, max_rank=16)
    assert again.identity == first.identity
    spec = json.loads((tmp_path / "renamed" / "adapter_config.json").read_text())
    spec["lora_alpha"] = 9  # same weights, another scaling: another adapter
    (tmp_path / "renamed" / "adapter_config.json").write_text(json.dumps(spec))
    assert load_peft_adapter("y", tmp_path / "renamed", config, max_rank=16).identity != first.identity
    assert load_peft_adapter("z", root / "a8rs", config, max_rank=16).identity != first.identity
    assert first.scaling == 8 / 4 and load_peft_adapter("r", root / "a8rs", config, max_rank=16).scaling == 16 / 8**0.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 2}}, "per-module ranks"),
        ({"r": 0}, "r=0"),
        ({"peft_type": "IA3"}, "not LORA"),
    ],
)
def test_reader_refuses_what_it_would_get_wrong(gqa, tmp_path, change, message):
    root, _, _ = gqa
    config = load_model(str(root / "base")).config
    shutil.copytree(root / "a4", tmp_path / "ad")
    spec = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(spec | change))
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter("ad", tmp_path / "ad", config, max_rank=16)


def test_reader_refuses_wrong_base_rank_and_folder(gqa, tmp_path):
    root, _, _ = gqa
    config = load_model(str(root / "base")).config
    with pytest.raises(AdapterError, match="exceeds --max-lora-rank 8"):
        load_peft_adapter("m", root / "mlp16", config, max_rank=8)
    import dataclasses

    wider = dataclasses.replace(config, hidden_size=config.hidden_size * 2)
    with pytest.raises(AdapterError, match="the base model needs"):
        load_peft_adapter("a", root / "a4", wider, max_rank=16)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft_adapter("a", tmp_path, config, max_rank=16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4}))
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_peft_adapter("a", tmp_path, config, max_rank=16)
    assert issubclass(AdapterError, InvalidRequestError)  # the faces answer 400


# ---------------------------------------------------------------------------------------
# the engine: greedy tokens from every tier, batches, cache identity, load/unload


def _engine(root: Path, storage: Path, *, adapters=("a8rs", "a4"), start: bool = True, **overrides):
    from strata_jax.engine import Engine, EngineConfig

    config = dict(
        model=str(root / "base"),
        warmup=False,
        show_progress=False,
        page_size=4,
        tiers="L1+L2+L3",
        storage_dir=str(storage),
        device_tokens=1024,
        max_context_tokens=256,
        prefetch_min_tokens=0,
        prefetch_policy="wait_complete",
        max_loras=4,
        lora_modules=tuple((name, str(root / name)) for name in adapters),
    )
    return Engine(EngineConfig(**(config | overrides)), start=start)


def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids) :]


def test_engine_greedy_equals_peft_cold_and_from_every_tier(gqa, tmp_path):
    root, base, refs = gqa
    prompt = np.random.default_rng(5).integers(0, 96, size=60).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = {name: _hf_greedy(refs[name], prompt, 8) for name in ("a8rs", "a4")}
    want_base = _hf_greedy(base, prompt, 8)
    assert want["a8rs"] != want_base or want["a4"] != want_base  # adapters change the answer
    engine = _engine(root, tmp_path / "l3")
    try:
        for name in ("a8rs", "a4"):
            cold = engine.generate([prompt], params, lora_name=name)[0]
            assert cold.token_ids == want[name] and cold.num_cached_tokens == 0, name
            hit = engine.generate([prompt], params, lora_name=name)[0]
            assert hit.token_ids == want[name] and hit.cached_tokens["device"] > 0, name
        engine.flush_cache("device")
        for name in ("a8rs", "a4"):
            out = engine.generate([prompt], params, lora_name=name)[0]
            assert out.token_ids == want[name] and out.cached_tokens["host"] > 0, name
        engine.flush_cache("device")
        engine.flush_cache("host")
        for name in ("a8rs", "a4"):
            out = engine.generate([prompt], params, lora_name=name)[0]
            assert out.token_ids == want[name] and out.cached_tokens["storage"] > 0, name
        assert engine.generate([prompt], params)[0].token_ids == want_base  # the base: none of their pages
        engine.check_accounting()
    finally:
        engine.shutdown()


def test_batch_of_base_and_four_adapters_gives_every_row_its_own_tokens(gqa, tmp_path):
    from strata_jax.engine.output import collect
    from strata_jax.engine.sinks import CollectingSink

    root, base, refs = gqa
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (21, 34, 13, 40, 27)]
    names = [None, "a8rs", "a4", "attn", "mlp16"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine = _engine(root, tmp_path / "l3", adapters=tuple(ADAPTERS), tiers="L1", start=False)
    try:
        sinks = [CollectingSink() for _ in prompts]
        ids = [engine.submit(p, params, lora_name=n, sink=k) for p, n, k in zip(prompts, names, sinks)]
        engine.run_until_idle()  # admitted together: their prefills share the first step, decodes the rest
        together = [collect(rid, k.chunks).token_ids for rid, k in zip(ids, sinks)]
        for p, n, tokens in zip(prompts, names, together):
            assert tokens == _hf_greedy(base if n is None else refs[n], p, 6), n
        assert len({tuple(t) for t in together}) > 1
    finally:
        engine.shutdown()


def test_adapter_rows_decoding_inside_mixed_steps_keep_peft_tokens(gqa, tmp_path):
    """Rows of different adapters decode inside other prompts' 16-token chunks (mixed steps):
    each one's tokens are its adapter's, as peft gives them."""
    from strata_jax.engine.output import collect
    from strata_jax.engine.sinks import CollectingSink

    root, base, refs = gqa
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (5, 7, 60, 48)]
    names = ["a8rs", "a4", None, "a4"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine = _engine(
        root, tmp_path / "l3", tiers="L1", start=False, max_batch_tokens=16, max_batch_size=8, mixed_steps=True
    )
    try:
        sinks = [CollectingSink() for _ in prompts]
        ids = [engine.submit(p, params, lora_name=n, sink=k) for p, n, k in zip(prompts, names, sinks)]
        engine.run_until_idle()
        for rid, sink, p, n in zip(ids, sinks, prompts, names):
            assert collect(rid, sink.chunks).token_ids == _hf_greedy(base if n is None else refs[n], p, 6), n
        assert engine.counters["mixed_steps"] > 0
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def long_gqa(tmp_path_factory):
    """A random GQA model with room for a 1,500-token prompt, and two adapters on it."""
    root = tmp_path_factory.mktemp("lora_long")
    base = make_hf_model("qwen2", root / "base", max_position_embeddings=2048)
    for name in ("a8rs", "a4"):
        save_random_adapter(base, root / name, *ADAPTERS[name])
    return root


def _pages_by_namespace(tree) -> dict[str, dict[str, set[int]]]:
    out: dict[str, dict[str, set[int]]] = {}
    for node in tree.iter_nodes():
        tiers = out.setdefault(node.namespace, {"device": set(), "host": set()})
        tiers["device"] |= set(node.device or ())
        tiers["host"] |= set(node.host or ())
    return out


def test_two_adapters_over_one_prompt_share_no_page_in_any_tier_and_a_renamed_load_reads_l3(long_gqa, tmp_path):
    from strata_jax.cache.hashing import chain_hashes
    from strata_jax.kv_events.recorder import KVEventRecorder
    from strata_jax.lora.peft_adapter import adapter_namespace

    root = long_gqa
    prompt = np.random.default_rng(7).integers(0, 96, size=1500).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0)
    common = dict(page_size=16, device_tokens=8192, max_context_tokens=2048, max_batch_tokens=512)
    engine = _engine(root, tmp_path / "l3", **common)
    events: list = []
    recorder = KVEventRecorder(engine.ctl.tree, lambda ts, batch: events.extend(batch), engine.adapters.name_of)
    engine.ctl.tree.tier_observer = recorder.observe
    engine.core.kv_event_recorder = recorder
    try:
        first = {name: engine.generate([prompt], params, lora_name=name)[0].token_ids for name in ("a8rs", "a4")}
        engine.generate([prompt], params)  # and the base model
        engine.check_accounting()
        identities = {e.adapter.name: e.identity for e in engine.adapters.listing()}
        namespaces = [adapter_namespace("", identities["a8rs"]), adapter_namespace("", identities["a4"]), ""]
        pages = _pages_by_namespace(engine.ctl.tree)
        assert set(namespaces) <= set(pages)
        for tier in ("device", "host"):
            held = [pages[ns][tier] for ns in namespaces]
            assert all(len(h) >= 1500 // 16 for h in held), tier  # each holds the whole prompt
            assert not (held[0] & held[1]) and not (held[0] & held[2]) and not (held[1] & held[2]), tier
        store = engine.ctl.store
        assert store is not None
        keys = [set(store.object_keys(chain_hashes(engine.ctl.tree.seed(ns), prompt, 16))) for ns in namespaces]
        for k in keys:
            assert len(k) == 1500 // 16 and store.backend.batch_exists(sorted(k)) == len(k)
        assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
        stored = [e for e in events if e[0] == "stored"]
        by_name = {e[5] for e in stored}
        assert by_name == {"a8rs", "a4", None}
        for e in stored:
            if e[5] is not None:
                assert e[6] == [("lora", identities[e[5]])] * len(e[2])
            else:
                assert e[6] is None
    finally:
        engine.shutdown()
    # a second server over the same L3, the adapter loaded under another name: it reads the pages back
    renamed = _engine(root, tmp_path / "l3", adapters=(), **common)
    try:
        renamed.load_lora_adapter("renamed", str(root / "a4"))
        out = renamed.generate([prompt], params, lora_name="renamed")[0]
        assert out.token_ids == first["a4"]
        assert out.cached_tokens["storage"] >= 1488, out.cached_tokens
    finally:
        renamed.shutdown()


def test_kv_event_with_extra_keys_round_trips_through_vllm_wire_format():
    import msgspec

    from strata_jax.kv_events.schema import KVEventBatch, to_struct

    raw = ("stored", "GPU", [7, 8], None, list(range(8)), "mine", [("lora", "abc")] * 2)
    batch = KVEventBatch(1.0, [to_struct(raw, 4)], 0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)
    event = back.events[0]
    assert event.lora_name == "mine" and [tuple(k) for k in event.extra_keys] == [("lora", "abc")] * 2
    plain = to_struct(("stored", "GPU", [7], None, list(range(4)), None, None), 4)
    assert b"extra_keys" not in msgspec.msgpack.encode(plain)  # omitted, as vLLM omits its default


def test_engine_refusals(gqa, tmp_path):
    from strata_jax.engine import Engine, EngineConfig
    from strata_jax.lora.registry import AdapterConflictError, AdapterNotFoundError

    root, _, _ = gqa
    engine = _engine(root, tmp_path / "l3", adapters=("a4",), max_loras=1, tiers="L1")
    try:
        with pytest.raises(AdapterNotFoundError, match="no LoRA adapter named 'nope'"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1), lora_name="nope")
        with pytest.raises(AdapterConflictError, match="all 1 LoRA slots are held"):
            engine.load_lora_adapter("other", str(root / "a8rs"))
        with pytest.raises(InvalidRequestError, match="other than the base model's"):
            engine.load_lora_adapter(engine.model_name, str(root / "a8rs"))
        engine.unload_lora_adapter("a4")
        assert engine.runner.lora is not None and engine.runner.lora.holds == [None]
        engine.load_lora_adapter("other", str(root / "a8rs"))  # the freed slot
        with pytest.raises(InvalidRequestError, match="U\\+001F"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1), cache_salt="x\x1flora:abc")
    finally:
        engine.shutdown()
    off = Engine(EngineConfig(model=str(root / "base"), warmup=False, show_progress=False, tiers="L1"))
    try:
        with pytest.raises(InvalidRequestError, match="LoRA is off"):
            off.load_lora_adapter("a", str(root / "a4"))
    finally:
        off.shutdown()
    with pytest.raises(InvalidRequestError, match="raise max_loras"):
        EngineConfig(max_loras=1, lora_modules=(("a", "x"), ("b", "y")))


def test_tensor_parallel_two_gives_the_tokens_of_peft(gqa, tmp_path):
    """tp=2 splits the adapters like the layers they modify (B by columns for q/k/v/gate/up,
    A by rows for o/down): logits within 1e-4 of peft's in one mixed step, greedy tokens
    equal, for every adapter and the base, cold and from L2."""
    root, base, refs = gqa
    prompt = np.random.default_rng(8).integers(0, 96, size=45).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine = _engine(root, tmp_path / "l3", adapters=tuple(ADAPTERS), tp=2, tiers="L1+L2")
    try:
        assert engine.runner.lora is not None
        assert "tp" in str(engine.runner.lora.b["q_proj"].sharding.spec)
        # logits first, while the pool is untouched (the step writes pages 0-11 directly)
        seqs = [SeqInput(prompt, 0, list(range(12 * i, 12 * i + 12)), adapter_slot=i) for i in range(len(ADAPTERS))]
        logits = engine.runner.step(seqs, all_logits=True).logits
        for i, name in enumerate(ADAPTERS):
            with torch.no_grad():
                ref = hf_logits(refs[name], prompt).numpy()
            assert np.abs(logits[i * len(prompt) : (i + 1) * len(prompt)] - ref).max() <= 1e-4, name
        for name in (*ADAPTERS, None):
            want = _hf_greedy(base if name is None else refs[name], prompt, 6)
            assert engine.generate([prompt], params, lora_name=name)[0].token_ids == want, name
        engine.flush_cache("device")
        for name in ADAPTERS:
            out = engine.generate([prompt], params, lora_name=name)[0]
            assert out.token_ids == _hf_greedy(refs[name], prompt, 6) and out.cached_tokens["host"] > 0, name
    finally:
        engine.shutdown()


def test_flush_of_one_adapter_drops_its_l1_and_l2_pages_only(gqa, tmp_path):
    from strata_jax.lora.peft_adapter import namespace_adapter

    root, _, _ = gqa
    prompt = np.random.default_rng(10).integers(0, 96, size=64).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine = _engine(root, tmp_path / "l3", tiers="L1+L2")
    try:
        for name in ("a8rs", "a4", None):
            engine.generate([prompt], params, lora_name=name)
        engine.flush_cache("device")  # the base's and both adapters' pages now in L2 only ...
        for name in ("a8rs", "a4", None):
            engine.generate([prompt], params, lora_name=name)  # ... and back in L1 too
        a4 = engine.adapters.resolve("a4").identity

        def held(identity):
            return sum(
                len(n.device or ()) + len(n.host or ())
                for n in engine.ctl.tree.iter_nodes()
                if namespace_adapter(n.namespace) == identity
            )

        before = {k: held(k) for k in (a4, engine.adapters.resolve("a8rs").identity, None)}
        assert all(v > 0 for v in before.values())
        with pytest.raises(InvalidRequestError, match="tier 'all'"):
            engine.flush_cache("device", lora_name="a4")
        engine.flush_cache("all", lora_name="a4")
        after = {k: held(k) for k in before}
        assert after[a4] == 0
        assert {k: v for k, v in after.items() if k != a4} == {k: v for k, v in before.items() if k != a4}
        engine.check_accounting()
        out = engine.generate([prompt], params, lora_name="a4")[0]
        assert out.num_cached_tokens == 0  # recomputed
    finally:
        engine.shutdown()


def test_reader_refuses_an_unknown_target_module(gqa, tmp_path):
    root, base, _ = gqa
    config = load_model(str(root / "base")).config
    save_random_adapter(base, tmp_path / "head", 4, 8, False, ["q_proj", "lm_head"], 5)
    with pytest.raises(AdapterError, match=r"lm_head.*is not a LoRA weight of a decoder layer's linear"):
        load_peft_adapter("head", tmp_path / "head", config, max_rank=16)


def _copy_adapter(src, dst, config_change=None):
    shutil.copytree(src, dst)
    if config_change:
        spec = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(spec | config_change))
    return dst


def _rewrite_tensors(folder, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    save_file(change(dict(tensors)), folder / "adapter_model.safetensors")


@pytest.mark.parametrize(
    ("r", "alpha", "message"),
    [
        (0.5, 8, r"r=0.5 must be a positive integer"),
        ("8", 8, r"r='8' must be a positive integer"),
        (float("inf"), 8, r"r=inf must be a positive integer"),
        (4, float("nan"), r"lora_alpha=nan must be a positive finite number"),
    ],
)
def test_reader_refuses_bad_rank_and_alpha_values(gqa, tmp_path, r, alpha, message):
    root, _, _ = gqa
    config = load_model(str(root / "base")).config
    folder = _copy_adapter(root / "a4", tmp_path / "ad", {"r": r, "lora_alpha": alpha})
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter("ad", folder, config, max_rank=16)


def test_reader_refuses_bad_tensors(gqa, tmp_path):
    root, _, _ = gqa
    config = load_model(str(root / "base")).config

    def poison(t):
        key = next(k for k in t if "lora_B" in k)
        t[key] = t[key].copy()
        t[key][0, 0] = np.nan
        return t

    def duplicate(t):
        key = next(k for k in t if "lora_A" in k)
        t[key.replace("lora_A.weight", "lora_A.other.weight")] = t[key]
        return t

    def regroup(t):
        key = next(k for k in t if "self_attn.q_proj.lora_A" in k)
        t[key.replace("self_attn.q_proj", "mlp.q_proj")] = t.pop(key)
        return t

    for name, change, message in (
        ("nan", poison, "holds NaN or infinite values"),
        ("dup", duplicate, "two lora_A tensors for layer"),
        ("group", regroup, "mlp.q_proj"),
    ):
        folder = _copy_adapter(root / "a4", tmp_path / name)
        _rewrite_tensors(folder, change)
        with pytest.raises(AdapterError, match=message):
            load_peft_adapter(name, folder, config, max_rank=16)
    broken = _copy_adapter(root / "a4", tmp_path / "header")
    header = b"[1, 2]"
    (broken / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(AdapterError, match="adapter_model.safetensors"):
        load_peft_adapter("h", broken, config, max_rank=16)
    (broken / "adapter_config.json").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(AdapterError, match="cannot be read as JSON"):
        load_peft_adapter("h", broken, config, max_rank=16)


def test_an_adapter_that_overflows_is_refused_and_leaves_its_slot_free(gqa, tmp_path):
    root, _, _ = gqa
    huge = _copy_adapter(root / "a4", tmp_path / "huge", {"lora_alpha": 1e300})  # scaling * B overflows float32
    engine = _engine(root, tmp_path / "l3", adapters=(), max_loras=1, tiers="L1")
    try:
        with pytest.raises(AdapterError, match="is not finite in float32"):
            engine.load_lora_adapter("huge", str(huge))
        assert engine.adapters.listing() == [] and engine.runner.lora.holds == [None]
        engine.load_lora_adapter("a4", str(root / "a4"))  # the one slot is still free
        out = engine.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=2), lora_name="a4")[0]
        assert len(out.token_ids) == 2
    finally:
        engine.shutdown()
