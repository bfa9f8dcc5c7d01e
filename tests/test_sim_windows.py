"""The simulator's sliding-window model (issue 22, item 5 in part): window-aware load
bytes and windowed attention FLOPs against a page-by-page / pair-by-pair count."""

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
    llama = load_model_spec("llama-3.1-8b")
    assert SimCostModel(profile, llama, 32, window_loads=True).link_seconds(700, "coalesced") == pytest.approx(
        SimCostModel(profile, llama, 32).link_seconds(700, "coalesced")
    )


def test_simulate_cli_loads_option(capsys):
    from strata_jax.cli import main

    base = ["simulate", "--workload", "sharegpt", "--systems", "strata", "--rates", "2", "--num-requests", "20", "--no-progress"]
    assert main([*base, "--model", "gemma-3-27b", "--loads", "full,window"]) == 0
    out = capsys.readouterr().out
    assert "strata[full]" in out and "strata[window]" in out
    assert main([*base, "--model", "llama-3.1-8b", "--loads", "window"]) == 2
    assert "needs a model with sliding-window layers" in capsys.readouterr().err
    assert main([*base, "--loads", "full,window", "--kv-tier-format", "full,fp8"]) == 2
