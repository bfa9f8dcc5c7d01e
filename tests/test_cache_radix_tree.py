"""HiRadixTree against a brute-force page-level prefix model (hypothesis state machine).

The model stores, per namespace, one entry per cached page *prefix* (a tuple of
page tuples) with its tier state ("D", "H", "DH" or ("T", owner, state)); it
predicts every match and every insert independently of the tree's node structure.
Evictions are decided by the tree; the model checks they were legal (locked
prefixes untouched, enough pages freed unless nothing evictable remained) and then
adopts them.  ``check()`` runs after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from strata_jax.cache.radix_tree import IN_FLIGHT, IN_QUEUE, HiRadixTree, TreeError

NAMESPACES = ["", "tenant-b"]
OWNERS = ["r1", "r2", "r3"]
POOL = 4096


def export(tree: HiRadixTree) -> dict[str, dict[tuple, object]]:
    """Page-prefix -> tier view of the tree, computed by a plain traversal."""
    ps = tree.page_size
    out: dict[str, dict[tuple, object]] = {ns: {} for ns in NAMESPACES}
    for ns in tree.namespaces():
        stack = [(tree.root(ns), ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                pre = prefix
                for i in range(0, len(child.key), ps):
                    pre = pre + (child.key[i : i + ps],)
                    if child.is_transient:
                        tier: object = ("T", child.owner, child.state)
                    else:
                        tier = ("D" if child.device is not None else "") + ("H" if child.host is not None else "")
                    out.setdefault(ns, {})[pre] = tier
                stack.append((child, pre))
    return out


def pages_of(seq: list[int], ps: int) -> list[tuple]:
    n = len(seq) // ps
    return [tuple(seq[i * ps : (i + 1) * ps]) for i in range(n)]


class TreeMachine(RuleBasedStateMachine):
    @initialize(ps=st.sampled_from([1, 2, 4]))
    def setup(self, ps: int) -> None:
        self.ps = ps
        self.tree = HiRadixTree(ps)
        for ns in NAMESPACES:
            self.tree.root(ns)
        self.model: dict[str, dict[tuple, object]] = {ns: {} for ns in NAMESPACES}
        self.dev_free = list(range(POOL))
        self.host_free = list(range(POOL))
        self.locks: list[tuple[object, str, list[tuple], dict[tuple, object]]] = []

    seqs = st.lists(st.integers(0, 2), min_size=0, max_size=20)

    # -------------------------------------------------------------- helpers
    def _prefixes(self, seq: list[int]) -> list[tuple]:
        pages = pages_of(seq, self.ps)
        return [tuple(pages[: i + 1]) for i in range(len(pages))]

    def _expected_match(self, ns: str, seq: list[int], requester=None) -> tuple[int, int, int, tuple]:
        dev = host = trans = 0
        owners: list = []
        phase = 0
        for pre in self._prefixes(seq):
            tier = self.model[ns].get(pre)
            if tier is None:
                break
            if isinstance(tier, tuple) and requester is not None and tier[1] == requester:
                break
            if phase == 0 and tier in ("D", "DH"):
                dev += self.ps
            elif phase <= 1 and tier == "H":
                phase = 1
                host += self.ps
            elif isinstance(tier, tuple):
                phase = 2
                trans += self.ps
                if tier[1] not in owners:
                    owners.append(tier[1])
            else:
                raise AssertionError(f"model has an impossible path: {tier} after phase {phase}")
        return dev, host, trans, tuple(owners)

    # -------------------------------------------------------------- rules
    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs, requester=st.sampled_from([None, *OWNERS]), touch=st.booleans())
    def match(self, ns: str, seq: list[int], requester, touch: bool) -> None:
        m = self.tree.match_prefix(seq, ns, requester=requester, touch=touch)
        got = (m.device_tokens, m.host_tokens, m.transient_tokens, m.transient_owners)
        assert got == self._expected_match(ns, seq, requester)
        assert len(m.device_page_ids) * self.ps == m.device_tokens
        assert m.storage_tokens == 0

    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs)
    def insert_device(self, ns: str, seq: list[int]) -> None:
        pres = self._prefixes(seq)
        if len(pres) > len(self.dev_free):
            return
        pages = [self.dev_free.pop() for _ in pres]
        res = self.tree.insert(seq, ns, device_pages=pages)
        self.dev_free.extend(res.unused_pages)
        self._mark_on_device(ns, pres)

    def _mark_on_device(self, ns: str, pres: list[tuple]) -> None:
        """The model after a device insert of the page prefixes ``pres``."""
        for pre in pres:
            tier = self.model[ns].get(pre)
            if tier is None or isinstance(tier, tuple):
                self.model[ns][pre] = "D"
            elif tier == "H":
                self.model[ns][pre] = "DH"

    def _insert_after_match(self, ns: str, seq: list[int]) -> tuple | None:
        """A device insert as the engine makes it: its page table starts with the match's
        device pages, fresh ids after them.  Returns ``(result, fresh ids)``, or None when
        too few ids are free (nothing inserted)."""
        pres = self._prefixes(seq)
        own = list(self.tree.match_prefix(seq, ns).device_page_ids)
        if len(pres) - len(own) > len(self.dev_free):
            return None
        fresh = [self.dev_free.pop() for _ in range(len(pres) - len(own))]
        res = self.tree.insert(seq, ns, device_pages=own + fresh)
        self._mark_on_device(ns, pres)
        return res, fresh

    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs)
    def insert_like_engine(self, ns: str, seq: list[int]) -> None:
        """The engine's page table starts with the tree's own device pages: nothing comes back unused."""
        inserted = self._insert_after_match(ns, seq)
        if inserted is not None:
            assert inserted[0].unused_pages == ()

    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs, start=st.integers(0, 6))
    def insert_host(self, ns: str, seq: list[int], start: int) -> None:
        pres = self._prefixes(seq)
        start = min(start, len(pres))
        prefix_ok = all((t := self.model[ns].get(pre)) is not None and not isinstance(t, tuple) for pre in pres[:start])
        n = len(pres) - start
        if n > len(self.host_free):
            return
        pages = [self.host_free.pop() for _ in range(n)]
        if not prefix_ok:
            with pytest.raises(TreeError):
                self.tree.insert(seq, ns, host_pages=pages, start_page=start)
            self.host_free.extend(pages)
            return
        res = self.tree.insert(seq, ns, host_pages=pages, start_page=start)
        self.host_free.extend(res.unused_pages)
        for pre in pres[start:]:
            tier = self.model[ns].get(pre)
            if tier is None or isinstance(tier, tuple):
                self.model[ns][pre] = "H"
            elif tier == "D":
                self.model[ns][pre] = "DH"

    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs, owner=st.sampled_from(OWNERS))
    def insert_transient(self, ns: str, seq: list[int], owner: str) -> None:
        self.tree.insert(seq, ns, owner=owner)
        for pre in self._prefixes(seq):
            if pre not in self.model[ns]:
                self.model[ns][pre] = ("T", owner, IN_QUEUE)

    @rule(owner=st.sampled_from(OWNERS))
    def in_flight(self, owner: str) -> None:
        self.tree.mark_in_flight(owner)
        for ns in NAMESPACES:
            for pre, tier in self.model[ns].items():
                if isinstance(tier, tuple) and tier[1] == owner:
                    self.model[ns][pre] = ("T", owner, IN_FLIGHT)

    @rule(owner=st.sampled_from(OWNERS))
    def abort(self, owner: str) -> None:
        self.tree.remove_transient(owner)
        for ns in NAMESPACES:
            model = self.model[ns]
            # deepest first: drop leaves, hand inner ones to a child's owner
            for pre in sorted(
                [p for p, t in model.items() if isinstance(t, tuple) and t[1] == owner], key=len, reverse=True
            ):
                kids = [p for p in model if len(p) == len(pre) + 1 and p[: len(pre)] == pre]
                if kids:
                    model[pre] = ("T", model[kids[0]][1], model[kids[0]][2])  # any heir; compared loosely
                else:
                    del model[pre]
        # the heir's identity depends on dict order inside the tree: adopt the tree's owner there
        exp = export(self.tree)
        for ns in NAMESPACES:
            for pre, tier in self.model[ns].items():
                if isinstance(tier, tuple) and tier[1] != exp[ns].get(pre, (None, None))[1]:
                    got = exp[ns][pre]
                    assert isinstance(got, tuple) and got[1] != owner
                    self.model[ns][pre] = got

    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs)
    def lock(self, ns: str, seq: list[int]) -> None:
        m = self.tree.match_prefix(seq, ns)
        self.tree.lock(m.last_node)
        n = (m.device_tokens + m.host_tokens) // self.ps
        pres = self._prefixes(seq)[:n]
        self.locks.append((m.last_node, ns, pres, {p: self.model[ns][p] for p in pres}))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, *_ = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(ns=st.sampled_from(NAMESPACES), seq=seqs)
    def backup(self, ns: str, seq: list[int]) -> None:
        """Write-through: give every device-only node on the path a host copy."""
        m = self.tree.match_prefix(seq, ns)
        node = m.last_node
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        for node in path:
            if node.device is not None and node.host is None and len(node.device) <= len(self.host_free):
                self.tree.set_host(node, [self.host_free.pop() for _ in node.device])
        after = export(self.tree)
        for space in NAMESPACES:
            for pre, tier in after[space].items():
                old = self.model[space][pre]
                assert tier == old or (old == "D" and tier == "DH" and space == ns), (old, tier)
        self.model = after

    @rule(n=st.integers(1, 12), with_backup=st.booleans(), drop_host=st.booleans())
    def evict_device(self, n: int, with_backup: bool, drop_host: bool) -> None:
        before = export(self.tree)
        evictable = self.tree.evictable_device_pages()

        def backup(node):
            if len(node.device) > len(self.host_free):
                return None
            return [self.host_free.pop() for _ in node.device]

        dropped: list[int] = []
        freed = self.tree.evict_device(n, backup if with_backup else None, dropped.extend if drop_host else None)
        self.dev_free.extend(freed)
        self.host_free.extend(dropped)
        after = export(self.tree)
        self._check_eviction(before, after, "D", host_dropped=drop_host)
        gone = [p for ns in NAMESPACES for p in set(before[ns]) - set(after[ns]) if before[ns][p] in ("H", "DH")]
        assert len(dropped) == len(gone)  # one model entry per page
        if len(freed) < n:
            if drop_host:  # every unlocked device node can go: the scheduler's capacity is real
                assert len(freed) == evictable, (len(freed), evictable)
            for node in self.tree.iter_nodes():
                blocked = any(c.device is not None for c in node.children.values())
                if node.device is not None and node.lock_ref == 0 and not blocked:
                    # only a device-only node with children it cannot drop may stay
                    assert not drop_host, "evictable device leaf left behind"
                    assert node.host is None and node.children, "evictable device leaf left behind"
                    assert not with_backup or len(self.host_free) < len(node.device)
        self.model = after

    @rule(n=st.integers(1, 12))
    def evict_host(self, n: int) -> None:
        before = export(self.tree)
        dropped = []
        freed = self.tree.evict_host(n, before_drop=dropped.append)
        self.host_free.extend(freed)
        after = export(self.tree)
        self._check_eviction(before, after, "H")
        assert sum(len(d.key) for d in dropped) // self.ps == len(freed)
        if len(freed) < n:
            for node in self.tree.iter_nodes():
                assert not (node.host is not None and node.device is None and node.lock_ref == 0 and not node.children)
        self.model = after

    def _check_eviction(self, before, after, tier_letter: str, host_dropped: bool = False) -> None:
        assert before == self.model, "tree diverged from the model before eviction"
        for ns in NAMESPACES:
            for pre, tier in after[ns].items():
                old = before[ns][pre]
                if tier_letter == "D":
                    assert tier == old or (old in ("D", "DH") and tier == "H"), (old, tier)
                else:
                    assert tier == old, "host eviction changed a surviving node"
            removed = set(before[ns]) - set(after[ns])
            for pre in removed:
                if tier_letter == "D" and (
                    isinstance(before[ns][pre], tuple) or (host_dropped and before[ns][pre] in ("H", "DH"))
                ):
                    # queued continuations (and, with drop_host, nodes that are or just became
                    # host-only) below an evicted L1-only prefix go with it
                    assert any(before[ns][p] == "D" and len(p) < len(pre) and pre[: len(p)] == p for p in removed), (
                        "evicted a transient or host-only node that was not below an evicted prefix"
                    )
                else:
                    assert before[ns][pre] == tier_letter, "evicted something that was not a pure tier copy"
        for _, ns, pres, _ in self.locks:
            for pre in pres:
                assert after[ns].get(pre) == before[ns][pre], "locked prefix evicted"

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check(device_free=self.dev_free, device_total=POOL, host_free=self.host_free, host_total=POOL)
        assert export(self.tree) == self.model
        for _, ns, pres, _ in self.locks:
            for pre in pres:
                assert pre in self.model[ns], "locked prefix lost"


TreeMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestTreeAgainstModel = TreeMachine.TestCase


# ---------------------------------------------------------------------- directed tests
def test_namespace_isolation() -> None:
    tree = HiRadixTree(2)
    tree.insert([1, 2, 3, 4], "a", device_pages=[0, 1])
    m = tree.match_prefix([1, 2, 3, 4], "b")
    assert m.device_tokens == m.host_tokens == m.transient_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4], "a").device_tokens == 4
    tree.check()


def test_l1_eviction_drops_host_only_nodes_below_an_l1_only_prefix() -> None:
    tree = HiRadixTree(1)
    tree.insert([1, 2, 3], device_pages=[0, 1, 2])
    tree.match_prefix([1])  # split: [1] | [2, 3]
    tail = tree.match_prefix([1, 2, 3]).last_node
    tree.set_host(tail, [7, 8])  # the continuation has an L2 copy, its prefix does not
    assert tree.evictable_device_pages() == 3
    kept = tree.evict_device(3)  # without drop_host the L1-only prefix must stay
    assert sorted(kept) == [1, 2] and tree.match_prefix([1, 2, 3]).device_tokens == 1
    dropped: list[int] = []
    assert tree.evict_device(1, drop_host=dropped.extend) == [0]
    assert sorted(dropped) == [7, 8] and tree.host_pages == 0
    m = tree.match_prefix([1, 2, 3])
    assert m.device_tokens == m.host_tokens == 0
    tree.check(device_free=[0, 1, 2], device_total=3, host_free=[7, 8], host_total=2)


def test_lru_order_and_host_only_demotion() -> None:
    tree = HiRadixTree(1)
    tree.insert([1, 2], device_pages=[0, 1])
    tree.insert([3, 4], device_pages=[2, 3])
    tree.insert([5, 6], device_pages=[4, 5])
    tree.match_prefix([1, 2])
    n = tree.match_prefix([3, 4]).last_node  # LRU order now: [5,6], [1,2], [3,4]
    tree.set_host(n, [7, 8])
    assert sorted(tree.evict_device(2)) == [4, 5]
    assert tree.match_prefix([5, 6]).device_tokens == 0  # no host copy: removed
    assert sorted(tree.evict_device(1)) == [0, 1]  # a whole node goes at once
    assert sorted(tree.evict_device(2)) == [2, 3]
    m = tree.match_prefix([3, 4])
    assert (m.device_tokens, m.host_tokens) == (0, 2)  # backed up: demoted to host-only
    assert tree.evict_host(5) == [7, 8]
    assert tree.match_prefix([3, 4]).host_tokens == 0
    tree.check(device_free=list(range(6)), device_total=6, host_free=[7, 8], host_total=2)


def test_split_keeps_per_page_fields_and_locks() -> None:
    tree = HiRadixTree(2)
    tree.insert([1, 2, 3, 4, 5, 6], device_pages=[10, 11, 12])
    full = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    tree.set_host(full, [20, 21, 22])
    tree.page_hashes(full)
    tree.lock(full)
    m = tree.match_prefix([1, 2, 3, 4, 9, 9])  # splits after 4 tokens
    assert m.device_page_ids == (10, 11)
    upper = m.last_node
    assert upper.host == [20, 21] and full.host == [22] and full.device == [12]
    assert upper.lock_ref == 1 and full.lock_ref == 1
    tree.unlock(full)
    assert upper.lock_ref == 0
    tree.check()


def test_transient_life_cycle_and_abort_handover() -> None:
    tree = HiRadixTree(1)
    tree.insert([1, 2], owner="A")
    tree.insert([1, 2, 3], owner="B")
    m = tree.match_prefix([1, 2, 3])
    assert m.transient_tokens == 3 and m.transient_owners == ("A", "B")
    tree.mark_in_flight("A")
    tree.remove_transient("A")  # B's node hangs below: A's nodes go to B
    m = tree.match_prefix([1, 2, 3])
    assert m.transient_tokens == 3 and m.transient_owners == ("B",)
    res = tree.insert([1, 2, 3], device_pages=[5, 6, 7])
    assert res.unused_pages == ()
    assert tree.match_prefix([1, 2, 3]).device_tokens == 3
    assert tree.owned_tokens("B") == 0
    tree.check()


def test_bad_input_raises_typed_errors() -> None:
    tree = HiRadixTree(2)
    with pytest.raises(TreeError):
        tree.insert([1, 2], device_pages=[1, 2])
    with pytest.raises(TreeError):
        tree.insert([1, 2])
    with pytest.raises(TreeError):
        tree.unlock(tree.insert([1, 2], device_pages=[0]).new_nodes[0])
    with pytest.raises(TreeError):
        HiRadixTree(0)


def test_bookkeeping_modules_do_not_import_jax() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import strata_jax.cache.radix_tree, strata_jax.cache.allocator, strata_jax.cache.hashing, "
        "strata_jax.cache.config, strata_jax.cache.storage, strata_jax.cache.storage_file; "
        "from strata_jax.cache import HiRadixTree, CacheConfig; "
        "sys.exit(1 if 'jax' in sys.modules else 0)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], cwd=str(__import__("pathlib").Path(__file__).parents[1])
        ).returncode
        == 0
    )


def test_device_pages_of_stops_at_the_device_prefix() -> None:
    tree = HiRadixTree(1)
    tree.insert([1, 2], device_pages=[0, 1])
    tree.insert([1, 2, 3, 4], device_pages=[0, 1, 2, 3])
    leaf = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.set_host(leaf, [9, 8])
    tree.evict_device(2)
    assert tree.device_pages_of(leaf) == [0, 1]


def test_host_insert_splits_at_start_page_and_reports_each_tier_change() -> None:
    tree = HiRadixTree(1)
    events: list[tuple[bool, str, tuple[int, ...]]] = []
    tree.tier_observer = lambda stored, tier, node: events.append((stored, tier, node.key))
    tree.insert([1, 2, 3], device_pages=[0, 1, 2])
    res = tree.insert([1, 2, 3, 4, 5], host_pages=[7, 8, 9], start_page=2)  # splits [1 2 3] after 2 tokens
    assert res.existing_tokens == 3 and res.unused_pages == () and [n.key for n in res.new_nodes] == [(4, 5)]
    assert [n.key for n in res.walk_path] == [(1, 2), (3,), (4, 5)]
    m = tree.match_prefix([1, 2, 3, 4, 5], touch=False)
    assert (m.device_tokens, m.host_tokens) == (3, 2) and m.device_page_ids == (0, 1, 2)
    assert tree.evict_device(1, drop_host=lambda pages: None) == [2]  # [3] is backed up: stays host-only
    assert events == [
        (True, "device", (1, 2, 3)),
        (True, "host", (3,)),
        (True, "host", (4, 5)),
        (False, "device", (3,)),
    ]
    assert (tree.device_pages, tree.host_pages, tree.evictable_device_pages()) == (2, 3, 2)
    with pytest.raises(TreeError):  # the prefix before start_page must have data
        tree.insert([9, 9, 9], host_pages=[6], start_page=2)
    tree.check(device_free=[2], device_total=3, host_free=[], host_total=3)
