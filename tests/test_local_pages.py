"""Local-layer page bookkeeping of sliding-window models (strata_jax/cache/local_pages.py)."""

from __future__ import annotations

import random

import pytest

from strata_jax.cache.local_pages import NO_LOCAL_PAGE, LocalPageMap, TieredLocalPages, first_needed_page
from strata_jax.cache.radix_tree import HiRadixTree
from strata_jax.cache.tree_window import window_pages_for


def test_first_needed_page_is_the_first_page_a_later_token_attends_to() -> None:
    """Brute force over positions: page i is still needed iff some token at q >= p attends
    to one of its positions t < p, i.e. q - window < t <= q, or token p is written into it."""
    rng = random.Random(0)
    for _ in range(2000):
        window, page_size = rng.randint(1, 40), rng.choice([1, 2, 4, 16])
        p = rng.randint(0, 120)
        pages = -(-p // page_size)
        needed = [
            i == p // page_size
            or any(
                q - window < t <= q
                for q in range(p, p + window + 1)
                for t in range(i * page_size, min((i + 1) * page_size, p))
            )
            for i in range(pages)
        ]
        first = first_needed_page(p, window, page_size)
        assert needed == [i >= first for i in range(pages)], (window, page_size, p)


def test_a_match_end_needs_the_pages_a_running_request_keeps() -> None:
    for window in range(2, 70):
        for page_size in (1, 2, 4, 16):
            for end in range(80, 84):  # past the first window: nothing clamps at page 0
                assert end - first_needed_page(end * page_size, window, page_size) == window_pages_for(
                    window, page_size
                )


def test_local_page_map_against_a_dict() -> None:
    rng = random.Random(1)
    local = LocalPageMap(12)
    model: dict[int, int] = {}
    for _ in range(3000):
        ids = rng.sample(range(40), rng.randint(0, 6))
        if rng.random() < 0.5:
            if any(g in model for g in ids):
                with pytest.raises(ValueError):
                    local.attach(ids)
                continue
            got = local.attach(ids)
            if len(ids) > 12 - len(model):
                assert got is None
            else:
                assert got is not None and len(set(got)) == len(ids)
                model.update(zip(ids, got))
        else:
            freed = local.detach(ids)
            assert sorted(freed) == sorted(model.pop(g) for g in ids if g in model)
        local.check()
        assert local.used_pages == len(model) and local.free_pages == 12 - len(model)
        probe = list(range(40))
        assert local.local_ids(probe) == [model.get(g, NO_LOCAL_PAGE) for g in probe]
    with pytest.raises(ValueError):
        local.attach([3, 3])


def test_a_finished_request_keeping_its_last_window_is_a_hit_at_its_end_only() -> None:
    """A request computes 20 pages with local KV, trims what it no longer reads as it goes,
    and inserts its pages: a later prompt extending it hits all of it; one that shares only
    its first 10 pages hits nothing (that window was trimmed); one that goes 2 pages past a
    point whose window is kept (the end of a shared prefix, kept by the tree) hits that point."""
    page_size, window = 4, 9  # 2 window pages
    tree = HiRadixTree(page_size)
    local = TieredLocalPages(window, page_size, device_pages=64, host_pages=0)
    tree.local_pages = local
    tokens = list(range(80))
    global_ids = list(range(100, 120))
    assert local.device.attach(global_ids) is not None
    first = first_needed_page(len(tokens), window, page_size)
    local.device.detach(global_ids[:first])
    assert local.device.used_pages == window_pages_for(window, page_size) == 2
    tree.insert(tokens, device_pages=global_ids)
    assert tree.match_prefix(tokens + [999]).device_tokens == 80
    assert tree.match_prefix(tokens[:40] + [999] * 8).device_tokens == 0
    local.device.attach(global_ids[8:10])  # the local KV before page 10, kept for a shared prefix
    assert tree.match_prefix(tokens[:48] + [999] * 8).device_tokens == 40
    tree.check(device_free=[], device_total=20, device_reserved=[])
    local.device.check()


def test_device_local_pages_against_a_plain_model() -> None:
    """Random attach / pin / unpin / move / free on ``DeviceLocalPages`` against a plain model:
    a set of attached pages, each owner's pinned set, and a list of unpinned attached pages
    in the order they were last unpinned (attach evicts from its front)."""
    from strata_jax.cache.local_pages import DeviceLocalPages, LocalPagesFull

    rng = random.Random(7)
    num_local, num_global = 10, 30
    dev = DeviceLocalPages(num_global, num_local)
    attached: set[int] = set()
    pins: dict[str, list[int]] = {}
    order: list[int] = []  # unpinned attached pages, least recently unpinned first
    evicted = 0

    def pinned() -> set[int]:
        return {g for pages in pins.values() for g in pages}

    def release(pages) -> None:  # noqa: ANN001  (pages that just lost their last pin, in pin order)
        for g in pages:
            if g in attached and g not in pinned():
                order.append(g)

    for _ in range(4000):
        op = rng.random()
        if op < 0.35:
            ids = rng.sample(range(num_global), rng.randint(1, 5))
            want = [g for g in dict.fromkeys(ids) if g not in attached]
            short = len(want) - (num_local - len(attached))
            if short > len(order):
                with pytest.raises(LocalPagesFull):
                    dev.attach(ids)
                continue
            dev.attach(ids)
            for _ in range(max(0, short)):
                attached.discard(order.pop(0))
            evicted += max(0, short)
            attached.update(want)
            order.extend(want)
        elif op < 0.65:
            owner = rng.choice("abc")
            new = [g for g in rng.sample(range(num_global), rng.randint(0, 4)) if g in attached]
            old = pins.pop(owner, [])
            if new:
                pins[owner] = new
            for g in new:
                if g in order:
                    order.remove(g)
            release([g for g in old if g not in new])
            dev.pin(owner, new)
        elif op < 0.8:
            src, dst = rng.sample(range(num_global), 2)
            dev.move(src, dst)
            if src in attached and dst not in attached:
                attached.remove(src)
                attached.add(dst)
                for owner, pages in pins.items():
                    pins[owner] = [dst if g == src else g for g in pages]
                if src in order:
                    order.remove(src)
                    order.append(dst)
        else:
            freed = rng.sample(range(num_global), rng.randint(1, 3))
            dev.freed(freed)
            for g in freed:
                attached.discard(g)
                if g in order:
                    order.remove(g)
            pins = {o: [g for g in p if g not in freed] for o, p in pins.items()}
            pins = {o: p for o, p in pins.items() if p}
        dev.check(range(num_global))
        assert {g for g in range(num_global) if dev.has(g)} == attached
        assert dev.evicted == evicted and dev.room == num_local - len(attached) + len(order)
        assert set(order) == attached - pinned()
    assert evicted > 100
