"""The flat row layout of a device pool with layer groups (pallas_kernels.layout.RowLayout)."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.layout import KVLayout, RowLayout


def test_uniform_rows_are_the_layer_first_pool_reshaped() -> None:
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, page_size=4)
    pages = 7
    rows = RowLayout.uniform(layout, pages)
    pool = np.random.default_rng(0).standard_normal(layout.device_pool_shape(pages)).astype(np.float32)
    flat = pool.reshape(rows.pool_shape())  # a view: no copy
    assert np.shares_memory(flat, pool) and rows.nbytes == pool.nbytes
    for layer in range(layout.num_layers):
        for page in range(pages):
            np.testing.assert_array_equal(flat[rows.k_base[layer] + page], pool[layer, 0, page])
            np.testing.assert_array_equal(flat[rows.v_base[layer] + page], pool[layer, 1, page])


def test_grouped_rows_tile_the_pool_once_and_hold_a_window_model_in_a_fifth() -> None:
    # gemma-3-270m's shape: 18 layers, every 6th global, 1 KV head of 256, window 512; a
    # 4,096-token request at page 16 needs 256 pages of every global layer and the pages of
    # the window (32) plus the one being written for every local layer.
    local = tuple((i + 1) % 6 != 0 for i in range(18))
    layout = KVLayout(num_layers=18, num_kv_heads=1, head_dim=256, page_size=16, dtype="bfloat16")
    grouped = RowLayout.grouped(layout, local, global_pages=256, local_pages=33)
    owner = np.full(grouped.num_rows, -1)
    for layer, pages in enumerate(grouped.layer_pages):
        for base in (grouped.k_base[layer], grouped.v_base[layer]):
            assert (owner[base : base + pages] == -1).all(), "two layers share a row"
            owner[base : base + pages] = layer
    assert (owner >= 0).all(), "a row belongs to no layer"
    full = RowLayout.uniform(layout, 256)
    assert grouped.nbytes / full.nbytes == pytest.approx((3 * 256 + 15 * 33) / (18 * 256))  # 0.274
    with pytest.raises(ValueError):
        RowLayout(layout, (4,) * 17)
    with pytest.raises(ValueError):
        RowLayout.grouped(layout, local, global_pages=256, local_pages=0)
