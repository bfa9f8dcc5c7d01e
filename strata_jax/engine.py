"""Engine: submit / step / generate / stream over the model, the hierarchical cache and the scheduler.

One engine step is five calls (DESIGN §2)::

    poll -> schedule -> issue loads -> run (extend / decode) -> postprocess

The step loop runs on the engine's own thread; every public method is thread-safe
(it validates in the caller's thread, then hands work to the loop through an inbox).
The scheduler decides, the runner computes, the cache controller owns pages and
transfers; this module only wires them and keeps each request's page table.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.api import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestAbortedError,
    RequestOutput,
    SamplingParams,
    StreamChunk,
    empty_tier_counts,
)
from strata_jax.cache.controller import CacheController, CacheFullError, PrefetchHandle
from strata_jax.cache.radix_tree import PrefixMatch, TreeNode
from strata_jax.engine_config import EngineConfig
from strata_jax.engine_io import AsyncQueueSink, CollectingSink, OutputSink
from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import ModelRunner, PendingStep, RunnerConfig, SeqInput
from strata_jax.runtime.platform import resolve as resolve_platform
from strata_jax.runtime.sampling import request_rng_key
from strata_jax.scheduler.cost_model import CostModel, CostPrior
from strata_jax.scheduler.plan import PrefillItem, StepPlan
from strata_jax.scheduler.request import RequestStatus, ScheduledRequest
from strata_jax.scheduler.scheduler import Scheduler
from strata_jax.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


def span(name: str) -> jax.profiler.TraceAnnotation:
    return jax.profiler.TraceAnnotation(name)


@dataclass
class _Tracked:
    """Engine-side state of one live request.

    Device pages of the request (``page_table``), by owner::

        |<- shared_pages: tree-owned, pinned by lock(locked) ->|<- own pages: this request's ->|
        positions [0, computed) hold KV; own pages are inserted into the tree (adopted)
        when the request finishes or is retracted, and freed when it aborts.
    """

    request_id: str
    prompt_ids: list[int]
    namespace: str
    params: SamplingParams
    sink: OutputSink
    detok: IncrementalDetokenizer | None
    submitted_at: float
    output_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    shared_pages: int = 0
    computed: int = 0
    locked: TreeNode | None = None
    match: PrefixMatch | None = None  # pinned at the start of a step, loaded after the decode dispatch
    prefetch: PrefetchHandle | None = None
    cached: dict[str, int] = field(default_factory=empty_tier_counts)
    first_token_at: float | None = None
    text: str = ""
    emitted_tokens: int = 0


class _CacheView:
    """The scheduler's read-only window on the cache (``strata_jax.scheduler.cache_view.CacheView``)."""

    def __init__(self, ctl: CacheController):
        self.ctl = ctl
        self.page_size = ctl.page_size

    def match(self, request: ScheduledRequest):
        return self.ctl.match_prefix(request.prefill_tokens, request.namespace, requester=request.request_id, touch=False)

    def load_pending(self, request_id: str) -> bool:
        return self.ctl.load_pending(request_id)

    def free_device_tokens(self) -> int:
        return self.ctl.free_device_tokens()

    def evictable_device_tokens(self) -> int:
        return self.ctl.evictable_device_tokens()


