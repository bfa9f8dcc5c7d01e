"""``GroupedHostPool`` (L2 with layer groups) against a plain model: a full-width
``HostPool`` holding the same pages, of which only the pages with a local host page
keep their local layers' KV."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.layout import GroupedPoolLayout, KVLayout
from strata_jax.cache.host_grouped import GroupedHostPool, grouped_host_page_bytes
from strata_jax.cache.pools import DevicePool, HostPool
from strata_jax.cache.tier_format import TierFormat

LAYOUT = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, page_size=4)
LOCAL = (True, True, False, True, False)
GLOBAL_LAYERS, LOCAL_LAYERS = np.array([2, 4]), np.array([0, 1, 3])


def _pages(rng, fmt: str, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    values = rng.standard_normal(LAYOUT.page_first_shape(n)).astype(np.float32)
    if fmt == "full":
        return values, None
    from pallas_kernels.quant_transfer import quantize_pages_reference

    q, scales = (np.asarray(a) for a in quantize_pages_reference(values, fmt))
    return q, scales


@pytest.mark.parametrize("fmt", ["full", "int8", "fp8"])
def test_grouped_host_pool_keeps_every_global_layer_and_the_local_layers_it_has_room_for(fmt):
    rng = np.random.default_rng(1)
    tier = TierFormat.resolve(fmt, "float32")
    pool = GroupedHostPool(LAYOUT, 12, tier, LOCAL, local_ratio=0.25)  # 3 local host pages
    assert pool.num_local_pages == 3
    plain = HostPool(LAYOUT, 12, tier)
    values, scales = _pages(rng, fmt, 6)
    pages = [7, 2, 9, 4, 0, 11]
    pool.attach_local(pages[:4])  # room for 3: the last of them get it
    assert [pool.has_local(p) for p in pages] == [False, True, True, True, False, False]
    pool.write(pages, values, scales)
    plain.write(pages, values, scales)
    with_local = [p for p in pages if pool.has_local(p)]
    without = [p for p in pages if not pool.has_local(p)]

    want = plain.read(pages).copy()
    for i, p in enumerate(pages):
        if not pool.has_local(p):
            want[i][LOCAL_LAYERS] = 0  # an L3 object flagged global-only: zeros there
    np.testing.assert_array_equal(pool.read(pages).view(np.uint8), want.view(np.uint8))

    out = np.empty((8, len(GLOBAL_LAYERS), *LAYOUT.page_first_shape(1)[2:]), pool.dtype)
    pool.read_layers(pages, GLOBAL_LAYERS, out)
    np.testing.assert_array_equal(out[:6].view(np.uint8), plain.read(pages)[:, GLOBAL_LAYERS].view(np.uint8))
    out = np.empty((8, len(LOCAL_LAYERS), *LAYOUT.page_first_shape(1)[2:]), pool.dtype)
    pool.read_layers(with_local, LOCAL_LAYERS, out)
    np.testing.assert_array_equal(out[:3].view(np.uint8), plain.read(with_local)[:, LOCAL_LAYERS].view(np.uint8))
    with pytest.raises(ValueError, match="without local-layer KV"):
        pool.read_layers(without, LOCAL_LAYERS, out)
    if scales is not None:
        np.testing.assert_array_equal(pool.read_scales(with_local), plain.read_scales(with_local))
        got = np.empty((4, len(GLOBAL_LAYERS), 2, 2), np.float32)
        pool.read_layer_scales(pages[:4], GLOBAL_LAYERS, got)
        np.testing.assert_array_equal(got, plain.read_scales(pages[:4])[:, GLOBAL_LAYERS])

    # a new backup evicts the least recently attached local host pages, page 2's first
    pool.attach_local([5])
    assert not pool.has_local(2) and pool.has_local(9) and pool.has_local(5) and pool.local.evicted == 1
    pool.freed([9, 4])  # host pages freed: their local host pages go back
    assert pool.local.map.free_pages == 2 and pool.local.room == 3  # (5 keeps its own, evictable)
    pool.check([7, 2, 0, 11, 5])


def test_grouped_host_pool_loads_what_a_full_width_one_loads():
    """A grouped L1 pool loading from either L2 gets the same rows: every page's global
    layers, the local layers of the pages asked for."""
    rng = np.random.default_rng(2)
    tier = TierFormat.resolve("full", "float32")
    values, _ = _pages(rng, "full", 8)
    grouped_host = GroupedHostPool(LAYOUT, 8, tier, LOCAL, local_ratio=0.5)
    plain_host = HostPool(LAYOUT, 8, tier)
    src = list(range(8))
    grouped_host.attach_local([5, 6, 7])
    grouped_host.write(src, values)
    plain_host.write(src, values)
    dst, with_local = [3, 0, 7, 1, 5, 2, 6, 4], [False] * 5 + [True] * 3
    kvs = []
    for host in (plain_host, grouped_host):
        pool = DevicePool(LAYOUT, 9, tier_format=tier, grouped=GroupedPoolLayout(LAYOUT, LOCAL, 9, 4))
        pool.local.attach([dst[i] for i in range(8) if with_local[i]])
        for staged in pool.load_from_host(host, src, dst, chunk_pages=4, with_local=with_local):
            staged.block_until_ready()
        kvs.append(np.asarray(pool.kv))
    np.testing.assert_array_equal(kvs[1], kvs[0])
    assert np.abs(kvs[0]).sum() > 0


def test_mean_page_bytes():
    """Gemma 3's 5 local layers to 1 global: a tenth of the local pages keeps 0.25 of a page."""
    assert grouped_host_page_bytes(600, 5 / 6, 0.1) == pytest.approx(600 * (1 / 6 + 5 / 6 * 0.1))
    pool = GroupedHostPool(LAYOUT, 40, TierFormat.resolve("full", "float32"), LOCAL, local_ratio=0.25)
    assert pool.page_bytes == pytest.approx(grouped_host_page_bytes(LAYOUT.page_bytes, 3 / 5, 0.25))


