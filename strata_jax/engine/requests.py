"""Engine-side request state and page tables (pure Python: shared by the engine and the simulator).

``TrackedRequest`` is what the engine keeps per live request beyond the
scheduler's view: its output stream, its device page table, the tree lock it
holds, its prefetch and its row of device state.  ``RequestPages`` performs every
page-table operation against the cache controller, so the rules about who owns
which page live in one place:

    admit      -> the uncomputed full pages become transient tree nodes; L3 prefetch starts
    pin_prefix -> (first chunk) the prefetch lands per its stop policy; the cached prefix is
                  re-matched and locked
    take_prefix-> host-only part of the prefix is loaded L2->L1; the page table starts as
                  the tree's device pages of the prefix
    ensure_pages -> own pages for the tokens this step computes
    publish_prefix -> (last chunk dispatched; every chunk with publish_chunks) full pages go to
                  the tree, the lock moves down
    release    -> finished: computed pages to the tree; aborted: own pages freed
    retract    -> preempted decode: KV to the tree, the request re-queues as transient

Pages may be handed to the tree, freed or reused while a dispatched step still
writes them: every later reader or writer of the pool (a step, a load's scatter, a
backup's gather) is dispatched after it and ordered behind it by the donated pool.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from strata_jax.api import SamplingParams, TokenLogprob, empty_tier_counts
from strata_jax.cache.controller import CacheController
from strata_jax.cache.handles import CacheFullError, PrefetchHandle, TransferHandle
from strata_jax.cache.radix_tree import PrefixMatch, TreeNode
from strata_jax.engine.output import OutputStream
from strata_jax.engine.sinks import OutputSink
from strata_jax.lora.registry import LoadedAdapter
from strata_jax.scheduler.plan import PrefillItem
from strata_jax.scheduler.request import ScheduledRequest
from strata_jax.tokenizer import IncrementalDetokenizer

log = logging.getLogger("strata_jax.engine")


@dataclass(eq=False)
class TrackedRequest:
    """Engine-side state of one live request.

    Device pages of the request (``page_table``), by owner::

        |<- shared_pages: tree-owned, pinned by lock(locked) ->|<- own pages: this request's ->|
        positions [0, computed) hold KV (or will, once the dispatched steps run); own pages
        are inserted into the tree (adopted) when the request finishes or is retracted,
        and freed when it aborts.

    Token progress (``computed``, ``generated``, ``output_ids``) is the scheduler's record's
    (``req``, set when the request is queued): read here, never counted twice.  Its row of
    device state while it runs is the executor's (keyed by request id).
    """

    request_id: str
    prompt_ids: list[int]
    namespace: str
    params: SamplingParams
    sink: OutputSink
    detok: IncrementalDetokenizer | None
    submitted_at: float
    req: ScheduledRequest | None = None  # the scheduler's record, from admission on
    page_table: list[int] = field(default_factory=list)
    shared_pages: int = 0
    locked: TreeNode | None = None
    match: PrefixMatch | None = None  # pinned at the start of a step, loaded after the decode dispatch
    prefetch: PrefetchHandle | None = None
    cached: dict[str, int] = field(default_factory=empty_tier_counts)
    finishing: bool = False  # its last token is dispatched (length): the scheduler is done with it
    # prompt logprobs: collected over the prefill chunks, delivered with the first token
    prompt_logprobs: list[TokenLogprob] | None = None
    # n > 1: a follower (another choice of the same prompt) is admitted only once its
    # leader's prefill has published the prompt's pages, so it hits them instead of
    # computing the same prefix beside it
    follows: str | None = None
    followers: list[TrackedRequest] = field(default_factory=list)
    prefix_published: bool = False
    grammar: Any = None  # strata_jax.structured.matcher.GrammarState: a structured output's matcher
    adapter: LoadedAdapter | None = None  # its LoRA adapter (None: the base model)
    stream: OutputStream = field(init=False)

    @property
    def adapter_slot(self) -> int:
        """Its LoRA adapter's device slot (-1: the base model)."""
        return self.adapter.slot if self.adapter is not None else -1

    def __post_init__(self) -> None:
        self.stream = OutputStream(
            self.request_id,
            self.sink,
            self.params,
            len(self.prompt_ids),
            self.submitted_at,
            detok=self.detok,
            final_only=getattr(self.sink, "final_only", False),
        )

    @property
    def computed(self) -> int:
        """Positions whose KV is on the device or being computed there (the scheduler's count)."""
        return self.req.computed if self.req is not None else 0

    @property
    def generated(self) -> int:
        """Samples dispatched (the scheduler's count)."""
        return self.req.generated if self.req is not None else 0

    @property
    def output_ids(self) -> Sequence[int]:
        """Output token values read back so far."""
        return self.req.output_token_ids if self.req is not None else ()

    @property
    def bypasses_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, which a cache hit skips:
        such a request recomputes its whole prompt (it still publishes its KV)."""
        return self.params.prompt_logprobs is not None and not self.generated

    def prompt_logprob_targets(self, start: int, end: int) -> list[int] | None:
        """For prefill positions [start, end): the next prompt token, -1 past the prompt."""
        if not self.bypasses_cache:
            return None
        n = len(self.prompt_ids)
        return [self.prompt_ids[p + 1] if p + 1 < n else -1 for p in range(start, end)]


class RequestPages:
    """Page-table operations of live requests against one ``CacheController``."""

    def __init__(self, ctl: CacheController[Any]) -> None:
        self.ctl = ctl
        self.page_size = ctl.page_size

    def admit(self, t: TrackedRequest, prompt: tuple[int, ...] | None = None) -> PrefixMatch | None:
        """A new request: its uncomputed full pages become transient nodes it owns; L3 prefetch starts.

        ``prompt``: ``t.prompt_ids`` as a tuple if the caller has one (the scheduler's
        ``prefill_tokens``: the returned match is then a hint for its later matches).
        Returns the admission match (None if there is no full page or it bypasses the cache).
        """
        full = len(t.prompt_ids) // self.page_size * self.page_size
        if not full:
            return None
        if prompt is None:
            prompt = tuple(t.prompt_ids)  # converted once, not by each tree walk
        inserted = self.ctl.insert_transient(prompt, t.namespace, t.request_id)  # its full pages
        if t.bypasses_cache:
            return None
        match = self.ctl.match_prefix(prompt, t.namespace, requester=t.request_id, touch=False, hint=inserted)
        t.prefetch = self.ctl.prefetch(prompt, t.namespace, match, t.request_id)
        return match

    def pin_prefix(self, t: TrackedRequest, item: PrefillItem) -> None:
        """First chunk: land the L3->L2 prefetch (per its stop policy), re-match, lock the prefix."""
        if t.prefetch is not None:
            self.ctl.finish_prefetch(t.prefetch)
            t.prefetch = None
        # Only what the plan takes, [0, item.start) (page-aligned, short of the prompt's end):
        # it budgeted device pages for loading that much.  A prefix cached beyond it since (the
        # request's own L3 prefetch landed after the plan chose not to wait for it) is neither
        # matched nor loaded here, or its load would take pages the plan gave the step's other
        # rows ("out of device KV memory").  (So no hint: the plan matched the whole prompt.)
        prefix = item.request.prefill_tokens[: item.start]
        t.match = self.ctl.match_prefix(prefix, t.namespace, requester=t.request_id)
        if t.bypasses_cache:
            t.match = without_cache(t.match, self.ctl.tree.root(t.namespace))
        self.ctl.lock(t.match.last_node)
        t.locked = t.match.last_node
        # layer groups: the window before the match end stays until the prefix is taken
        m = t.match
        self.ctl.pin_local(t.request_id, list(m.device_page_ids), m.device_tokens + m.host_tokens)

    def take_prefix(self, t: TrackedRequest, item: PrefillItem) -> tuple[TransferHandle | None, int]:
        """Load the pinned prefix's host-only part L2->L1; the page table starts as its device pages.

        Returns the load (None: nothing to load) and the tokens of the prefix taken (at most
        ``item.start``: the chunk computes from there)."""
        match, t.match = t.match, None
        assert match is not None  # pinned by pin_prefix in this step
        handle = None
        try:
            if not item.recomputed_cached_tokens:  # load-or-recompute chose to recompute the L2/L3 part
                handle = self.ctl.load(match, t.request_id, use_tokens=item.start)
        except CacheFullError:
            log.warning("no device room to load the cached prefix of %s; recomputing it", t.request_id)
        pages = self.ctl.tree.device_pages_of(match.last_node)
        usable = min(len(pages) * self.page_size, item.start)
        # layer groups: a prefix cut short of the match (a recomputed tail) must end at a
        # complete window too, or its first new token would miss local KV it attends to
        usable = self.ctl.complete_window_end(pages, usable // self.page_size) * self.page_size
        t.page_table = list(pages[: usable // self.page_size])
        t.shared_pages = len(t.page_table)
        device = min(item.device_hit_tokens, usable)
        host = min(item.load_host_tokens, usable - device)
        t.cached = {"device": device, "host": host, "storage": usable - device - host}
        self.ctl.pin_local(t.request_id, t.page_table, usable)
        self.ctl.mark_in_flight(t.request_id)
        return handle, usable

    def ensure_pages(self, t: TrackedRequest, tokens: int, computed: int | None = None) -> None:
        """Own device pages so that positions ``[0, tokens)`` have a slot (may evict; may raise
        CacheFullError).  ``computed``: ``t.computed`` when the caller has it at hand (the
        scheduler's record: this runs per decode row per step)."""
        need = -(-tokens // self.page_size) - len(t.page_table)
        if need <= 0 and not self.ctl.windows.moves:
            return  # the usual decode row: a slot on its last page, no window to move
        if computed is None:
            computed = t.computed
        pin = self.ctl.windows.pin
        # layer groups: local KV before this step's window becomes evictable before anything is allocated
        pin(t.request_id, t.page_table, computed)
        if need > 0:
            pages = self.ctl.alloc_device(need)
            try:
                self.ctl.attach_local(pages)  # this step writes their local-layer KV
            except CacheFullError:
                self.ctl.free_device(pages)
                raise
            t.page_table.extend(pages)
            pin(t.request_id, t.page_table, computed)

    def publish_prefix(
        self, t: TrackedRequest, tokens: Sequence[int], hint: PrefixMatch | None = None, *, last: bool = True
    ) -> int | None:
        """The prefill is dispatched: hand its full pages to the tree (transient -> ready) and re-pin them.

        ``hint``: a match of the same ``tokens`` object (``HiRadixTree.insert``).  ``last``
        False: a chunk that is not the prompt's last (``publish_chunks``): the pages computed so
        far go to the tree, the prompt's transient nodes beyond them stay the request's.
        Returns the first page-table entry replaced by the tree's page (None: none was).
        """
        full = t.computed // self.page_size
        if not last and full <= t.shared_pages:
            return None  # no new full page since the last publish
        if full != len(tokens) // self.page_size:  # (the tree inserts full pages only)
            tokens, hint = tokens[: full * self.page_size], None
        assert t.locked is not None  # pin_prefix locked the matched prefix
        t.locked, table = self.ctl.cache_unfinished(tokens, t.namespace, t.page_table[:full], t.locked, hint=hint)
        if last:
            self.ctl.finish_request(t.request_id)
        # Duplicate pages (someone inserted the same tokens first) were freed: use the tree's.
        replaced = None
        for i, page in enumerate(table):
            if t.page_table[i] != page:
                t.page_table[i] = page
                replaced = i if replaced is None else replaced
        t.shared_pages = full
        self.ctl.pin_local(t.request_id, t.page_table, t.computed)
        return replaced

    def release(self, t: TrackedRequest, *, keep: bool) -> None:
        """Give back a request's pages: keep=True hands computed full pages to the tree."""
        ps = self.page_size
        self.ctl.unpin_local(t.request_id)  # its window's local KV stays, evictable
        if keep and t.computed:
            full = t.computed // ps
            n, prompt = full * ps, t.prompt_ids
            tokens = tuple(prompt[:n]) if n <= len(prompt) else (*prompt, *t.output_ids[: n - len(prompt)])
            if len(tokens) != n:
                raise RuntimeError(f"request {t.request_id}: {n} tokens computed but only {len(tokens)} known")
            self.ctl.insert(tokens, t.namespace, t.page_table[:full])
            self.ctl.free_device(t.page_table[full:])
        else:
            self.ctl.free_device(t.page_table[t.shared_pages :])
        t.page_table, t.shared_pages = [], 0
        if t.locked is not None:
            self.ctl.unlock(t.locked)
            t.locked = None
        if t.prefetch is not None:
            self.ctl.cancel_prefetch(t.prefetch)
            t.prefetch = None
        self.ctl.abort(t.request_id)  # transient nodes it still owns

    def retract(self, t: TrackedRequest) -> None:
        """Preempted decode: its KV goes to the tree (backed up per write policy), it re-queues."""
        self.release(t, keep=True)
        tokens = (*t.prompt_ids, *t.output_ids)
        full = len(tokens) // self.page_size * self.page_size
        if full:
            self.ctl.insert_transient(tokens[:full], t.namespace, t.request_id)


def without_cache(match: PrefixMatch, root: TreeNode) -> PrefixMatch:
    """The match of a request that must not read the cache: nothing hit, nothing to wait for."""
    return dataclasses.replace(
        match,
        device_tokens=0,
        host_tokens=0,
        storage_tokens=0,
        transient_tokens=0,
        transient_owners=(),
        device_page_ids=(),
        last_node=root,
        storage_keys=(),
    )
