"""The device pool of a model with layer groups (pallas_kernels.layout.GroupedPoolLayout)."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.layout import GroupedPoolLayout, KVLayout

# gemma-3-270m's shape: 18 layers, every 6th global, 1 KV head of 256
GEMMA_LOCAL = tuple((i + 1) % 6 != 0 for i in range(18))
GEMMA_LAYOUT = KVLayout(num_layers=18, num_kv_heads=1, head_dim=256, page_size=16, dtype="bfloat16")


def test_uniform_rows_hold_the_layer_first_pool() -> None:
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, page_size=4)
    pages = 7
    grouped = GroupedPoolLayout.uniform(layout, pages)
    pool = np.random.default_rng(0).standard_normal(layout.device_pool_shape(pages)).astype(np.float32)
    flat = np.transpose(pool, (1, 0, 2, 3, 4, 5)).reshape(grouped.pool_shape())
    assert grouped.nbytes == pool.nbytes and grouped.num_slots == 5 * pages * 4
    for layer in range(layout.num_layers):
        for page in range(pages):
            for kv in (0, 1):
                np.testing.assert_array_equal(flat[0, kv, grouped.page_base[layer] + page], pool[layer, kv, page])


def test_grouped_rows_tile_the_pool_once_and_hold_a_window_model_in_a_fifth() -> None:
    # a 4,096-token request at page 16 needs 256 pages of every global layer and, of every
    # local layer (window 512), the window's 32 pages plus the one being written
    grouped = GroupedPoolLayout(GEMMA_LAYOUT, GEMMA_LOCAL, global_pages=256, local_pages=33)
    owner = np.full(grouped.num_rows, -1)
    for layer, pages in enumerate(grouped.layer_pages):
        base = grouped.page_base[layer]
        assert (owner[base : base + pages] == -1).all(), "two layers share a row"
        owner[base : base + pages] = layer
    assert (owner >= 0).all(), "a row belongs to no layer"
    full = GroupedPoolLayout.uniform(GEMMA_LAYOUT, 256)
    assert full.nbytes == 2 * 18 * 256 * 16 * 256 * 2
    assert grouped.nbytes / full.nbytes == pytest.approx((3 * 256 + 15 * 33) / (18 * 256))  # 0.274
    with pytest.raises(ValueError):
        GroupedPoolLayout(GEMMA_LAYOUT, GEMMA_LOCAL[:-1], 256, 33)
    with pytest.raises(ValueError):
        GroupedPoolLayout(GEMMA_LAYOUT, GEMMA_LOCAL, global_pages=256, local_pages=0)


def test_rows_against_a_brute_force() -> None:
    grouped = GroupedPoolLayout(GEMMA_LAYOUT, GEMMA_LOCAL, global_pages=9, local_pages=4)
    rng = np.random.default_rng(1)
    global_ids = rng.integers(-1, 11, 40)  # -1 and 9, 10 are outside the global group
    local_ids = rng.integers(-1, 6, 40)  # -1 and 4, 5 are outside the local group
    rows = grouped.rows(global_ids, local_ids)
    assert rows.shape == (40, 18) and rows.dtype == np.int32
    for i in range(40):
        for layer in range(18):
            row = 0
            for earlier in range(layer):  # rows of the layers before
                row += 4 if GEMMA_LOCAL[earlier] else 9
            page, pages = (local_ids[i], 4) if GEMMA_LOCAL[layer] else (global_ids[i], 9)
            want = row + page if 0 <= page < pages else grouped.num_rows
            assert rows[i, layer] == want


def test_a_layer_never_reaches_another_layers_rows():
    """``AttentionMetadata.for_layer`` on a grouped pool: a page id past the layer's count is
    clipped into the layer's own rows, a slot past it (or padding) lands out of the pool."""
    import jax.numpy as jnp

    from strata_jax.models.llama import AttentionMetadata

    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, page_size=2)
    grouped = GroupedPoolLayout(layout, (True, False, True), global_pages=5, local_pages=3)
    (base, count) = (jnp.asarray(c, jnp.int32) for c in zip(*grouped.layer_rows()))
    assert grouped.layer_rows() == ((0, 3), (3, 5), (8, 3))
    pool = jnp.zeros(grouped.pool_shape())
    total = grouped.num_slots  # 22 rows x 2
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray([0, 9, 10, total]),
        page_table=jnp.asarray([[0, 4, 7]]),
        seq_lens=jnp.asarray([5]),
        query_start=jnp.asarray([0, 4]),
        layer_page_base=base,
        layer_page_count=count,
        local_page_table=jnp.asarray([[2, 1, 6]]),
        local_slot_mapping=jnp.asarray([5, 6, -1, total]),
    )
    table, slots, layer = meta.for_layer(pool, 1, jnp.int32(0))  # global layer: rows 3..7
    assert layer == 0 and table.tolist() == [[3, 7, 7]] and slots.tolist() == [6, 15, total, total]
    table, slots, _ = meta.for_layer(pool, 2, jnp.int32(4))  # local layer: rows 8..10, local ids
    assert table.tolist() == [[10, 9, 10]] and slots.tolist() == [21, total, total, total]