class Engine:
    """Serving engine; see ``strata_jax.api`` for the request/response types."""

    def __init__(self, config: EngineConfig | None = None, *, start: bool = True):
        self.config = config = config or EngineConfig()
        self.platform = resolve_platform(dtype=config.dtype, kv_dtype=config.kv_dtype, kernel_backend=config.kernel_backend)
        dtype, kv_dtype = self.platform.dtype, self.platform.kv_dtype
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
        loaded = load_model(config.model, dtype=jnp.dtype(dtype), show_progress=config.show_progress)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.generation_defaults = loaded.generation  # generation_config.json: request defaults
        self.vocab_size = loaded.config.vocab_size
        model_limit = loaded.config.max_context_tokens
        self.max_context_tokens = self.platform.max_context_tokens(model_limit, config.max_context_tokens)
        if self.max_context_tokens > model_limit:
            raise InvalidRequestError(f"max_context_tokens={self.max_context_tokens} exceeds the model's {model_limit}")

        from pallas_kernels.layout import KVLayout

        cache_config = config.cache_config(self.max_context_tokens)
        self.page_size = cache_config.page_size
        layout = KVLayout(loaded.config.num_layers, loaded.config.num_kv_heads, loaded.config.head_dim, self.page_size, kv_dtype)
        self.ctl = CacheController(cache_config, layout)
        self.runner = ModelRunner(
            loaded.model,
            RunnerConfig(
                page_size=self.page_size,
                num_device_pages=cache_config.num_device_pages,
                max_batch_tokens=config.max_batch_tokens,
                max_batch_size=config.max_batch_size,
                max_context_tokens=self.max_context_tokens,
                kv_dtype=kv_dtype,
                kernel_backend=self.platform.kernel_backend,
            ),
            pool=self.ctl.device_pool,
        )
        cost = CostModel(CostPrior(bytes_per_token=layout.token_bytes, link_bytes_per_s=self.ctl.link_bandwidth))
        self.scheduler = Scheduler(config.scheduler_config(), cost)
        self._view = _CacheView(self.ctl)
        self._tracked: dict[str, _Tracked] = {}
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._inbox_size = 0
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self.compiles_at_warmup = 0
        self.counters = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "finished": 0, "aborted": 0, "failed": 0}
        self.is_ready = False
        self.transfer_compiles_at_warmup = 0
        if config.warmup:
            self.compiles_at_warmup = self.runner.warmup(show_progress=config.show_progress)
            self.ctl.warmup_transfers()  # or the first L2 hit compiles its scatter while serving
            self.transfer_compiles_at_warmup = self._transfer_compiles()
        self.is_ready = True
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (concurrently) and return their outputs in order."""
        batch = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(batch))
        sinks = []
        for prompt, p in zip(batch, params_list):
            sink = CollectingSink()
            ids = self._prompt_ids(prompt)
            rid = self.submit(ids, p, cache_salt=cache_salt, sink=sink)
            sinks.append((rid, ids, sink))
        outputs = []
        for rid, ids, sink in sinks:
            sink.wait()
            if sink.error is not None:
                raise sink.error
            out = _collect(rid, sink.chunks)
            out.prompt_token_ids = ids
            outputs.append(out)
        return outputs

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Yield a request's chunks as they are produced; closing the iterator aborts it."""
        sink = AsyncQueueSink(asyncio.get_running_loop())
        rid = self.submit(prompt, params or SamplingParams(), cache_salt=cache_salt, request_id=request_id, sink=sink)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away: abort without blocking its event loop
                self.abort(rid, wait=False)

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        sink: OutputSink | None = None,
    ) -> str:
        """Validate and queue one request; returns its id.  Raises on bad input or overload."""
        if self._stopping or not self.is_ready:
            raise EngineUnavailableError("the engine is not accepting requests (warming up or shutting down)")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        prompt_ids = self._prompt_ids(prompt)
        self._check_fits(prompt_ids, params)
        namespace = _namespace(cache_salt)
        if self.scheduler.num_waiting + self._inbox_size >= self.scheduler.config.max_waiting:
            raise OverloadedError(
                f"server overloaded: {self.scheduler.num_waiting} requests waiting "
                f"(max_waiting={self.scheduler.config.max_waiting}); retry later"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise InvalidRequestError("request_id must be a non-empty string of at most 256 characters")
        tracked = _Tracked(
            request_id=rid,
            prompt_ids=prompt_ids,
            namespace=namespace,
            params=params,
            sink=sink or CollectingSink(),
            detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
            submitted_at=time.perf_counter(),
        )
        self._post(lambda: self._admit(tracked))
        return rid

    def abort(self, request_id: str, *, wait: bool = True) -> bool:
        """Abort a request at any point; its pages are freed and its nodes unlocked.

        ``wait=False`` queues the abort and returns at once (True: queued).
        """
        def do() -> bool:
            return self._abort(request_id, RequestAbortedError(f"request {request_id} was aborted"))

        if not wait and self._thread is not None:
            self._post(do)
            return True
        return bool(self._call(do))

    def cache_stats(self) -> dict[str, Any]:
        return self._call(self._stats)

    def flush_cache(self, tier: str = "all") -> None:
        """Drop cached (unlocked) KV from ``device``, ``host``, ``storage`` or ``all`` tiers."""
        if tier not in ("device", "host", "storage", "all"):
            raise InvalidRequestError(f"tier must be device, host, storage or all, got {tier!r}")
        self._call(lambda: self._flush(tier))

    def check_accounting(self) -> dict[str, int]:
        """Assert the cache invariants and exact page accounting; returns usage figures."""
        return self._call(self._check)

    def start_profile(self, log_dir: str) -> None:
        jax.profiler.start_trace(log_dir)
        self._profile_dir = log_dir

    def stop_profile(self) -> str:
        jax.profiler.stop_trace()
        return getattr(self, "_profile_dir", "")

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting work, let running requests finish within ``grace_s``, abort the rest."""
        if self._stopping:
            return
        self._stopping = True
        deadline = time.monotonic() + grace_s
        if self._thread is not None:
            while time.monotonic() < deadline and (self._tracked or self._inbox_size):
                time.sleep(0.01)
            self._call(self._abort_all)
            self._post(lambda: None)
            self._thread.join(timeout=30)
            self._thread = None
        else:
            self._abort_all()
        self.ctl.close()

    def compile_count(self) -> int:
        return self.runner.compile_count

    # ------------------------------------------------------------------ input checks (caller thread)
    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        return ids

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_context_tokens:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the context limit of {self.max_context_tokens} tokens"
            )
        pages = -(-total // self.page_size)
        if pages > self.ctl.device_alloc.num_pages:
            raise InvalidRequestError(
                f"request needs {pages} KV pages; the device pool has {self.ctl.device_alloc.num_pages}"
            )
        if params.repetition_penalty != 1.0:
            raise InvalidRequestError("repetition_penalty is not supported yet (use 1.0)")

    # ------------------------------------------------------------------ inbox (engine thread side)
    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox_size += 1
        self._inbox.put(fn)
        self._wake.set()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread (or here when there is none) and return its result."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(exc)

        self._post(run)
        return fut.result()

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._inbox_size -= 1
            fn()

    def _loop(self) -> None:
        while True:
            self._drain_inbox()
            if self._stopping and not self._tracked and self._inbox.empty():
                return
            if not self.scheduler.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - keep serving; fail what was running
                log.exception("engine step failed")
                self._fail_all(exc)

    def run_until_idle(self) -> None:
        """Drive the loop on the caller's thread (engines built with ``start=False``)."""
        self._drain_inbox()
        while self.scheduler.has_work():
            self.step()
            self._drain_inbox()

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        with span("poll"):
            self._poll()
        with span("schedule"):
            plan = self.scheduler.schedule(self._view)
        with span("load_kv"):
            dropped = self._pin_and_make_room(plan)
        prefill = [item for item in plan.prefill if item.request_id not in dropped]
        decode = [req for req in plan.decode if req.request_id not in dropped]
        produced: dict[str, int] = {}
        if plan.decode_first:
            # Bubble filling: the decode is dispatched before the loads, so the link
            # transfers run while the device decodes; the loads' scatters queue behind it.
            pending = self._dispatch_decode(decode)
            with span("load_kv"):
                dropped |= self._load_prefixes(prefill)
            produced.update(self._finish_decode(decode, pending))
            prefill = [item for item in prefill if item.request_id not in dropped]
            produced.update(self._run_extend(prefill))
        else:
            with span("load_kv"):
                dropped |= self._load_prefixes(prefill)
            prefill = [item for item in prefill if item.request_id not in dropped]
            produced.update(self._run_extend(prefill))
            produced.update(self._finish_decode(decode, self._dispatch_decode(decode)))
        with span("postprocess"):
            self._postprocess(prefill, decode, produced)
            for rid in dropped:  # their results never came: clear the scheduler's in-flight mark
                if any(item.request_id == rid for item in plan.prefill):
                    self.scheduler.on_prefill_done(rid)
                else:
                    self.scheduler.on_decode_done(rid, -1)
        self.counters["steps"] += 1
        if plan.is_empty:
            time.sleep(0.001)  # everything waits on a transfer or a deferral: don't spin

    def _poll(self) -> None:
        for handle in self.ctl.poll():
            if handle.kind == "load" and handle.seconds is not None:
                self.scheduler.cost.observe_load(handle.num_pages * self.page_size, handle.seconds, tier="host")

    def _pin_and_make_room(self, plan: StepPlan) -> set[str]:
        """Retractions; pin each first chunk's cached prefix; evict; pages for the decodes.

        Returns the requests that could not get device pages (aborted with an error;
        the scheduler's plan should never come to this, but the engine must not die).
        """
        for req in plan.retract:
            self._retract(self._tracked[req.request_id])
        for item in plan.prefill:
            if item.is_first_chunk:
                self._pin_prefix(self._tracked[item.request_id], item)
        if plan.evict_device_tokens:
            self.ctl.evict_device(-(-plan.evict_device_tokens // self.page_size))
        return self._allocate([(req.request_id, self._tracked[req.request_id].computed + 1) for req in plan.decode])

    def _allocate(self, work: list[tuple[str, int]]) -> set[str]:
        dropped: set[str] = set()
        for rid, tokens in work:
            try:
                self._ensure_pages(self._tracked[rid], tokens)
            except CacheFullError as exc:
                log.error("request %s: %s", rid, exc)
                self._abort(rid, OverloadedError(f"out of device KV memory: {exc}"))
                dropped.add(rid)
        return dropped

    def _pin_prefix(self, t: _Tracked, item: PrefillItem) -> None:
        """First chunk: land the L3->L2 prefetch (per its stop policy), re-match, lock the prefix."""
        if t.prefetch is not None:
            self.ctl.finish_prefetch(t.prefetch)
            t.prefetch = None
        t.match = self.ctl.match_prefix(item.request.prefill_tokens, t.namespace, requester=t.request_id)
        self.ctl.lock(t.match.last_node)
        t.locked = t.match.last_node

    def _load_prefixes(self, prefill: list[PrefillItem]) -> set[str]:
        """Load pinned host-only prefixes L2->L1 (one coalesced transfer each), then pages for the chunks."""
        for item in prefill:
            if item.is_first_chunk:
                self._take_prefix(self._tracked[item.request_id], item)
        return self._allocate([(item.request_id, item.end) for item in prefill])

    def _take_prefix(self, t: _Tracked, item: PrefillItem) -> None:
        match, t.match = t.match, None
        try:
            self.ctl.load(match, t.request_id)
        except CacheFullError:
            log.warning("no device room to load the cached prefix of %s; recomputing it", t.request_id)
        pages = self.ctl.tree.device_pages_of(match.last_node)
        usable = min(len(pages) * self.page_size, item.start)
        t.page_table = list(pages[: usable // self.page_size])
        t.shared_pages = len(t.page_table)
        t.computed = usable
        device = min(item.device_hit_tokens, usable)
        host = min(item.load_host_tokens, usable - device)
        t.cached = {"device": device, "host": host, "storage": usable - device - host}
        self.ctl.mark_in_flight(t.request_id)

    def _ensure_pages(self, t: _Tracked, tokens: int) -> None:
        need = -(-tokens // self.page_size) - len(t.page_table)
        if need > 0:
            t.page_table.extend(self.ctl.alloc_device(need))

    def _seq(self, t: _Tracked, tokens: list[int], start: int) -> SeqInput:
        p = t.params
        return SeqInput(
            token_ids=tokens,
            start_pos=start,
            page_ids=t.page_table,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            rng_key=request_rng_key(p.seed, t.request_id, len(t.output_ids)),
        )

    def _run_extend(self, prefill: list[PrefillItem]) -> dict[str, int]:
        if not prefill:
            return {}
        with span("extend"):
            start = time.perf_counter()
            work = []
            for item in prefill:
                t = self._tracked[item.request_id]
                tokens = list(item.request.prefill_tokens[t.computed : item.end])
                work.append((t, tokens, t.computed))
            sampled = self._run_packed(work)
            for item in prefill:
                self._tracked[item.request_id].computed = item.end
            elapsed = time.perf_counter() - start
        self.counters["prefill_steps"] += 1
        self.scheduler.cost.observe_extend([(it.new_tokens, it.start) for it in prefill], elapsed)
        return {it.request_id: sampled[it.request_id] for it in prefill if it.is_last_chunk}

    def _run_packed(self, work: list[tuple[_Tracked, list[int], int]]) -> dict[str, int]:
        """Run extend work in as few runner steps as the runner's token/batch limits allow."""
        limit_tokens = self.runner.config.max_batch_tokens
        limit_seqs = self.runner.config.max_batch_size
        sampled: dict[str, int] = {}
        pending = list(work)
        while pending:
            batch: list[tuple[_Tracked, SeqInput]] = []
            room = limit_tokens
            rest = []
            for t, tokens, start in pending:
                if room <= 0 or len(batch) >= limit_seqs:
                    rest.append((t, tokens, start))
                    continue
                piece = tokens[:room]
                batch.append((t, self._seq(t, piece, start)))
                room -= len(piece)
                if len(piece) < len(tokens):
                    rest.append((t, tokens[len(piece) :], start + len(piece)))
            result = self.runner.step([s for _, s in batch])
            for (t, _), token in zip(batch, result.next_tokens):
                sampled[t.request_id] = int(token)
            pending = rest
        return sampled

    def _dispatch_decode(self, decode: list[ScheduledRequest]) -> tuple[PendingStep, float] | None:
        if not decode:
            return None
        with span("decode"):
            start = time.perf_counter()
            seqs = []
            for req in decode:
                t = self._tracked[req.request_id]
                seqs.append(self._seq(t, [t.output_ids[-1]], t.computed))
            return self.runner.dispatch(seqs), start

    def _finish_decode(self, decode: list[ScheduledRequest], pending: tuple[PendingStep, float] | None) -> dict[str, int]:
        if pending is None:
            return {}
        step, start = pending
        with span("decode"):
            tokens = [int(x) for x in step.result().next_tokens]
            for req in decode:
                self._tracked[req.request_id].computed += 1
            elapsed = time.perf_counter() - start
        self.counters["decode_steps"] += 1
        self.scheduler.cost.observe_decode(len(decode), sum(r.seq_len for r in decode), elapsed)
        return {req.request_id: token for req, token in zip(decode, tokens)}

    def _postprocess(self, prefill: list[PrefillItem], decode: list[ScheduledRequest], produced: dict[str, int]) -> None:
        for item in prefill:
            t = self._tracked[item.request_id]
            token = produced.get(item.request_id)
            status = self.scheduler.on_prefill_done(item.request_id, token)
            if status is RequestStatus.DECODING:
                with span("backup"):
                    self._publish_prefix(t, item.request.prefill_tokens)
                self._accept_token(t, token)
        for req in decode:
            t = self._tracked[req.request_id]
            token = produced[req.request_id]
            self.scheduler.on_decode_done(req.request_id, token)
            self._accept_token(t, token)

    def _publish_prefix(self, t: _Tracked, tokens: Sequence[int]) -> None:
        """The prefill landed: hand its full pages to the tree (transient -> ready) and re-pin them."""
        full = t.computed // self.page_size
        t.locked, table = self.ctl.cache_unfinished(tokens[: full * self.page_size], t.namespace, t.page_table[:full], t.locked)
        self.ctl.finish_request(t.request_id)
        # Duplicate pages (someone inserted the same tokens first) were freed: use the tree's.
        t.page_table[: len(table)] = table
        t.shared_pages = full

    # ------------------------------------------------------------------ tokens out
    def _accept_token(self, t: _Tracked, token: int) -> None:
        t.output_ids.append(token)
        now = time.perf_counter()
        if t.first_token_at is None:
            t.first_token_at = now
        p = t.params
        finish: str | None = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            finish = "stop"
        elif len(t.output_ids) >= p.max_tokens or len(t.prompt_ids) + len(t.output_ids) >= self.max_context_tokens:
            finish = "length"
        delta = t.detok.push([token]) if t.detok is not None else ""
        if finish is not None and t.detok is not None:
            delta += t.detok.flush()
        if p.stop and t.detok is not None:
            full = t.text + delta
            hit = _find_stop(full, p.stop, len(t.text))
            if hit is not None:
                delta = full[len(t.text) : hit]
                finish = "stop"
            else:
                # hold back a tail that could still become a stop string
                hold = _stop_prefix_len(full, p.stop)
                if finish is None and hold:
                    delta = full[len(t.text) : len(full) - hold]
                elif finish is not None:
                    delta = full[len(t.text) :]
        t.text += delta
        new_ids = t.output_ids[t.emitted_tokens :]
        t.emitted_tokens = len(t.output_ids)
        chunk = StreamChunk(
            request_id=t.request_id,
            token_ids=new_ids,
            text=delta,
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=len(t.prompt_ids),
            completion_tokens=len(t.output_ids),
            cached_tokens=dict(t.cached),
        )
        if finish is not None:
            self.scheduler.finish(t.request_id)
            self._release(t, keep=True)
            del self._tracked[t.request_id]
            self.counters["finished"] += 1
            chunk.ttft_s = t.first_token_at - t.submitted_at  # type: ignore[attr-defined]
            chunk.latency_s = now - t.submitted_at  # type: ignore[attr-defined]
        t.sink.push(chunk)

    # ------------------------------------------------------------------ request life cycle
    def _admit(self, t: _Tracked) -> None:
        if self._stopping:
            t.sink.fail(EngineUnavailableError("the engine is shutting down"))
            return
        try:
            self.scheduler.submit(t.request_id, t.prompt_ids, namespace=t.namespace)
        except (OverloadedError, InvalidRequestError) as exc:
            t.sink.fail(exc)
            return
        self._tracked[t.request_id] = t
        full = len(t.prompt_ids) // self.page_size * self.page_size
        if full:
            self.ctl.insert_transient(t.prompt_ids[:full], t.namespace, t.request_id)
            match = self.ctl.match_prefix(t.prompt_ids, t.namespace, requester=t.request_id, touch=False)
            t.prefetch = self.ctl.prefetch(t.prompt_ids, t.namespace, match, t.request_id)

    def _release(self, t: _Tracked, *, keep: bool) -> None:
        """Give back a request's pages: keep=True hands computed full pages to the tree."""
        ps = self.page_size
        if keep and t.computed:
            tokens = (t.prompt_ids + t.output_ids)[: t.computed]
            full = t.computed // ps
            self.ctl.insert(tokens[: full * ps], t.namespace, t.page_table[:full])
            self.ctl.free_device(t.page_table[full:])
        else:
            self.ctl.free_device(t.page_table[t.shared_pages :])
        t.page_table, t.shared_pages, t.computed = [], 0, 0
        if t.locked is not None:
            self.ctl.unlock(t.locked)
            t.locked = None
        if t.prefetch is not None:
            self.ctl.cancel_prefetch(t.prefetch)
            t.prefetch = None
        self.ctl.abort(t.request_id)  # transient nodes it still owns

    def _retract(self, t: _Tracked) -> None:
        """Preempted decode: its KV goes to the tree (backed up per write policy), it re-queues."""
        self._release(t, keep=True)
        full = len(t.prompt_ids + t.output_ids) // self.page_size * self.page_size
        if full:
            self.ctl.insert_transient((t.prompt_ids + t.output_ids)[:full], t.namespace, t.request_id)

    def _abort(self, request_id: str, exc: BaseException) -> bool:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return False
        self.scheduler.abort(request_id)
        self._release(t, keep=False)
        self.counters["aborted"] += 1
        t.sink.fail(exc)
        return True

    def _abort_all(self) -> None:
        for rid in list(self._tracked):
            self._abort(rid, EngineUnavailableError("the engine shut down before the request finished"))

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self._tracked):
            self._abort(rid, exc)
            self.counters["failed"] += 1

    # ------------------------------------------------------------------ maintenance
    def _flush(self, tier: str) -> None:
        self.ctl.drain()
        if tier in ("device", "all"):
            self.ctl.evict_device(1 << 40)
        if tier in ("host", "all"):
            self.ctl.evict_host(1 << 40)
        if tier in ("storage", "all"):
            self.ctl.clear_storage()

    def _transfer_compiles(self) -> int:
        pool = self.ctl.device_pool
        return pool.compile_count if pool is not None else 0

    def _check(self) -> dict[str, int]:
        self.ctl.drain()  # backups in flight hold locks until they land
        held = [p for t in self._tracked.values() for p in t.page_table[t.shared_pages :]]
        self.ctl.check(device_held=held)
        locked = self._locked_nodes()
        transient = sum(1 for n in self.ctl.tree.iter_nodes() if n.is_transient)
        return {
            "device_used_pages": self.ctl.device_alloc.num_used,
            "device_request_pages": len(held),
            "host_used_pages": self.ctl.host_alloc.num_used,
            "locked_nodes": locked,
            "transient_nodes": transient,
            "live_requests": len(self._tracked),
        }

    def _locked_nodes(self) -> int:
        return sum(1 for n in self.ctl.tree.iter_nodes() if n.lock_ref > 0)

    def _stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        c = self.ctl.stats()
        locked = self._locked_nodes()
        return {
            "device_pool": {"used_pages": c["device_pages"] - c["device_free_pages"], "total_pages": c["device_pages"], "page_size": self.page_size},
            "host_pool": {"used_pages": c["host_pages"] - c["host_free_pages"], "total_pages": c["host_pages"]},
            "locked_nodes": locked,
            "hit_tokens": dict(s.hit_tokens),
            "recomputed_tokens": s.recomputed_prompt_tokens,
            "evictions": {"device": c["evicted_device_pages"], "host": c["evicted_host_pages"]},
            "transfers": {
                "loaded_pages": c["loaded_pages"],
                "backed_up_pages": c["backed_up_pages"],
                "storage_written_pages": c["storage_written_pages"],
                "prefetched_pages": c["prefetched_pages"],
                "storage_errors": c["storage_errors"],
                "page_bytes": self.ctl.page_bytes,
                "link_bandwidth_bytes_per_s": c["link_bandwidth_bytes_per_s"],
            },
            "storage": c.get("storage"),
            "compiles": self.runner.compile_count,
            "compiles_after_warmup": self.runner.compile_count - self.compiles_at_warmup,
            "transfer_compiles_after_warmup": self._transfer_compiles() - self.transfer_compiles_at_warmup,
            "waiting": self.scheduler.num_waiting,
            "running": self.scheduler.num_running,
            "deferrals": s.deferrals,
            "retractions": s.retractions,
            **self.counters,
        }


# ---------------------------------------------------------------------- helpers
def _namespace(cache_salt: str | None) -> str:
    if cache_salt is None:
        return ""
    if not isinstance(cache_salt, str) or len(cache_salt) > 256:
        raise InvalidRequestError("cache_salt must be a string of at most 256 characters")
    return cache_salt


def _as_prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(x, int) and not isinstance(x, bool) for x in prompts):
            return [list(prompts)]
        return [p if isinstance(p, str) else list(p) for p in prompts]
    raise InvalidRequestError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}")


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"{len(params)} SamplingParams for {n} prompts")
    return params


def _collect(rid: str, chunks: list[StreamChunk]) -> RequestOutput:
    last = chunks[-1]
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=[],
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finish_reason=last.finish_reason or "abort",
        cached_tokens=dict(last.cached_tokens),
        ttft_s=getattr(last, "ttft_s", 0.0),
        latency_s=getattr(last, "latency_s", 0.0),
    )


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts (searching where it could newly appear)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
