"""The simulator's sliding-window model: window-aware load bytes, windowed attention FLOPs
and window-aware tier capacity against a page-by-page / pair-by-pair / byte-by-byte count,
and ``--loads full`` moving every layer's pages and sizing the tiers at full width."""

from __future__ import annotations

import math

import pytest

from strata_jax.sim.cost import SimCostModel
from strata_jax.sim.model_spec import load_model_spec
from strata_jax.sim.profile import load_profile


def pages_a_layer_needs(window: int, num_pages: int, page_size: int) -> int:
    """Brute force: the pages holding positions [end - window, end) for a reuse starting at
    any offset inside the last page, the most over those offsets."""
    if window <= 0:
        return num_pages
    most = 0
    for last_page_fill in range(1, page_size + 1):
        end = (num_pages - 1) * page_size + last_page_fill
        first = max(0, end - window)
        most = max(most, (end - 1) // page_size - first // page_size + 1)
    return most


def test_gemma_3_27b_spec_and_load_share_match_a_page_count():
    spec = load_model_spec("gemma-3-27b")
    windows = spec.config.layer_windows
    assert len(windows) == 62 and windows.count(0) == 10 and set(windows) == {0, 1024}
    assert 26.9e9 < spec.config.num_parameters < 27.1e9
    for page_size in (16, 32):
        for num_pages in (1, 5, 33, 34, 100, 700):
            want = sum(pages_a_layer_needs(w, num_pages, page_size) for w in windows) / (num_pages * 62)
            got = spec.load_share(num_pages, page_size)
            assert want <= got <= want + 62 / (num_pages * 62)  # the spec may count one spare page per layer
    # the figure: a ~22K-token document reused moves about a fifth of the bytes
    assert 0.19 < spec.load_share(22000 // 32, 32) < 0.22
    assert load_model_spec("llama-3.1-8b").load_share(700, 32) == 1.0


def test_windowed_attention_pairs_match_a_pair_count():
    spec = load_model_spec("gemma-3-27b")
    for new, ctx in ((1, 0), (40, 5000), (512, 512), (3000, 0), (16, 20000)):
        per_layer = []
        for w in spec.config.layer_windows:
            pairs = 0
            for i in range(new):
                keys = ctx + i + 1
                pairs += keys if w <= 0 else min(keys, w)
            per_layer.append(pairs)
        want = sum(per_layer) / len(per_layer)
        assert math.isclose(spec.attention_pairs(new, ctx), want, rel_tol=0.02, abs_tol=new)


def test_window_loads_move_fewer_bytes_only_when_asked():
    spec, profile = load_model_spec("gemma-3-27b"), load_profile("h200")
    full = SimCostModel(profile, spec, 32)
    window = SimCostModel(profile, spec, 32, window_loads=True)
    for path in ("coalesced", "naive"):
        assert window.link_seconds(700, path) < 0.3 * full.link_seconds(700, path)
        assert window.link_seconds(10, path) == pytest.approx(full.link_seconds(10, path))  # inside every window
    assert window.storage_read_seconds(700) < 0.3 * full.storage_read_seconds(700)
    # the engine's L3 objects hold every layer: its storage reads move whole pages, its loads the windows
    engine_like = SimCostModel(profile, spec, 32, window_loads=True, storage_window_reads=False)
    assert engine_like.storage_read_seconds(700) == pytest.approx(full.storage_read_seconds(700))
    assert engine_like.link_seconds(700, "coalesced") == pytest.approx(window.link_seconds(700, "coalesced"))
    llama = load_model_spec("llama-3.1-8b")
    assert SimCostModel(profile, llama, 32, window_loads=True).link_seconds(700, "coalesced") == pytest.approx(
        SimCostModel(profile, llama, 32).link_seconds(700, "coalesced")
    )


def test_simulate_cli_loads_option(capsys):
    from strata_jax.cli import main

    base = [
        "simulate",
        "--workload",
        "sharegpt",
        "--systems",
        "strata",
        "--rates",
        "2",
        "--num-requests",
        "20",
        "--no-progress",
    ]
    assert main([*base, "--model", "gemma-3-27b", "--loads", "full,window"]) == 0
    out = capsys.readouterr().out
    assert "strata[full]" in out and "strata[window]" in out
    assert main([*base, "--model", "llama-3.1-8b", "--loads", "window"]) == 2
    assert "needs a model with sliding-window layers" in capsys.readouterr().err
    assert main([*base, "--loads", "full,window", "--kv-tier-format", "full,fp8"]) == 2


# Gemma 3 27B by hand: 62 layers (10 global, 52 with a 1,024-token window), 16 KV heads of
# 128, bf16 K and V: bytes of one layer's K and V for one token.
GEMMA_LAYER_TOKEN_BYTES = 2 * 16 * 128 * 2
GEMMA_TOKEN_BYTES = 62 * GEMMA_LAYER_TOKEN_BYTES  # 507,904 (the "508 KB" of docs/study.md)


def window_tier_bytes(sequence_tokens, page_size=32):
    """What a window-aware tier holds for cached sequences of these lengths, counted layer by
    layer: every full page of a global layer; of a windowed layer, the 1,024 / page_size pages
    before the sequence's end plus one (a window may start mid-page), at most all of them."""
    page = page_size * GEMMA_LAYER_TOKEN_BYTES
    held = full = 0
    for tokens in sequence_tokens:
        pages = tokens // page_size
        held += 10 * pages * page + 52 * min(pages, 1024 // page_size + 1) * page
        full += 62 * pages * page
    return held, full


def test_cached_share_matches_a_byte_count():
    spec = load_model_spec("gemma-3-27b")
    for lengths in ([22_000], [13_000, 32_000, 22_000], [500, 1_056, 1_100, 40_000], [31, 64]):
        held, full = window_tier_bytes(lengths)
        assert spec.cached_share(lengths, 32) == pytest.approx(held / full)
    # a 22K-token LooGLE document: 687 pages, of which 10/62 of every page + 52/62 of 33 pages
    assert spec.cached_share([22_000], 32) == pytest.approx((10 * 687 + 52 * 33) / (62 * 687))
    assert spec.cached_share([800, 1_000], 32) == 1.0  # inside every window: all of it is kept
    assert spec.cached_share([10], 32) == 1.0  # no full page: nothing cached
    assert load_model_spec("llama-3.1-8b").cached_share([22_000, 40_000], 32) == 1.0


def test_window_capacity_sizes_l1_and_l2_by_the_bytes_held():
    spec, profile = load_model_spec("gemma-3-27b"), load_profile("h200")
    assert spec.kv_bytes_per_token == GEMMA_TOKEN_BYTES
    free = 141e9 * 0.85 - spec.config.num_parameters * 2  # HBM for KV after the bf16 weights
    for share in (1.0, 0.5, 0.204):
        cost = SimCostModel(profile, spec, 32, window_loads=True, cached_share=share)
        assert abs(cost.device_kv_tokens() - free / (GEMMA_TOKEN_BYTES * share)) <= 1
        assert abs(cost.host_kv_tokens() - 1.0e12 / (GEMMA_TOKEN_BYTES * share)) <= 1
    fp8 = SimCostModel(profile, spec, 32, "fp8", window_loads=True, cached_share=0.5)
    fp8_token = 62 * 2 * 16 * (32 * 128 + 4) / 32  # 1 byte per value, a float32 scale per page, layer, K/V, head
    assert abs(fp8.host_kv_tokens() - 1.0e12 / (fp8_token * 0.5)) <= 1
    with pytest.raises(ValueError, match="cached_share"):
        SimCostModel(profile, spec, 32, cached_share=0.0)


def test_full_loads_keep_the_full_width_capacity():
    """``--loads full``: no share, the tiers sized at full width (the study's 129,613 / 1,968,876 tokens)."""
    spec, profile = load_model_spec("gemma-3-27b"), load_profile("h200")
    default = SimCostModel(profile, spec, 32)
    assert default.cached_share == 1.0
    assert (
        default.device_kv_tokens()
        == int((141e9 * 0.85 - spec.config.num_parameters * 2) // GEMMA_TOKEN_BYTES)
        == 129_613
    )
    assert default.host_kv_tokens() == int(1.0e12 // GEMMA_TOKEN_BYTES) == 1_968_876
    assert (
        SimCostModel(profile, spec, 32, window_loads=True).device_kv_tokens() == 129_613
    )  # loads alone change no capacity


def test_cached_sequences_of_each_workload():
    from strata_jax.sim import workloads as W

    chats = W.sharegpt(num_requests=30, rate=1.0, seed=0)
    assert W.cached_sequence_tokens(chats) == [len(r.prompt) + r.output_len for r in chats]
    turns = W.multiturn(num_requests=12, rate=1.0, seed=0, rounds=3, request_length=100, output_len=20)
    assert W.cached_sequence_tokens(turns) == [3 * (100 + 20)] * 4  # 4 conversations of 3 turns
    try:
        data = W.find_data_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"needs the shared data beside the repository ({exc})")
    docs = W.loogle(num_requests=60, rate=1.0, seed=0, data_dir=data, docs=12, warmup=True)
    warm = [r for r in docs if r.warmup]  # one per document: the document alone
    assert sorted(W.cached_sequence_tokens(docs)) == sorted(len(r.prompt) for r in warm)
    cold = [r for r in docs if not r.warmup]  # the questions' shared prefix is the document too
    asked = {r.group for r in cold if sum(q.group == r.group for q in cold) > 1}
    assert sorted(W.cached_sequence_tokens([r for r in cold if r.group in asked])) == sorted(
        len(r.prompt) for r in warm if r.group in asked
    )


def test_a_window_run_sizes_its_tiers_from_the_workload():
    """``simulate`` with window loads derives the share from the requests' cached sequences
    and gives the controller that many more pages; without, the full-width sizes."""
    from strata_jax.sim import workloads as W
    from strata_jax.sim.runner import SimSetup, simulate
    from strata_jax.sim.systems import get_system

    spec, profile = load_model_spec("gemma-3-27b"), load_profile("h200")
    reqs, start = [], 1
    for i, n in enumerate((3_000, 700, 5_000, 1_500, 40, 2_100) * 2):  # some past the window, some inside it
        reqs.append(W.SimRequest(list(range(start, start + n)), 16, arrival_s=0.25 * i))
        start += n
    held, full = window_tier_bytes([len(r.prompt) + r.output_len for r in reqs])
    share = held / full
    assert share < 1.0  # some chats run past the window
    free = 141e9 * 0.85 - spec.config.num_parameters * 2
    window = simulate(reqs, get_system("strata"), SimSetup(spec, profile, window_loads=True), 4.0)
    assert window.finished == 12
    assert window.extra["cached_share"] == pytest.approx(share)
    assert window.extra["l1_tokens"] == int(free / (GEMMA_TOKEN_BYTES * share)) // 32 * 32
    assert window.extra["l2_tokens"] == int(1.0e12 / (GEMMA_TOKEN_BYTES * share)) // 32 * 32
    plain = simulate(reqs, get_system("strata"), SimSetup(spec, profile), 4.0)
    assert plain.extra["cached_share"] == 1.0
    assert (plain.extra["l1_tokens"], plain.extra["l2_tokens"]) == (129_613 // 32 * 32, 1_968_876 // 32 * 32)
    given = simulate(reqs, get_system("strata"), SimSetup(spec, profile, window_loads=True, host_tokens=64_000), 4.0)
    assert given.extra["l2_tokens"] == 64_000  # an explicit size is taken as given
