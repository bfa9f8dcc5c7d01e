"""KV page transfer: Pallas (interpret mode), reference and naive baseline agree exactly.

Every pool slot nobody writes is NaN-poisoned first: a kernel that drops, misplaces
or reads unwritten memory produces NaNs where the reference has numbers (or the
reverse), and the exact, NaN-aware comparison fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.reference import gather_pages_reference, scatter_pages_reference
from pallas_kernels.transfer import (
    TransferShapeError,
    chunk_block,
    gather_pages_naive,
    gather_pages_pallas,
    scatter_pages_naive,
    scatter_pages_pallas,
)

PAGE_SIZES = (1, 8, 16, 64)
DTYPES = (jnp.float32, jnp.bfloat16)


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), equal_nan=True)


def _case(seed: int, page_size: int, dtype, *, layers=3, heads=2, dim=16, num_pages=23, n=9):
    rng = np.random.default_rng(seed)
    pool = jnp.full((layers, 2, num_pages, page_size, heads, dim), jnp.nan, dtype)
    staging = jnp.asarray(rng.standard_normal((n, layers, 2, page_size, heads, dim)), dtype)
    ids = rng.choice(num_pages, size=n, replace=False).astype(np.int32)
    ids[rng.integers(n)] = num_pages  # padding id: dropped
    return pool, staging, jnp.asarray(ids)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_scatter_interpret_equals_reference(page_size, dtype):
    pool, staging, ids = _case(page_size * 7 + len(jnp.dtype(dtype).name), page_size, dtype)
    got = scatter_pages_pallas(pool, staging, ids, interpret=True)
    want = scatter_pages_reference(pool, staging, ids)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _same(got, want)
    # Written pages hold data, the others are still NaN (not zeroed, not copied over).
    written = np.isin(np.arange(pool.shape[2]), np.asarray(ids))
    got32 = np.asarray(got, np.float32)
    assert not np.isnan(got32[:, :, written]).any()
    assert np.isnan(got32[:, :, ~written]).all()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gather_interpret_equals_reference(page_size, dtype):
    pool, staging, ids = _case(1000 + page_size, page_size, dtype)
    filled = scatter_pages_reference(pool, staging, ids)
    # Gather back the written pages and a few unwritten (NaN) ones, in shuffled order.
    rng = np.random.default_rng(page_size)
    read_ids = jnp.asarray(rng.permutation(np.arange(pool.shape[2]))[:11].astype(np.int32))
    got = gather_pages_pallas(filled, read_ids, interpret=True)
    assert _same(got, gather_pages_reference(filled, read_ids))
    # Round trip: what was scattered comes back bit-exact.
    valid = np.asarray(ids) < pool.shape[2]
    back = gather_pages_pallas(filled, ids[valid], interpret=True)
    assert _same(back, np.asarray(staging)[valid])


def test_negative_and_out_of_range_ids_match_reference():
    pool, staging, _ = _case(5, 4, jnp.float32, n=5)
    ids = jnp.asarray([3, -1, 23, -30, 0], jnp.int32)  # -1 -> last page; 23, -30 dropped
    assert _same(scatter_pages_pallas(pool, staging, ids, interpret=True), scatter_pages_reference(pool, staging, ids))
    filled = scatter_pages_reference(pool, staging, ids)
    read = jnp.asarray([-3, 0, 22, 40], jnp.int32)  # gather clips
    assert _same(gather_pages_pallas(filled, read, interpret=True), gather_pages_reference(filled, read))


@pytest.mark.parametrize("page_size", (1, 16))
def test_naive_baseline_equals_reference(page_size):
    pool, staging, ids = _case(77, page_size, jnp.float32)
    want = scatter_pages_reference(pool, staging, ids)
    got = scatter_pages_naive(jnp.array(pool), np.asarray(staging), np.asarray(ids))
    assert _same(got, want)
    assert _same(gather_pages_naive(want, np.asarray(ids)), gather_pages_reference(want, ids))


@pytest.mark.parametrize("backend", ("reference", "interpret"))
def test_donated_scatter_updates_pool_in_place(backend):
    pool, staging, ids = _case(3, 8, jnp.float32, num_pages=64)
    pool = jax.device_put(pool)
    before = pool.unsafe_buffer_pointer()
    step = jax.jit(lambda p, s, i: dispatch.scatter_pages(p, s, i, backend=backend), donate_argnums=0)
    out = step(pool, staging, ids)
    assert out.unsafe_buffer_pointer() == before, "scatter copied the donated pool"
    assert pool.is_deleted()


def test_chunk_block_is_a_power_of_two_divisor():
    for chunk in (1, 16, 1024, 8 * 128 * 64, 5 * 80, 3 * 7):
        block = chunk_block(chunk)
        assert chunk % block == 0 and block & (block - 1) == 0 and block <= 4096


def test_shape_errors_are_typed():
    pool, staging, ids = _case(1, 4, jnp.float32)
    with pytest.raises(TransferShapeError):
        scatter_pages_pallas(pool, staging[:, :2], ids, interpret=True)
    with pytest.raises(TransferShapeError):
        scatter_pages_pallas(pool, staging, ids[:3], interpret=True)
    with pytest.raises(TransferShapeError):
        gather_pages_pallas(pool, ids.astype(jnp.float32), interpret=True)


def test_gather_host_pages_equals_numpy_take():
    from pallas_kernels.transfer import gather_host_pages

    rng = np.random.default_rng(11)
    host = rng.standard_normal((40, 2, 2, 4, 2, 8)).astype(np.float32)
    ids = np.array([3, 4, 5, 9, 0, 1, 39, 38, 20, 21, 22, 23])  # runs, singles, descending
    np.testing.assert_array_equal(gather_host_pages(host, ids), np.take(host, ids, axis=0))
    out = np.full((len(ids), *host.shape[1:]), np.nan, np.float32)
    assert gather_host_pages(host, ids, out=out) is out
    np.testing.assert_array_equal(out, host[ids])
    with pytest.raises(TransferShapeError):
        gather_host_pages(host, np.array([40]))
