"""Prefill/decode handoff through a shared L3 between two engines (``Engine.handoff_wait``):
the decode engine waits for the prompt's pages a prefill engine writes, reads them from L3,
and generates the tokens one engine alone generates; with no prefill engine it falls back to
computing the prompt after the deadline, with the same tokens."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.engine.handoff import HandoffPolicy

PAGE = 16


def _engine(storage, **overrides) -> Engine:
    settings = dict(
        model="tiny",
        warmup=False,
        show_progress=False,
        page_size=PAGE,
        device_tokens=4096,
        tiers="L1+L2+L3",
        storage_dir=str(storage),
    )
    return Engine(EngineConfig(**{**settings, **overrides}))


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _until_done(wait) -> object:
    while (result := wait.poll()) is None:
        time.sleep(wait.poll_s)
    return result


@pytest.fixture
def start_engine():
    """``start_engine(storage, **overrides)``: an engine this test uses, shut down when it ends."""
    started: list[Engine] = []

    def start(storage, **overrides) -> Engine:
        started.append(_engine(storage, **overrides))
        return started[-1]

    yield start
    for engine in started:
        engine.shutdown()


def _hand_over(prefill: Engine, decode: Engine, prompt: list[int], pages: int) -> None:
    """The router's two requests: the decode engine waits for the pages the prefill engine
    computes, and every one of the prompt's ``pages`` full pages landed in L3."""
    wait = decode.handoff_wait(prompt)  # before the prefill engine has the request: as a router sends both
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    result = _until_done(wait)
    assert result.outcome == "complete" and result.landed_pages == pages


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    storage = tmp_path_factory.mktemp("l3")
    alone = _engine(tmp_path_factory.mktemp("alone"))
    prefill, decode = _engine(storage), _engine(storage)
    yield alone, prefill, decode
    for e in (alone, prefill, decode):
        e.shutdown()


def test_decode_waits_for_the_prefill_engines_pages_and_reads_them_from_l3(fleet):
    alone, prefill, decode = fleet
    prompt = _prompt(0, 23 * PAGE + 5)  # 23 full pages and a partial one
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = alone.generate([prompt], params)[0].token_ids

    wait = decode.handoff_wait(prompt)  # before the prefill engine has the request: as a router sends both
    assert wait.wanted_pages == 23 and wait.poll() is None
    worker = threading.Thread(target=lambda: prefill.generate([prompt], SamplingParams(max_tokens=1)))
    worker.start()
    result = _until_done(wait)
    worker.join()
    assert result.outcome == "complete" and result.landed_pages == 23
    out = decode.generate([prompt], params)[0]
    assert out.token_ids == want
    assert out.cached_tokens["storage"] == 23 * PAGE  # every full page from L3; the partial one computed
    assert decode.check_accounting()["live_requests"] == 0


def test_without_a_prefill_engine_the_deadline_passes_and_the_prompt_is_computed(fleet):
    alone, _prefill, decode = fleet
    prompt = _prompt(1, 10 * PAGE)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = alone.generate([prompt], params)[0].token_ids
    policy = HandoffPolicy(base_s=0.2, prefill_factor=0.0, stall_s=0.1)
    t0 = time.monotonic()
    result = _until_done(decode.handoff_wait(prompt, policy=policy))
    assert result.outcome == "deadline" and result.fell_back and result.landed_pages == 0
    assert 0.2 <= time.monotonic() - t0 < 5.0
    out = decode.generate([prompt], params)[0]
    assert out.token_ids == want and out.cached_tokens["storage"] == 0


