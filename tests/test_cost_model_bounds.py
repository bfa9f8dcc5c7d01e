"""Every estimate of the cost model stays finite and non-negative, whatever it is told.

The scheduler divides by the learned rates and compares the learned times every
round; a measured zero (every L3 read failed) once raised ZeroDivisionError inside
``schedule`` and failed every request of the server.  Hypothesis drives the model with
arbitrary sequences of observations, NaN, infinities, zeros and negatives included.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.scheduler.cost_model import MAX_STEP_SECONDS, RATE_BOUND_FACTOR, CostModel, CostPrior, bounded_rate

any_float = st.floats(allow_nan=True, allow_infinity=True)
tokens = st.integers(min_value=-4, max_value=1 << 22)
counts = st.integers(min_value=0, max_value=1 << 22)
extend_items = st.lists(st.tuples(counts, counts), max_size=6)

observation = st.one_of(
    st.tuples(st.just("load"), tokens, any_float, st.sampled_from(["host", "storage"])),
    st.tuples(st.just("extend"), extend_items, any_float),
    st.tuples(st.just("decode"), st.integers(min_value=-2, max_value=4096), counts, any_float),
    st.tuples(st.just("storage_rate"), any_float),
)

priors = st.sampled_from(
    [
        CostPrior(),
        CostPrior(bytes_per_token=64, link_bytes_per_s=1.0, storage_bytes_per_s=1e-3),  # tiny rates
        CostPrior(
            local_share=0.8, local_window_tokens=512, extend_coeffs=(0.0, 0.0, 0.0), decode_coeffs=(0.0, 0.0, 0.0)
        ),
    ]
)


def _apply(model: CostModel, obs: tuple) -> None:
    kind = obs[0]
    if kind == "load":
        model.observe_load(obs[1], obs[2], tier=obs[3])
    elif kind == "extend":
        model.observe_extend(obs[1], obs[2])
    elif kind == "decode":
        model.observe_decode(obs[1], obs[2], obs[3])
    else:
        model.set_storage_rate(obs[1])


def _finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _check_estimates(model: CostModel) -> None:
    p = model.prior
    assert p.link_bytes_per_s / RATE_BOUND_FACTOR <= model.link_bytes_per_s <= p.link_bytes_per_s * RATE_BOUND_FACTOR
    assert (
        p.storage_bytes_per_s / RATE_BOUND_FACTOR
        <= model.storage_bytes_per_s
        <= p.storage_bytes_per_s * RATE_BOUND_FACTOR
    )
    for coeff in model.extend_coeffs + model.decode_coeffs:
        assert _finite_non_negative(coeff)
    for host, storage in ((0, 0), (1, 0), (0, 1), (4096, 131072), (1 << 22, 1 << 22)):
        assert _finite_non_negative(model.load_seconds(host, storage))
        assert _finite_non_negative(model.storage_seconds(storage))
    for new, ctx in ((0, 0), (1, 0), (512, 131072), (1 << 20, 1 << 22)):
        assert _finite_non_negative(model.extend_seconds(new, ctx))
    assert _finite_non_negative(model.batch_extend_seconds([(512, 0), (16, 8192), (1, 1 << 20)]))
    for batch, ctx in ((0, 0), (1, 16), (256, 1 << 24)):
        assert _finite_non_negative(model.decode_seconds(batch, ctx))
    assert _finite_non_negative(model.derived_loading_bound_ratio(4096))


@settings(max_examples=300, deadline=None)
@given(prior=priors, observations=st.lists(observation, max_size=80))
def test_every_estimate_stays_finite_and_non_negative(prior: CostPrior, observations: list[tuple]) -> None:
    model = CostModel(prior)
    _check_estimates(model)
    for obs in observations:
        _apply(model, obs)
        _check_estimates(model)


@settings(max_examples=200, deadline=None)
@given(measured=any_float, prior=st.floats(min_value=1e-3, max_value=1e15))
def test_bounded_rate_against_a_plain_clamp(measured: float, prior: float) -> None:
    got = bounded_rate(measured, prior)
    if math.isnan(measured) or math.isinf(measured) or measured <= 0:
        assert got is None
    else:
        assert got == min(max(measured, prior / 1e4), prior * 1e4)


def test_a_measured_zero_storage_rate_keeps_the_prior() -> None:
    """The reported defect: every L3 read failed, the measured rate was 0, schedule() divided by it."""
    model = CostModel(
        CostPrior(bytes_per_token=1000, link_bytes_per_s=1e9, storage_bytes_per_s=1e8, transfer_overhead_s=0.0)
    )
    model.set_storage_rate(0.0)
    model.observe_load(1024, 0.0, tier="storage")
    assert model.storage_bytes_per_s == 1e8
    assert model.load_seconds(0, 1500) == 1500 * 1000 / 1e9 + 1500 * 1000 / 1e8


def test_a_real_measurement_still_moves_the_estimate() -> None:
    model = CostModel(CostPrior(bytes_per_token=1000, link_bytes_per_s=1e9, storage_bytes_per_s=1e8))
    model.set_storage_rate(2.5e8)
    assert model.storage_bytes_per_s == 2.5e8
    model.set_storage_rate(1e-9)  # far below any link: believed only down to the floor
    assert model.storage_bytes_per_s == 1e8 / RATE_BOUND_FACTOR


def test_step_times_out_of_range_are_not_measurements() -> None:
    model = CostModel()
    before = (model.extend_coeffs, model.decode_coeffs)
    for seconds in (float("nan"), float("inf"), -1.0, MAX_STEP_SECONDS * 2):
        model.observe_extend([(512, 0)], seconds)
        model.observe_decode(8, 4096, seconds)
    assert (model.extend_coeffs, model.decode_coeffs) == before
