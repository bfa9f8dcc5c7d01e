"""Matches on sliding-window models never end where a local-layer window is incomplete.

The tree's state machine (``test_cache_radix_tree.TreeMachine``: random inserts in every
tier, transient nodes, locks, backups, evictions, checked against a page-prefix model)
runs again with window-trimmed local KV: every page id of each tier may or may not have
its local-layer KV attached (``LocalSets``), set the way a running request trims it (only
the last ``keep`` pages of a path) or page by page.  Every match is compared with a
brute force over the flat page-prefix view of the tree: the longest prefix whose window
pages all have their local KV, by the definition in ``strata_jax.cache.tree_window``,
and checked directly against the local sets.
"""

from __future__ import annotations

import pytest
import test_cache_radix_tree as base
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from strata_jax.cache.radix_tree import HiRadixTree
from strata_jax.cache.tree_window import (
    LOCAL_MISSING,
    LOCAL_ON_DEVICE,
    LOCAL_ON_HOST,
    window_match,
    window_pages_for,
)


class LocalSets:
    """``tree_window.LocalPages`` as two sets of page ids."""

    def __init__(self, window_pages: int) -> None:
        self.window_pages = window_pages
        self.device: set[int] = set()
        self.host: set[int] = set()

    def on_device(self, page_id: int) -> bool:
        return page_id in self.device

    def on_host(self, page_id: int) -> bool:
        return page_id in self.host