def test_a_short_prompt_is_computed_at_once_a_long_one_waited_for(fleet):
    """``HandoffPolicy.local_tokens``: a prompt with at most that many tokens not in L3 is not
    waited for (``local``); one page more is; a prompt whose full pages all landed is
    ``complete`` though only its partial page is left to compute."""
    alone, prefill, decode = fleet
    short = _prompt(11, 3 * PAGE + 7)  # 55 tokens, none in L3
    policy = HandoffPolicy(base_s=5.0, local_tokens=55)
    result = decode.handoff_wait(short, policy=policy).poll()
    assert result is not None and result.outcome == "local" and result.landed_pages == 0
    assert decode.handoff_wait(short, policy=HandoffPolicy(base_s=5.0, local_tokens=54)).poll() is None
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert decode.generate([short], params)[0].token_ids == alone.generate([short], params)[0].token_ids
    landed = _prompt(12, 4 * PAGE + 3)
    prefill.generate([landed], SamplingParams(max_tokens=1))
    assert _until_done(decode.handoff_wait(landed, policy=HandoffPolicy(local_tokens=0))).outcome == "complete"
    result = decode.handoff_wait(landed, policy=HandoffPolicy(local_tokens=1000)).poll()  # the 4 pages are in L3 now
    assert result is not None and result.outcome == "complete" and result.landed_pages == 4


def test_pages_under_another_salt_are_not_the_prompts(fleet):
    _alone, prefill, decode = fleet
    prompt = _prompt(2, 6 * PAGE)
    prefill.generate([prompt], SamplingParams(max_tokens=1), cache_salt="tenant-a")
    policy = HandoffPolicy(base_s=0.2, prefill_factor=0.0)
    assert _until_done(decode.handoff_wait(prompt, cache_salt="tenant-a", policy=policy)).outcome == "complete"
    assert _until_done(decode.handoff_wait(prompt, cache_salt="tenant-b", policy=policy)).outcome == "deadline"
    assert _until_done(decode.handoff_wait(prompt, policy=policy)).outcome == "deadline"


def test_a_handoff_needs_l3_and_a_valid_prompt(fleet, tmp_path, start_engine):
    _alone, _prefill, decode = fleet
    with pytest.raises(InvalidRequestError, match="vocab|token"):
        decode.handoff_wait([10**9])
    with pytest.raises(InvalidRequestError, match="L3"):
        start_engine(tmp_path, tiers="L1+L2").handoff_wait([1, 2, 3])


