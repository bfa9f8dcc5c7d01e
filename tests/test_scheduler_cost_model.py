"""CostModel (no jax): priors, online least-squares fit, bandwidth tracking, loading-bound predicate."""

from __future__ import annotations

import random

import pytest

from strata_jax.scheduler import CostModel, CostPrior


def test_priors_are_sane_before_any_measurement() -> None:
    m = CostModel()
    assert m.load_seconds(0) == 0.0
    assert 0 < m.load_seconds(1000) < m.load_seconds(2000)
    assert m.load_seconds(0, 1000) > m.load_seconds(1000)  # storage is slower than the host link
    assert 0 < m.extend_seconds(1000) < m.extend_seconds(2000)
    assert m.extend_seconds(1000, context_tokens=30_000) > m.extend_seconds(1000)  # long context costs
    assert m.decode_seconds(0, 0) == 0.0 and 0 < m.decode_seconds(8, 1000) < m.decode_seconds(64, 100_000)
    assert 1 < m.derived_loading_bound_ratio() < 1000


def test_extend_model_recovers_the_runners_timing_online() -> None:
    rng = random.Random(0)
    a, b, c = 2e-3, 1e-4, 5e-9
    m = CostModel()
    for _ in range(64):
        items = [(rng.randint(16, 2000), rng.randint(0, 30_000)) for _ in range(rng.randint(1, 4))]
        t = a + sum(b * n + c * n * (ctx + n / 2) for n, ctx in items)
        m.observe_extend(items, t * rng.uniform(0.98, 1.02))
    for n, ctx in ((100, 0), (2000, 0), (500, 20_000)):
        true = a + b * n + c * n * (ctx + n / 2)
        assert m.extend_seconds(n, ctx) == pytest.approx(true, rel=0.1)


def test_fit_stays_non_negative_and_ignores_bogus_timings() -> None:
    m = CostModel()
    m.observe_extend([(100, 0)], float("nan"))
    m.observe_extend([(100, 0)], -1.0)
    assert m.extend_coeffs == CostPrior().extend_coeffs
    for n in (100, 200, 400, 800):
        m.observe_extend([(n, 0)], 0.01)  # flat timing: the per-token term must not go negative
    assert all(coef >= 0 for coef in m.extend_coeffs)
    assert m.extend_seconds(800) == pytest.approx(0.01, rel=0.2)


def test_beyond_the_observed_steps_the_fit_never_predicts_below_the_prior() -> None:
    """A cache-warm server prefills a page or two at a time: fitted on those, the per-token
    cost is lost in the fixed overhead.  A 2,500-token recompute is beyond anything seen, so
    it is at least the prior's (an L3 prefetch was given up on a 0.1 s estimate of 3.5 s)."""
    prior = CostPrior(extend_coeffs=(5e-3, 1.2e-3, 1e-9))
    m = CostModel(prior)
    rng = random.Random(1)
    for _ in range(64):
        n, ctx = rng.randint(3, 30), rng.randint(0, 3000)
        m.observe_extend([(n, ctx)], 0.05 + rng.uniform(-0.005, 0.005))  # overhead-bound, tokens invisible
    fitted = sum(coef * x for coef, x in zip(m.extend_coeffs, (1.0, 2500.0, 2500.0 * 1250.0)))
    assert fitted < 0.5  # the premise: extrapolated, the fit says next to nothing
    prior_says = 5e-3 + 1.2e-3 * 2500 + 1e-9 * 2500 * 1250
    assert m.extend_seconds(2500) == pytest.approx(prior_says)
    assert m.extend_seconds(20, 100) == pytest.approx(0.05, rel=0.2)  # inside what it saw: the fit


def test_decode_model_fits_measurements() -> None:
    m = CostModel()
    for batch in (1, 8, 32, 64, 128):
        for ctx in (1_000, 50_000, 200_000):
            m.observe_decode(batch, ctx, 0.005 + 1e-5 * batch + 2e-8 * ctx)
    assert m.decode_seconds(16, 100_000) == pytest.approx(0.005 + 1.6e-4 + 2e-3, rel=0.05)


def test_bandwidth_follows_measured_loads() -> None:
    m = CostModel(CostPrior(link_bytes_per_s=25e9, bytes_per_token=1000))
    for _ in range(30):
        m.observe_load(1_000_000, 1.0)  # 1 GB/s measured
    assert m.link_bytes_per_s == pytest.approx(1e9, rel=0.01)
    assert m.load_seconds(1_000_000) == pytest.approx(1.0, rel=0.01)
    m.observe_load(1000, 0.0)  # ignored
    with pytest.raises(ValueError):
        m.observe_load(10, 1.0, tier="tape")


def test_window_only_loads_count_the_bytes_they_move() -> None:
    """Gemma 3 270M's shape: 15 of 18 layers windowed (512 tokens).  A load of n tokens moves
    every token's 3 global layers and the 15 local layers of its last 512 tokens only."""
    per_layer = 100
    m = CostModel(
        CostPrior(bytes_per_token=18 * per_layer, link_bytes_per_s=1e6, local_share=15 / 18, local_window_tokens=512)
    )
    for n in (1, 100, 512, 513, 4096):
        moved = n * 3 * per_layer + min(n, 512) * 15 * per_layer
        assert m.load_bytes(n) == pytest.approx(moved)
        assert m.load_seconds(n) == pytest.approx(moved / 1e6)
        assert m.load_seconds(0, n) == pytest.approx(moved / 1e6 + n * 18 * per_layer / m.storage_bytes_per_s)
    for _ in range(40):  # a measured 4K load: the rate is in the bytes it moved, so a 1K load is not a quarter of it
        m.observe_load(4096, 0.5)
    rate = (4096 * 3 + 512 * 15) * per_layer / 0.5
    assert m.link_bytes_per_s == pytest.approx(rate, rel=1e-3)
    assert m.load_seconds(1024) == pytest.approx((1024 * 3 + 512 * 15) * per_layer / rate, rel=1e-3)
    with pytest.raises(ValueError):
        CostPrior(local_share=0.5)  # a share without its window


def test_loading_bound_predicate_in_both_modes() -> None:
    m = CostModel(CostPrior(bytes_per_token=131072, link_bytes_per_s=25e9))
    assert not m.would_be_loading_bound(0, 0, [(10, 0)])
    # fixed ratio: tokens loaded per token computed
    assert m.would_be_loading_bound(1000, 0, [(5, 0), (4, 0)], ratio=100.0)
    assert not m.would_be_loading_bound(1000, 0, [(10, 0)], ratio=100.0)
    assert m.would_be_loading_bound(1, 0, [], ratio=100.0)
    # derived: time to load vs time to compute
    load_heavy = m.would_be_loading_bound(20_000, 0, [(50, 0)])
    compute_heavy = m.would_be_loading_bound(200, 0, [(4000, 0)])
    assert load_heavy and not compute_heavy
    # a slower link makes the same batch loading-bound
    slow = CostModel(CostPrior(link_bytes_per_s=1e8))
    assert slow.would_be_loading_bound(200, 0, [(4000, 0)])


def test_one_measurement_moves_the_estimate_without_wild_extrapolation() -> None:
    m = CostModel()
    m.observe_extend([(1000, 0)], 0.05)
    assert m.extend_seconds(1000) == pytest.approx(0.05, rel=0.05)
    assert 0 < m.extend_seconds(10) < m.extend_seconds(1000) < m.extend_seconds(4000)
    assert all(coef >= 0 for coef in m.extend_coeffs)