def export_ids(tree: HiRadixTree) -> dict[str, dict[tuple, tuple[int | None, int | None]]]:
    """Page-prefix -> (device page id, host page id) of every data page, by a plain traversal."""
    ps = tree.page_size
    out: dict[str, dict[tuple, tuple[int | None, int | None]]] = {}
    for ns in tree.namespaces():
        stack = [(tree.root(ns), ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                pre = prefix
                for j, i in enumerate(range(0, len(child.key), ps)):
                    pre = pre + (child.key[i : i + ps],)
                    dev = child.device[j] if child.device is not None else None
                    host = child.host[j] if child.host is not None else None
                    out.setdefault(ns, {})[pre] = (dev, host)
                stack.append((child, pre))
    return out


PICKS = st.tuples(st.sampled_from(("whole", "whole", "cut", "fresh")), st.integers(0, 8), st.integers(0, 20))


class WindowTreeMachine(base.TreeMachine):
    @initialize(ps=st.sampled_from([1, 2, 4]), window_pages=st.integers(1, 4))
    def setup(self, ps: int, window_pages: int) -> None:  # type: ignore[override]
        super().setup(ps)
        self.local = LocalSets(window_pages)
        self.tree.local_pages = self.local
        self.seen: list[tuple[str, list[int]]] = []  # inserted sequences: most queries below extend one

    def _pick(self, ns: str, pick: tuple[str, int, int], tail: list[int]) -> tuple[str, list[int]]:
        """``pick`` = (how, which, cut): a seen sequence (``"whole"``, or ``"cut"`` to ``cut``
        tokens) plus ``tail`` in its namespace, or ``tail`` alone in ``ns`` (``"fresh"``)."""
        how, which, cut = pick
        if not self.seen or how == "fresh":
            return ns, tail
        ns, seq = self.seen[-1 - which % len(self.seen)]  # the latest first: its local KV is as it was set
        return ns, (seq[:cut] if how == "cut" else seq) + tail

    @rule(ns=st.sampled_from(base.NAMESPACES), seq=base.TreeMachine.seqs, keep=st.integers(0, 6))
    def insert_device(self, ns: str, seq: list[int], keep: int = 0) -> None:  # type: ignore[override]
        """A request's pages inserted with the local KV it kept: its last ``keep`` pages."""
        super().insert_device(ns, seq)
        self.seen.append((ns, seq))
        self._keep_last(ns, seq, keep)

    # -------------------------------------------------------------- brute force
    def _expected_window_match(self, ns: str, seq: list[int], requester) -> tuple[int, int, int, tuple]:
        dev, host, trans, owners = self._expected_match(ns, seq, requester)
        ids = export_ids(self.tree).get(ns, {})
        pres = self._prefixes(seq)
        d, h = dev // self.ps, host // self.ps
        w = self.local.window_pages

        def local_ok(i: int) -> bool:
            dev_id, host_id = ids[pres[i]]
            return dev_id in self.local.device if i < d else host_id in self.local.host

        def valid(e: int) -> bool:
            return all(local_ok(i) for i in range(e - min(w, e), e))

        device = max(e for e in range(d + 1) if valid(e))
        extra = 0
        if device == d:
            extra = max((e - d for e in range(d + 1, d + h + 1) if valid(e)), default=0)
        if device + extra < d + h:  # the cut data prefix is not followed by transient tokens
            trans, owners = 0, ()
        return device * self.ps, extra * self.ps, trans, owners

    # -------------------------------------------------------------- rules
    @rule(
        ns=st.sampled_from(base.NAMESPACES),
        pick=PICKS,
        tail=st.lists(st.integers(0, 2), max_size=6),
        requester=st.sampled_from([None, *base.OWNERS]),
        touch=st.booleans(),
    )
    def match(self, ns: str, pick: tuple[str, int, int], tail: list[int], requester, touch: bool) -> None:  # type: ignore[override]
        ns, seq = self._pick(ns, pick, tail)
        want = self._expected_window_match(ns, seq, requester)
        m = self.tree.match_prefix(seq, ns, requester=requester, touch=touch)
        assert (m.device_tokens, m.host_tokens, m.transient_tokens, m.transient_owners) == want
        assert len(m.device_page_ids) * self.ps == m.device_tokens
        # directly: the window before the match's end has its local KV, in the tiers the match says
        w = self.local.window_pages
        end_pages = (m.device_tokens + m.host_tokens) // self.ps
        if m.host_tokens == 0:
            assert all(p in self.local.device for p in m.device_page_ids[len(m.device_page_ids) - min(w, end_pages) :])
        path_ids = [export_ids(self.tree)[ns][pre] for pre in self._prefixes(seq)[:end_pages]]
        window = range(end_pages - min(w, end_pages), end_pages)
        d = m.device_tokens // self.ps
        assert all(
            (path_ids[i][0] in self.local.device) if i < d else (path_ids[i][1] in self.local.host) for i in window
        )
        # the match's handle ends exactly at its data
        node, tokens = m.last_node, 0
        while node.parent is not None:
            tokens += len(node.key)
            node = node.parent
        assert tokens == m.device_tokens + m.host_tokens

    @rule(ns=st.sampled_from(base.NAMESPACES), seq=base.TreeMachine.seqs)
    def insert_like_engine(self, ns: str, seq: list[int]) -> None:  # type: ignore[override]
        """As the engine: its page table starts with the match's device pages; a window cut can
        leave device pages beyond the match, so some fresh ids may come back unused."""
        inserted = self._insert_after_match(ns, seq)
        if inserted is None:
            return
        res, fresh = inserted
        assert set(res.unused_pages) <= set(fresh)
        self.dev_free.extend(res.unused_pages)
        self.seen.append((ns, seq))

    @rule(ns=st.sampled_from(base.NAMESPACES), pick=PICKS, keep=st.integers(0, 6))
    def trim_like_a_running_request(self, ns: str, pick: tuple[str, int, int], keep: int) -> None:
        """Local KV kept for the last ``keep`` pages of the path's data only, in both tiers."""
        self._keep_last(*self._pick(ns, pick, []), keep)

    def _keep_last(self, ns: str, seq: list[int], keep: int) -> None:
        ids = export_ids(self.tree).get(ns, {})
        path = [ids[pre] for pre in self._prefixes(seq) if pre in ids]
        for i, (dev, host) in enumerate(path):
            kept = i >= len(path) - keep
            for page, tier in ((dev, self.local.device), (host, self.local.host)):
                if page is not None:
                    (tier.add if kept else tier.discard)(page)

    @rule(ns=st.sampled_from(base.NAMESPACES), pick=PICKS, index=st.integers(0, 30), on_host=st.booleans())
    def toggle_one_page(self, ns: str, pick: tuple[str, int, int], index: int, on_host: bool) -> None:
        ns, seq = self._pick(ns, pick, [])
        ids = export_ids(self.tree).get(ns, {})
        path = [ids[pre] for pre in self._prefixes(seq) if pre in ids]
        if not path:
            return
        page = path[index % len(path)][1 if on_host else 0]
        if page is not None:
            tier = self.local.host if on_host else self.local.device
            tier.symmetric_difference_update({page})


WindowTreeMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestWindowTreeAgainstBruteForce = WindowTreeMachine.TestCase


# ---------------------------------------------------------------------- directed tests
@settings(max_examples=300, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    window_pages=st.integers(1, 5),
    device_pages=st.integers(0, 10),
    host_pages=st.integers(0, 6),
    local_device=st.lists(st.booleans(), min_size=16, max_size=16),
    local_host=st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_one_path_with_random_local_pages_matches_the_brute_force(
    ps: int, window_pages: int, device_pages: int, host_pages: int, local_device: list[bool], local_host: list[bool]
) -> None:
    """One sequence: ``device_pages`` pages in L1, then ``host_pages`` in L2 only, each page's
    local KV present or not at random; the match of the sequence (and one token more) against
    the definition: the longest e whose last min(w, e) pages have local KV in the right tier."""
    tree = HiRadixTree(ps)
    local = LocalSets(window_pages)
    tree.local_pages = local
    total = device_pages + host_pages
    tokens = list(range(total * ps))
    dev_ids, host_ids = list(range(100, 100 + device_pages)), list(range(200, 200 + host_pages))
    if device_pages:
        tree.insert(tokens[: device_pages * ps], device_pages=dev_ids)
    if host_pages:
        tree.insert(tokens, host_pages=host_ids, start_page=device_pages)
    local.device.update(g for i, g in enumerate(dev_ids) if local_device[i])
    local.host.update(h for i, h in enumerate(host_ids) if local_host[i])

    def has_local(i: int) -> bool:
        return local_device[i] if i < device_pages else local_host[i - device_pages]

    def valid(e: int) -> bool:
        return all(has_local(i) for i in range(e - min(window_pages, e), e))

    want_device = max(e for e in range(device_pages + 1) if valid(e))
    want_host = 0
    if want_device == device_pages:
        want_host = max((e - device_pages for e in range(device_pages + 1, total + 1) if valid(e)), default=0)
    m = tree.match_prefix(tokens + [999])
    assert (m.device_tokens, m.host_tokens) == (want_device * ps, want_host * ps)
    assert m.device_page_ids == tuple(dev_ids[:want_device])


def test_window_pages_cover_the_keys_of_the_first_new_token() -> None:
    # window 512 at page 16: positions e-511 .. e-1 lie in the 32 pages before e
    assert window_pages_for(512, 16) == 32
    assert window_pages_for(513, 16) == 32
    assert window_pages_for(514, 16) == 33
    assert window_pages_for(1, 16) == 0  # a window of 1 reads only the token itself
    assert window_pages_for(2, 1) == 1
    with pytest.raises(ValueError):
        window_pages_for(0, 16)


def test_window_match_stops_at_the_last_complete_window() -> None:
    D, H, M = LOCAL_ON_DEVICE, LOCAL_ON_HOST, LOCAL_MISSING
    # a trimmed device path: local KV only for the last 2 of 6 pages, window 2 -> the whole path
    assert window_match([M, M, M, M, D, D], 6, 2) == (6, 0)
    # window 3 needs one more page: the longest complete window ends at 0 (pages before are missing)
    assert window_match([M, M, M, M, D, D], 6, 3) == (0, 0)
    # host pages after the device ones: the host window may reach back into device pages with local KV
    assert window_match([D, D, H, H], 2, 3) == (2, 2)
    # ... but not to a device page whose local KV is only on the host (a load brings whole pages)
    assert window_match([D, H, H, H], 1, 3) == (1, 3)
    assert window_match([D, H, H, H], 2, 1) == (1, 0)
    assert window_match([H, H, H, H], 2, 3) == (0, 0)
    assert window_match([D, D, M, H], 2, 2) == (2, 0)
    # a device prefix cut short is not extended by host pages
    assert window_match([D, M, D, H, H], 3, 1) == (3, 2)
    assert window_match([D, D, M, H, H], 3, 2) == (2, 0)
    assert window_match([], 0, 4) == (0, 0)
    with pytest.raises(ValueError):
        window_match([D], 2, 1)


def test_match_splits_the_node_where_the_window_is_complete() -> None:
    tree = HiRadixTree(1)
    local = LocalSets(window_pages=2)
    tree.local_pages = local
    tree.insert([1, 2, 3, 4, 5, 6], device_pages=[10, 11, 12, 13, 14, 15])
    local.device.update({11, 12})  # a window of 2 complete before token 3 (and before 0)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (m.device_tokens, m.host_tokens, m.device_page_ids) == (3, 0, (10, 11, 12))
    assert m.last_node.key == (1, 2, 3) and m.last_node.device == [10, 11, 12]
    local.device.update({14, 15})
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_tokens == 6
    tree.check(device_free=[], device_total=6)
    tree.local_pages = None  # every layer global: the plain match
    local.device.clear()
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_tokens == 6