def _l3_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_an_int8_l3_hands_over_a_quarter_of_the_bytes_and_the_tokens_of_its_pages(tmp_path, start_engine):
    """With ``kv_tier_format="int8"`` the prefill engine writes int8 pages (about a quarter of
    float32's bytes) and the decode engine's tokens are those of any engine reading the same
    int8 pages back from L3 (a quantized tier is close to, not equal to, full width)."""
    prompt = _prompt(4, 20 * PAGE + 3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    full_l3, int8_l3, lone_l3 = tmp_path / "full", tmp_path / "int8", tmp_path / "lone"
    start_engine(full_l3).generate([prompt], SamplingParams(max_tokens=1))
    lone = start_engine(lone_l3, kv_tier_format="int8")
    lone.generate([prompt], SamplingParams(max_tokens=1))
    lone.flush_cache("device")
    lone.flush_cache("host")
    want = lone.generate([prompt], params)[0]
    assert want.cached_tokens["storage"] == 20 * PAGE  # its own int8 pages, read back
    decode = start_engine(int8_l3, kv_tier_format="int8")
    _hand_over(start_engine(int8_l3, kv_tier_format="int8"), decode, prompt, 20)
    got = decode.generate([prompt], params)[0]
    assert got.cached_tokens["storage"] == 20 * PAGE and got.token_ids == want.token_ids
    assert _l3_bytes(int8_l3) < 0.35 * _l3_bytes(full_l3)  # int8 + a scale per (page, layer, K/V, head)


def test_a_sliding_window_model_hands_over_its_global_layers_and_windows(tmp_path, start_engine):
    """Gemma 3's layout (random weights: 3 of 4 layers local, window 16) with window-aware
    tiers (``kv_layer_groups``, a local pool trimmed to a tenth): the decode engine reads the
    prompt from the prefill engine's L3 pages, loads the local layers' KV of the window only
    (the global layers' of every page), and generates the tokens of a plain engine (layer-first
    pool, no L3) computing the prompt itself."""
    from hf_reference import make_hf_model

    make_hf_model("gemma3", tmp_path / "model", vocab_size=256)
    model = str(tmp_path / "model")
    prompt = _prompt(5, 10 * PAGE + 7)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    windowed = dict(
        model=model,
        kv_layer_groups=True,
        kv_local_ratio=0.1,
        prefetch_policy="wait_complete",
        max_batch_tokens=64,
        prefetch_min_tokens=0,
    )
    want = start_engine(tmp_path / "plain", model=model, tiers="L1+L2").generate([prompt], params)[0].token_ids
    decode = start_engine(tmp_path / "l3", **windowed)
    _hand_over(
        start_engine(tmp_path / "l3", **windowed, publish_prefill_chunks=True), decode, prompt, 10
    )  # as --role prefill
    got = decode.generate([prompt], params)[0]
    assert got.token_ids == want
    assert got.cached_tokens["storage"] == 10 * PAGE
    moved = decode.ctl.bytes_per_token()
    # 1 of 4 layers global (every page), the 3 local ones only for the window's page of 10
    full = moved["device_bytes_per_token"]
    assert moved["load_bytes_per_token"] == pytest.approx(full * (1 / 4 + 3 / 4 * 1 / 10)), moved
    assert decode.check_accounting()["live_requests"] == 0


def test_a_prefill_engine_publishing_chunks_lands_its_pages_as_it_goes(tmp_path, start_engine):
    """``publish_prefill_chunks`` (what ``--role prefill`` runs): each chunk's full pages reach
    L3 while the prompt's later chunks are still computing, and the decode engine reading them
    generates a lone engine's tokens."""
    prompt = _prompt(6, 40 * PAGE + 3)  # 40 full pages, prefilled 4 pages per step
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = start_engine(tmp_path / "alone", tiers="L1+L2", max_batch_tokens=64).generate([prompt], params)[0].token_ids
    prefill = start_engine(tmp_path / "l3", publish_prefill_chunks=True, max_batch_tokens=64)
    decode = start_engine(tmp_path / "l3")
    wait = decode.handoff_wait(prompt)
    worker = threading.Thread(target=lambda: prefill.generate([prompt], SamplingParams(max_tokens=1)))
    worker.start()
    seen = []
    while worker.is_alive():
        seen.append(decode.handoff_wait(prompt).present_pages)  # a fresh probe of L3 each time
    worker.join()
    assert any(0 < n < 40 for n in seen), sorted(set(seen))  # pages landed before the prefill ended
    result = _until_done(wait)
    assert result.outcome == "complete" and result.landed_pages == 40
    got = decode.generate([prompt], params)[0]
    assert got.token_ids == want and got.cached_tokens["storage"] == 40 * PAGE
    assert prefill.check_accounting()["live_requests"] == 0


def test_publishing_chunks_keeps_every_token_and_page(tmp_path, start_engine):
    """Requests sharing a document's beginning, prefilled in chunks at once and after, give the
    same tokens with ``publish_prefill_chunks`` as without, and the page accounting holds."""
    doc = _prompt(7, 30 * PAGE)
    prompts = [doc + _prompt(8 + i, 2 * PAGE + i) for i in range(3)] + [doc[: 17 * PAGE + 5]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for publish in (False, True):
        engine = start_engine(tmp_path / f"l3-{publish}", publish_prefill_chunks=publish, max_batch_tokens=64)
        first = engine.generate(prompts[:2], params)  # both prefilled at once, sharing the document
        later = engine.generate(prompts[2:], params)  # after: the document's pages from the tree
        outs[publish] = [o.token_ids for o in first + later]
        assert later[0].cached_tokens["device"] >= 30 * PAGE
        accounting = engine.check_accounting()
        assert accounting["live_requests"] == 0 and accounting["locked_nodes"] == 0
    assert outs[True] == outs[False]


def test_publishing_chunks_gives_the_same_tokens_from_every_tier(tmp_path):
    """The tier parity check (cold, then the prefix from L1, L2 and L3, prefilled in chunks of
    64 tokens) with ``publish_prefill_chunks``: the tokens and hits of the default engine."""
    from test_engine_kernels import assert_tiers_agree, tier_tokens

    default = tier_tokens("xla", str(tmp_path / "kv0"))
    published = tier_tokens("xla", str(tmp_path / "kv1"), publish_prefill_chunks=True)
    assert_tiers_agree(published["tiers"], default["tiers"]["cold"][0])
    assert {t: hits for t, (_, hits) in published["tiers"].items()} == {
        t: hits for t, (_, hits) in default["tiers"].items()
    }
