"""Drive a ``CacheController`` the way the engine does, one request at a time (for benchmarks).

No model: the "prefill" of a request only allocates device pages for the tokens
nobody had cached and, with a data-moving controller, fills them with KV values
derived from the pages' chain keys (so a later hit can be verified bit-exactly
wherever it came from).  Requests are served sequentially; transfers are waited
for, so the hit rates are those of the cache policy, not of timing.

Per request::

    match -> lock -> [prefetch L3->L2, finish, re-match] -> [load L2->L1]
          -> alloc pages for the uncached suffix -> (fill KV) -> insert -> unlock
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata_jax.cache.controller import CacheController, CacheFullError
from strata_jax.cache.device_transfers import DeviceTransfers
from strata_jax.cache.hashing import chain_hashes


@dataclass(frozen=True)
class ServedRequest:
    """Where a request's prompt tokens came from (tokens; page-aligned)."""

    prompt_tokens: int
    device: int
    host: int
    storage: int
    fit: bool  # False: the request did not fit in L1 next to locked data; nothing was cached

    @property
    def cached(self) -> int:
        return self.device + self.host + self.storage


class CacheReplayer:
    def __init__(self, controller: CacheController[Any], *, verify: bool = False) -> None:
        self.ctl = controller
        # the pool pages are filled and checked in (a controller that moves no bytes has none)
        self._pool = controller.transfers.device_pool if isinstance(controller.transfers, DeviceTransfers) else None
        self._layout = controller.transfers.layout if isinstance(controller.transfers, DeviceTransfers) else None
        self.verify = verify and self._pool is not None
        self.verified_pages = 0

    def _fill_values(self, namespace: str, tokens: Sequence[int], first_page: int, last_page: int) -> np.ndarray:
        keys = chain_hashes(self.ctl.tree.seed(namespace), tokens[: last_page * self.ctl.page_size], self.ctl.page_size)
        return np.array([int.from_bytes(k[:3], "little") for k in keys[first_page:last_page]], dtype=np.float32)

    def serve(
        self, prompt: Sequence[int], output: Sequence[int], namespace: str = "", request_id: object = None
    ) -> ServedRequest:
        ctl = self.ctl
        ps = ctl.page_size
        m = ctl.match_prefix(prompt, namespace, requester=request_id)
        served = (m.device_tokens, m.host_tokens, m.storage_tokens)
        anchor = m.last_node
        ctl.lock(anchor)
        if m.storage_tokens:
            pf = ctl.prefetch(prompt, namespace, m, request_id)
            landed = 0 if pf is None else ctl.finish_prefetch(pf)
            served = (m.device_tokens, m.host_tokens, landed)  # only what reached L2 is served
            if pf is not None:
                m = ctl.match_prefix(prompt, namespace, requester=request_id, touch=False)
                ctl.lock(m.last_node)
                ctl.unlock(anchor)
                anchor = m.last_node
        full = tuple(prompt) + tuple(output)
        n_full = len(full) // ps
        try:
            handle = ctl.load(m, request_id)
            ctl.wait(handle)
            prefix_pages = ctl.tree.device_pages_of(anchor)
            if self.verify and prefix_pages:
                self._verify(namespace, full, prefix_pages)
            new_pages = ctl.alloc_device(n_full - len(prefix_pages))
        except CacheFullError:
            ctl.unlock(anchor)
            return ServedRequest(len(prompt), *served, fit=False)
        # Page table of this request:
        #   |<- prefix_pages: tree-owned, locked ->|<- new_pages: ours until insert ->|
        # insert() hands new_pages to the tree (duplicates are freed there).
        if self._pool is not None and new_pages:
            self._fill(namespace, full, len(prefix_pages), new_pages)
        ctl.insert(full, namespace, list(prefix_pages) + new_pages)
        ctl.unlock(anchor)
        return ServedRequest(len(prompt), *served, fit=True)

    def _fill(self, namespace: str, tokens: Sequence[int], first_page: int, pages: list[int]) -> None:
        from strata_jax.cache.pools import bucket

        layout, pool = self._layout, self._pool
        assert layout is not None and pool is not None  # only called with a pool
        values = self._fill_values(namespace, tokens, first_page, first_page + len(pages))
        staging = np.zeros(layout.page_first_shape(bucket(len(pages))), np.float32)
        staging[: len(pages)] = values.reshape(-1, 1, 1, 1, 1, 1)
        pool.load_pages(staging.astype(np.dtype(pool.kv.dtype)), pages)

    def _verify(self, namespace: str, tokens: Sequence[int], pages: list[int]) -> None:
        assert self._pool is not None  # verify needs a pool
        got = np.asarray(self._pool.gather_pages(pages))[: len(pages)].astype(np.float32)
        want = self._fill_values(namespace, tokens, 0, len(pages)).reshape(-1, 1, 1, 1, 1, 1)
        if not np.array_equal(got, np.broadcast_to(want, got.shape)):
            bad = int(np.argmax(~np.all(got.reshape(len(pages), -1) == want.reshape(-1, 1), axis=1)))
            raise AssertionError(f"cached KV of page {bad} differs from what was computed for it")
        self.verified_pages += len(pages)