def test_pages_of_windows_are_evicted_last_and_only_by_pages_of_windows():
    pool = GroupedHostPool(LAYOUT, 12, TierFormat.resolve("full", "float32"), LOCAL, local_ratio=1 / 3)  # 4 local pages
    pool.attach_local([0, 1, 2, 3])
    pool.attach_local([4, 5], windows={1, 3, 4})  # 0 and 2 are in no window: they go, oldest first
    assert [p for p in range(8) if pool.has_local(p)] == [1, 3, 4, 5]
    pool.attach_local([6, 7], windows={1, 3, 4, 6})  # 6 evicts 5 (no window); 7 finds no room without one
    assert [p for p in range(8) if pool.has_local(p)] == [1, 3, 4, 6]
    pool.attach_local([8], windows={1, 3, 4, 6, 8})  # only windows left: the oldest (1) goes
    assert [p for p in range(9) if pool.has_local(p)] == [3, 4, 6, 8] and pool.local.evicted == 4
    pool.local.pin("reader", [3, 4, 6, 8])
    pool.attach_local([9], windows={9})  # all pinned: global-only
    assert not pool.has_local(9)


class _Node:
    def __init__(self, host, parent=None):  # noqa: ANN001
        self.host, self.parent, self.children = host, parent, {}
        if parent is not None:
            parent.children[len(parent.children)] = self


def test_window_pages_are_those_before_leaves_and_branch_points():
    """Brute force: every leaf or branch point's path, host pages in path order, its last k."""
    from strata_jax.cache.tree_window import host_window_pages

    rng = np.random.default_rng(5)
    for _ in range(50):
        root = _Node([])
        nodes, next_page = [root], 0
        for _ in range(rng.integers(1, 12)):
            parent = nodes[rng.integers(0, len(nodes))]
            n = int(rng.integers(1, 5))
            host = list(range(next_page, next_page + n)) if parent.host is not None and rng.random() < 0.8 else None
            next_page += n
            nodes.append(_Node(host, parent))
        k = int(rng.integers(1, 6))
        want: set[int] = set()
        for node in nodes[1:]:
            if node.host is None or len(node.children) == 1:
                continue
            path, x = [], node
            while x is not None and x.host is not None:
                path = x.host + path
                x = x.parent
            want.update(path[-k:])
        assert host_window_pages(nodes[1:], k) == want


@pytest.mark.parametrize("fmt", ["full", "int8"])
def test_writing_each_group_apart_is_writing_the_pages(fmt):
    """A backup into this pool gathers the global layers of every page and the local ones
    of the pages with a local host page, and writes each group apart."""
    rng = np.random.default_rng(3)
    tier = TierFormat.resolve(fmt, "float32")
    values, scales = _pages(rng, fmt, 5)
    pages = [4, 1, 7, 0, 9]
    whole, apart = (GroupedHostPool(LAYOUT, 10, tier, LOCAL, local_ratio=0.3) for _ in range(2))
    for pool in (whole, apart):
        pool.attach_local([7, 9])
    whole.write(pages, values, scales)
    apart.write_layers(
        pages, GLOBAL_LAYERS, values[:, GLOBAL_LAYERS], None if scales is None else scales[:, GLOBAL_LAYERS]
    )
    apart.write_layers(
        [7, 0, 9],
        LOCAL_LAYERS,
        values[[2, 3, 4]][:, LOCAL_LAYERS],
        None if scales is None else scales[[2, 3, 4]][:, LOCAL_LAYERS],
    )  # page 0 has no local host page: skipped
    np.testing.assert_array_equal(apart.read(pages).view(np.uint8), whole.read(pages).view(np.uint8))
    assert [apart.has_local(p) for p in pages] == [False, False, True, False, True]
    if scales is not None:
        np.testing.assert_array_equal(apart.read_scales(pages), whole.read_scales(pages))
