"""``match_prefix(hint=...)`` / ``insert(hint=...)`` against fresh walks and a brute-force match.

A hinted match re-checks the earlier walk's path node by node instead of token by
token (``strata_jax/cache/radix_tree.py``).  Here a handful of fixed prompts keep
their last match as the hint while random inserts (device, host, transient),
splits, locks, backups, loads, L1/L2 evictions and aborts reshape the tree in
between; every hinted match must equal a fresh walk's (same counts, owners, page
ids, lock handle) and a brute-force match over a page-prefix export of the tree;
every hinted insert must leave the tree exactly as an unhinted insert leaves a
deep copy of it (same pages per tier, states, owners; same result).
The tier indexes behind eviction are checked by ``tree.check()`` after each step.
"""

from __future__ import annotations

import copy
import random

import pytest

from strata_jax.cache.radix_tree import HiRadixTree, TreeNode


def export(tree: HiRadixTree, ns: str) -> dict[tuple, TreeNode]:
    """Page prefix (tuple of page tuples) -> the node holding its last page (plain traversal)."""
    ps = tree.page_size
    out: dict[tuple, TreeNode] = {}
    stack = [(tree.root(ns), ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            pre = prefix
            for i in range(0, len(child.key), ps):
                pre = pre + (tuple(child.key[i : i + ps]),)
                out[pre] = child
            stack.append((child, pre))
    return out


def tiers(tree: HiRadixTree, ns: str) -> dict[tuple, tuple]:
    return {
        pre: (
            n.device and n.device[len(pre) - 1 - n_start(n, tree)],
            n.host and n.host[len(pre) - 1 - n_start(n, tree)],
            n.state,
            n.owner,
            n.lock_ref,
        )
        for pre, n in export(tree, ns).items()
    }


def n_start(node: TreeNode, tree: HiRadixTree) -> int:
    """Page index at which ``node``'s key starts on its path."""
    pages = 0
    x = node.parent
    while x is not None and x.parent is not None:
        pages += len(x.key) // tree.page_size
        x = x.parent
    return pages


def brute_force(tree: HiRadixTree, ns: str, tokens: tuple[int, ...], requester) -> tuple[int, int, int, tuple]:
    ps = tree.page_size
    pages = export(tree, ns)
    dev = host = trans = 0
    owners: list = []
    phase = 0
    pre: tuple = ()
    for i in range(len(tokens) // ps):
        pre = pre + (tuple(tokens[i * ps : (i + 1) * ps]),)
        node = pages.get(pre)
        if node is None:
            break
        if node.is_transient and requester is not None and node.owner == requester:
            break
        if phase == 0 and node.device is not None:
            dev += ps
        elif phase <= 1 and node.host is not None and node.device is None:
            phase = 1
            host += ps
        else:
            assert node.is_transient
            phase = 2
            trans += ps
            if node.owner not in owners:
                owners.append(node.owner)
    return dev, host, trans, tuple(owners)


class Driver:
    def __init__(self, seed: int, ps: int) -> None:
        self.rng = random.Random(seed)
        self.ps = ps
        self.tree = HiRadixTree(ps)
        self.next_page = 0
        self.locks: list[TreeNode] = []
        base = [self.rng.randrange(3) for _ in range(8 * ps)]
        # Prompts sharing prefixes of different lengths, as documents and their questions do.
        self.prompts = [tuple(base[: self.rng.randrange(1, 8 * ps)] + self._seq(0, 4 * ps)) for _ in range(8)]
        self.hints: dict[tuple[int, tuple], object] = {}

    def _seq(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(3) for _ in range(self.rng.randrange(lo, hi + 1))]

    def _pages(self, n: int) -> list[int]:
        self.next_page += n
        return list(range(self.next_page - n, self.next_page))

    def _some_tokens(self) -> tuple[int, ...]:
        p = self.rng.choice(self.prompts)
        if self.rng.random() < 0.5:
            return p[: self.rng.randrange(0, len(p) + 1)]
        return p[: self.rng.randrange(0, len(p) + 1)] + tuple(self._seq(0, 3 * self.ps))

    def step(self) -> None:
        t, ps, rng = self.tree, self.ps, self.rng
        op = rng.randrange(10)
        toks = self._some_tokens()
        npages = len(toks) // ps
        if op == 0:
            res = t.insert(toks, device_pages=self._pages(npages))
            assert res.last_node is t.match_prefix(toks, touch=False).last_node or npages == 0
        elif op == 1:
            m = t.match_prefix(toks, touch=False)
            start = (m.device_tokens + m.host_tokens) // ps
            t.insert(toks, host_pages=self._pages(npages - start), start_page=start)
        elif op == 2:
            t.insert(toks, owner=rng.choice(["r1", "r2", "r3"]))
        elif op == 3:
            owner = rng.choice(["r1", "r2", "r3"])
            if rng.random() < 0.5:
                t.mark_in_flight(owner)
            else:
                t.remove_transient(owner)
        elif op == 4:  # a touching match splits where it ends
            m = t.match_prefix(toks, requester=rng.choice([None, "r1"]))
            if m.last_node.parent is not None and rng.random() < 0.5:
                t.lock(m.last_node)
                self.locks.append(m.last_node)
        elif op == 5 and self.locks:
            t.unlock(self.locks.pop(rng.randrange(len(self.locks))))
        elif op == 6:  # backups of device-only nodes
            for node in list(t.iter_nodes()):
                if node.device is not None and node.host is None and rng.random() < 0.5:
                    t.set_host(node, self._pages(len(node.key) // ps))
        elif op == 7:  # loads of host-only nodes below the device prefix
            for node in list(t.iter_nodes()):
                parent_on_device = node.parent.parent is None or node.parent.device is not None
                if node.device is None and node.host is not None and parent_on_device and rng.random() < 0.5:
                    t.set_device(node, self._pages(len(node.key) // ps))
        elif op == 8:
            backup = (lambda node: self._pages(len(node.device))) if rng.random() < 0.5 else None
            t.evict_device(rng.randrange(1, 6), backup, (lambda pages: None) if rng.random() < 0.5 else None)
        else:
            t.evict_host(rng.randrange(1, 6))
        t.check()

    def check_hinted_matches(self) -> None:
        for tokens in self.prompts:
            requester = self.rng.choice([None, "r2"])
            key = (id(tokens), requester)
            expected = brute_force(self.tree, "", tokens, requester)
            hinted = self.tree.match_prefix(tokens, requester=requester, touch=False, hint=self.hints.get(key))
            fresh = self.tree.match_prefix(tokens, requester=requester, touch=False)
            for m in (hinted, fresh):
                assert (m.device_tokens, m.host_tokens, m.transient_tokens, m.transient_owners) == expected
            assert hinted.device_page_ids == fresh.device_page_ids
            assert hinted.last_node is fresh.last_node
            assert hinted.walk_path == fresh.walk_path and hinted.walk_lens == fresh.walk_lens
            self.hints[key] = hinted if self.rng.random() < 0.8 else fresh

    def check_hinted_insert(self) -> None:
        tokens = self.rng.choice(self.prompts)
        key = (id(tokens), None)
        hint = self.hints.get(key)
        twin = copy.deepcopy(self.tree)  # the same tree, other objects: inserted without a hint
        npages = len(tokens) // self.ps
        mode = self.rng.randrange(3)
        if mode == 0:
            kw: dict = {"device_pages": self._pages(npages)}
        elif mode == 1:
            m = self.tree.match_prefix(tokens, touch=False)
            twin.match_prefix(tokens, touch=False)  # (a match may split: keep the twin in step)
            start = (m.device_tokens + m.host_tokens) // self.ps
            if m.transient_tokens:
                return  # data below a transient node: a TreeError either way
            kw = {"host_pages": self._pages(npages - start), "start_page": start}
        else:
            kw = {"owner": self.rng.choice(["r1", "r2"])}
        res = self.tree.insert(tokens, hint=hint, **kw)
        ref = twin.insert(tokens, hint=None, **kw)
        assert (res.existing_tokens, res.unused_pages, len(res.new_nodes)) == (
            ref.existing_tokens,
            ref.unused_pages,
            len(ref.new_nodes),
        )
        assert tiers(self.tree, "") == tiers(twin, "")
        self.tree.check()
        self.hints[key] = res  # an insert's walk is a hint for the next match


@pytest.mark.parametrize("ps", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_hinted_match_equals_fresh_walk_and_brute_force(seed: int, ps: int) -> None:
    d = Driver(seed, ps)
    for _ in range(150):
        d.step()
        d.check_hinted_matches()
        d.check_hinted_insert()


def test_hint_of_other_tokens_or_namespace_is_ignored() -> None:
    tree = HiRadixTree(2)
    a, b = (1, 2, 3, 4, 5, 6), (1, 2, 9, 9)
    tree.insert(a, device_pages=[0, 1, 2])
    tree.insert(b, device_pages=[0, 7])
    hint_a = tree.match_prefix(a, touch=False)
    m = tree.match_prefix(b, touch=False, hint=hint_a)  # not the same tokens object: a fresh walk
    assert m.device_page_ids == (0, 7)
    tree.insert(a, "other", device_pages=[10, 11, 12])
    m = tree.match_prefix(a, "other", touch=False, hint=hint_a)
    assert m.device_page_ids == (10, 11, 12)
    same_content = a[:3] + a[3:]
    assert same_content is not a
    assert tree.match_prefix(same_content, touch=False, hint=hint_a).device_page_ids == (0, 1, 2)


def test_hinted_insert_compares_nodes_that_replaced_the_hinted_path() -> None:
    """The hinted walk's tail was evicted and another prompt grew there: its node must be compared."""
    tree = HiRadixTree(2)
    a = (1, 1, 2, 2, 3, 3, 4, 4)
    tree.insert(a[:2], device_pages=[0])
    tree.insert(a, device_pages=[0, 1, 2, 3])
    hint = tree.match_prefix(a, touch=False)
    tree.evict_device(3, drop_host=lambda pages: None)  # the tail [2 2 3 3 4 4] goes
    tree.insert((1, 1, 2, 2, 9, 9, 9, 9), device_pages=[0, 5, 6, 7])  # diverges inside the new node
    res = tree.insert(a, hint=hint, device_pages=[0, 10, 11, 12])
    tree.check()
    assert res.existing_tokens == 4
    m = tree.match_prefix(a, touch=False)
    assert m.device_page_ids == (0, 5, 11, 12)
    assert tree.match_prefix((1, 1, 2, 2, 9, 9, 9, 9), touch=False).device_page_ids == (0, 5, 6, 7)
