"""``Engine``: the model, the hierarchical cache and the scheduler behind a thread-safe API.

The engine composes (docs/design.md §2): it loads the model, builds the cache controller,
the ``ModelRunner`` and its ``JaxExecutor``, the ``Scheduler``, and an ``EngineCore``
that runs the step over them (``engine/core.py``).  Three threads:

* the caller's: ``submit``/``generate``/``stream`` validate there and hand the request
  to the loop through an inbox; ``abort`` only queues (it never waits for a step);
* the engine loop (``strata-engine``): drains the inbox between steps and runs
  ``EngineCore.step`` (schedule, load, dispatch step N+1, read step N's tokens);
* the output thread (``strata-output``): detokenizes, matches stop strings and
  delivers every chunk of a step at once (``engine/output.py``).

``start=False`` builds an engine without threads, driven by hand (``step``,
``run_until_idle``); its outputs are delivered in the driving thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar, cast

import jax

from strata_jax.api import (
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestAbortedError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    StreamChunk,
    ValidRequest,
    fan_out,
    validate_request,
)
from strata_jax.cache.hashing import chain_hashes
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.core import EngineCore
from strata_jax.engine.factory import build_parts
from strata_jax.engine.handoff import HandoffPolicy, HandoffWait
from strata_jax.engine.output import InlineOutput, ThreadedOutput, collect
from strata_jax.engine.requests import TrackedRequest
from strata_jax.engine.sinks import AsyncQueueSink, CollectingSink, OutputSink
from strata_jax.engine.speculation import Speculator
from strata_jax.engine.stats import accounting, cache_stats
from strata_jax.lora.peft_adapter import adapter_namespace, load_peft_adapter, namespace_adapter
from strata_jax.lora.registry import AdapterInUseError, AdapterNotFoundError, AdapterRegistry, LoadedAdapter
from strata_jax.runtime import compilation_cache, executable_cache
from strata_jax.runtime.executable_cache import ExecutableCache
from strata_jax.runtime.platform import ResolvedPlatform
from strata_jax.runtime.warmup_progress import WarmupProgress
from strata_jax.scheduler.scheduler import Scheduler
from strata_jax.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from strata_jax.structured.matcher import GrammarTokenizer

_T = TypeVar("_T")

__all__ = ["Engine", "EngineConfig"]

log = logging.getLogger(__name__)


class Engine:
    """Serving engine; see ``strata_jax.api`` for the request/response types."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        start: bool = True,
        on_progress: WarmupProgress | None = None,
        output_thread: bool | None = None,
    ):
        """``on_progress`` (optional) is told each start-up phase and the warm-up's
        programs done / total (``serve`` shows it on /health while warming up).
        ``output_thread``: deliver outputs from a thread of their own (default: with the
        engine's threads, ``start``); False delivers them in the thread that runs the step."""
        self.config = config = config or EngineConfig()
        progress = on_progress or WarmupProgress()
        self.compilation_cache_dir = compilation_cache.configure(config.compilation_cache_dir)
        compiles_before = compilation_cache.COUNTER.snapshot()
        parts = build_parts(config, progress)
        self.settings = settings = parts.settings
        self.mesh = parts.mesh
        self.model_name = parts.loaded.name
        self.model_config = parts.loaded.config
        self.tokenizer = parts.loaded.tokenizer
        self.eos_token_ids = parts.loaded.eos_token_ids
        self.generation_defaults = parts.loaded.generation  # generation_config.json: request defaults
        self.ctl = parts.ctl
        self.runner = parts.runner
        self.draft = parts.draft  # speculative decoding's draft model, when the config names one
        self.matmul_flops_per_s = parts.matmul_flops_per_s
        self.executor = parts.executor
        threaded_output = start if output_thread is None else output_thread
        self.output = (
            ThreadedOutput(self._stopped_by_output) if threaded_output else InlineOutput(self._stopped_by_output)
        )
        self.core = EngineCore(
            Scheduler(settings.scheduler, parts.cost),
            self.ctl,
            self.executor,
            eos_token_ids=self.eos_token_ids,
            max_context_tokens=settings.max_context_tokens,
            outputs=self.output,
            pipeline=config.pipeline,
            publish_chunks=config.publish_prefill_chunks,
            speculator=Speculator(spec, parts.draft) if (spec := config.speculative) is not None else None,
        )
        self.adapters = AdapterRegistry(config.max_loras)
        self.kv_event_publisher = self._start_kv_events(config)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._inbox_size = 0  # everything posted and not yet run
        self._inbox_admits = 0  # of which submissions (what counts against max_waiting)
        self._inbox_lock = threading.Lock()  # both counters move on callers' threads and the engine's
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._grammar_lock = threading.Lock()
        self._grammar_tokenizer: GrammarTokenizer | None = None  # built on the first structured request
        self._stopping = False
        self._closed = False  # set on the engine thread by shutdown's close: then its loop ends
        self.fatal_error: BaseException | None = None  # set when the loop stopped for good
        self.on_fatal: Callable[[BaseException], None] | None = None  # told once, from the engine thread
        self.compiles_at_warmup = 0
        self.executables_reused = 0  # step programs read back whole from the executable cache
        self.transfer_compiles_at_warmup = 0
        self.extend_step_seconds: dict[int, float] = {}  # prefill_chunk "auto": the measured steps
        self.is_ready = False
        self._thread: threading.Thread | None = None
        for name, path in config.lora_modules:
            self.load_lora_adapter(name, path)
        if config.warmup:
            self._warm_up(progress)
        # XLA programs of the whole start-up (load + warm-up): compiled vs read from the persistent cache.
        self.startup_compiles = compilation_cache.COUNTER.snapshot().minus(compiles_before)
        if config.freeze_gc:
            # ~0.4M objects (the model, jax's traced programs) outlive start-up; a full cyclic
            # collection over them pauses the engine for ~0.3 s mid-serving.  Frozen, later
            # collections walk only what serving creates (vLLM and SGLang do the same).
            gc.collect()
            gc.freeze()
        progress.phase("ready")
        self.is_ready = True
        if start:
            self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
            self._thread.start()

    def _warm_up(self, progress: WarmupProgress) -> None:
        """Compile (or read back) every step program and transfer, then, for
        ``prefill_chunk="auto"``, measure the prefill steps."""
        config = self.config
        progress.phase("compiling")
        executables = None
        if self.compilation_cache_dir is not None and config.reuse_executables:
            executables = ExecutableCache.open(self.compilation_cache_dir / executable_cache.SUBDIR)
        self.compiles_at_warmup = self.runner.warmup(
            show_progress=config.show_progress, progress=progress.programs, executables=executables
        )
        if self.draft is not None:  # or the first proposals compile the draft's programs while serving
            progress.phase("compiling the draft model")
            self.compiles_at_warmup += self.draft.runner.warmup(show_progress=config.show_progress)
        self.executables_reused = executables.loaded if executables is not None else 0
        if executables is not None and executables.not_stored:
            log.info(
                "%d step programs came from the XLA cache and are not kept as executables "
                "(XLA:CPU re-serializes those incompletely); later starts read the XLA cache for them",
                executables.not_stored,
            )
        self.ctl.warmup_transfers()  # or the first L2 hit compiles its scatter while serving
        self.transfer_compiles_at_warmup = self._transfer_compiles()
        if str(config.prefill_chunk) == "auto":
            progress.phase("measuring prefill steps")
            self._tune_prefill_chunk()

    def _tune_prefill_chunk(self) -> None:
        """``prefill_chunk="auto"``: time a step per extend bucket (before any page is handed
        out), make the chunk the scheduler fills the one ``chunk_tuning`` picks, and start
        the scheduler's extend cost model from these measurements."""
        from strata_jax.runtime import chunk_tuning

        timings = self.runner.time_extend_buckets()
        seconds = dict(timings.seconds)
        chunk = chunk_tuning.choose_prefill_chunk(seconds)
        scheduler = self.scheduler
        scheduler.config = dataclasses.replace(scheduler.config, max_batch_tokens=chunk)
        for tokens, step in seconds.items():
            scheduler.cost.observe_extend([(tokens, timings.context_tokens)], step)
        self.extend_step_seconds = seconds
        log.info(chunk_tuning.describe(seconds, chunk))

    # ------------------------------------------------------------------ the parts
    @property
    def platform(self) -> ResolvedPlatform:
        return self.settings.platform

    @property
    def max_context_tokens(self) -> int:
        return self.settings.max_context_tokens

    @property
    def page_size(self) -> int:
        return self.settings.page_size

    @property
    def limits(self) -> RequestLimits:
        return self.settings.limits

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def prefill_chunk(self) -> int:
        """New tokens a prefill step computes at most: the scheduler's budget (``prefill_chunk``)."""
        return self.scheduler.config.max_batch_tokens

    @property
    def counters(self) -> dict[str, int]:
        return self.core.counters

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (concurrently) and return their outputs in order
        (``lora_name``: the loaded LoRA adapter they run under; None: the base model)."""
        batch = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(batch))
        sinks = []
        valid = [self._validate(prompt, p, cache_salt, lora_name) for prompt, p in zip(batch, params_list)]
        for v in valid:
            sink = CollectingSink()
            sinks.append((self._submit(v, sink, None), v.prompt_ids, sink))
        return [self._wait_for_output(rid, ids, sink) for rid, ids, sink in sinks]

    def generate_choices(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        n: int,
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """``n`` choices of one prompt (OpenAI's ``n``): one prefill, then n decodes over
        the prompt's pages shared through the tree (choice i > 0 follows choice 0)."""
        choices = fan_out(params, n)
        valid = self._validate(prompt, params, cache_salt, lora_name)
        ids = valid.prompt_ids
        sinks = []
        for c in choices:
            sink = CollectingSink()
            rid = self._submit(dataclasses.replace(valid, params=c.params, request_id=c.request_id), sink, c.follows)
            sinks.append((rid, sink))
        outputs = [self._wait_for_output(rid, ids, sink) for rid, sink in sinks]
        for out in outputs[1:]:
            out.prompt_logprobs = outputs[0].prompt_logprobs
        return outputs

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        follows: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Yield a request's chunks as they are produced; closing the iterator aborts it.

        ``follows``: the id of a request with the same prompt (another choice of it,
        n > 1) whose prefill this one waits for, so it reuses its pages."""
        sink = AsyncQueueSink(asyncio.get_running_loop())
        rid = self.submit(
            prompt,
            params or SamplingParams(),
            cache_salt=cache_salt,
            request_id=request_id,
            sink=sink,
            follows=follows,
            lora_name=lora_name,
        )
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
            if not finished:  # the consumer went away: abort (queued; never blocks its event loop)
                self.abort(rid)

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        sink: OutputSink | None = None,
        follows: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Validate and queue one request; returns its id.  Raises on bad input or overload.

        ``follows`` (n > 1): admit this request only after the prefill of request
        ``follows`` (same prompt) has put the prompt's pages in the tree."""
        valid = validate_request(
            prompt,
            params,
            self.limits,
            request_id=request_id,
            cache_salt=cache_salt,
            tokenizer=self.tokenizer,
            lora_name=lora_name,
        )
        return self._submit(valid, sink, follows)

    def _submit(self, valid: ValidRequest, sink: OutputSink | None, follows: str | None) -> str:
        """Queue a validated request; returns its id."""
        if self.fatal_error is not None:
            raise EngineFailedError(
                f"the engine stopped after an unrecoverable error ({type(self.fatal_error).__name__})"
            )
        if self._stopping or not self.is_ready:
            raise EngineUnavailableError("the engine is not accepting requests (warming up or shutting down)")
        if self.scheduler.num_waiting + self._inbox_admits >= self.scheduler.config.max_waiting:
            raise OverloadedError(
                f"server overloaded: {self.scheduler.num_waiting} requests waiting "
                f"(max_waiting={self.scheduler.config.max_waiting}); retry later"
            )
        params, prompt_ids = valid.params, valid.prompt_ids
        rid = valid.request_id if valid.request_id is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        adapter = self.adapters.resolve(valid.lora_name) if valid.lora_name is not None else None
        grammar = None
        if params.structured is not None:
            budget = min(params.max_tokens, self.max_context_tokens - len(prompt_ids))
            grammar = self._grammar_state(params.structured, budget)
        tracked = TrackedRequest(
            request_id=rid,
            prompt_ids=prompt_ids,
            # KV computed under an adapter lives in a namespace of its content (never shared with another's)
            namespace=adapter_namespace(valid.namespace, adapter.identity if adapter is not None else None),
            params=params,
            sink=sink or CollectingSink(),
            detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
            submitted_at=self.executor.now(),
            follows=follows,
            grammar=grammar,
            adapter=adapter,
        )

        def admit() -> None:
            with self._inbox_lock:
                self._inbox_admits -= 1
            if adapter is not None:  # its content may have been unloaded (or moved slots) while it was queued
                current = self.adapters.with_identity(adapter.identity)
                if current is None:
                    self.core.reject(tracked, AdapterNotFoundError(f"LoRA adapter {valid.lora_name!r} was unloaded"))
                    return
                tracked.adapter = dataclasses.replace(current, adapter=adapter.adapter)  # its name, the slot now
            self.core.admit(tracked)

        with self._inbox_lock:
            self._inbox_admits += 1
        self._post(admit)
        return rid

    def _grammar_state(self, spec: Any, budget: int) -> Any:
        """A structured output's matcher, built here in the caller's thread (a large schema's
        grammar takes milliseconds; the engine loop never waits for it)."""
        from strata_jax.structured.matcher import GrammarState, GrammarTokenizer

        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer; this model has none")
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return GrammarState(spec, self._grammar_tokenizer, budget)

    def abort(self, request_id: str) -> Future[bool]:
        """Abort a request at any point; its pages are freed and its nodes unlocked.

        Never waits for the engine: the abort is queued and applied between steps.
        The returned future tells whether a live request was aborted."""
        done: Future[bool] = Future()

        def do() -> None:
            done.set_result(self.core.abort(request_id, RequestAbortedError(f"request {request_id} was aborted")))

        self._post(do)
        return done

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, name: str, path: str) -> LoadedAdapter:
        """Load the PEFT adapter folder ``path`` as ``name`` (read here, installed between steps).

        Refused (``InvalidRequestError``): LoRA off (``max_loras=0``), a name already loaded or
        equal to the base model's, every slot held, a folder this engine cannot serve
        faithfully (``lora.peft_adapter``).  The same content under a second name shares the
        first one's slot and cached KV."""
        if self.runner.lora is None:
            raise InvalidRequestError("LoRA is off: start the engine with max_loras > 0 (--max-loras)")
        if not isinstance(name, str) or not name or name == self.model_name:
            raise InvalidRequestError(
                f"a LoRA adapter needs a non-empty name other than the base model's, got {name!r}"
            )
        adapter = load_peft_adapter(name, path, self.model_config, max_rank=self.config.max_lora_rank)
        bank = self.runner.lora

        def install() -> LoadedAdapter:
            entry, fresh = self.adapters.add(adapter)
            if fresh:
                try:
                    bank.install(entry.slot, adapter)
                except BaseException:
                    self.adapters.remove(adapter.name)  # the slot is as it was: nothing to clear
                    raise
            return entry

        entry = self._call(install)
        log.info("LoRA adapter %r loaded from %s (slot %d, rank %d)", name, path, entry.slot, adapter.rank)
        return entry

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name``.  Refused (``AdapterInUseError``) while requests under that
        name are live: they are never cut short, and the call does not wait for them.  Its
        cached pages stay until they age out (loading it again finds them)."""
        bank = self.runner.lora

        def unload() -> None:
            self.adapters.resolve(name)  # AdapterNotFoundError first
            busy = [t.request_id for t in self.core.every_request() if t.adapter and t.adapter.adapter.name == name]
            if busy:
                raise AdapterInUseError(f"LoRA adapter {name!r} has {len(busy)} live requests; retry when they finish")
            slot = self.adapters.remove(name)
            if slot is not None and bank is not None:
                bank.clear(slot)

        self._call(unload)
        log.info("LoRA adapter %r unloaded", name)

    def cache_stats(self) -> dict[str, Any]:
        return self._call(lambda: cache_stats(self))

    def flush_cache(self, tier: str = "all", lora_name: str | None = None) -> None:
        """Drop cached (unlocked) KV from ``device``, ``host``, ``storage`` or ``all`` tiers.

        ``lora_name``: only the L1 and L2 pages computed under that loaded adapter (every
        tenant's), with ``tier`` "all"; its L3 objects cannot be listed by adapter and age out."""
        if tier not in ("device", "host", "storage", "all"):
            raise InvalidRequestError(f"tier must be device, host, storage or all, got {tier!r}")
        if lora_name is None:
            self._call(lambda: self.core.flush(tier))
            return
        if tier != "all":
            raise InvalidRequestError(
                f"a flush of one LoRA adapter takes tier 'all' (its L1 and L2 pages), got {tier!r}"
            )
        identity = self.adapters.resolve(lora_name).identity
        self._call(lambda: self.core.flush("all", scope=lambda ns: namespace_adapter(ns) == identity))

    def handoff_wait(
        self,
        prompt: object,
        *,
        cache_salt: object = None,
        lora_name: object = None,
        policy: HandoffPolicy | None = None,
    ) -> HandoffWait:
        """A wait for ``prompt``'s pages, which another replica computes, to land in the shared
        L3 (prefill/decode disaggregation, ``engine/handoff.py``); poll it from any thread, then
        submit the request as usual.  The deadline is ``policy``'s (default ``HandoffPolicy()``)
        for this engine's own predicted prefill time of the part of the prompt not in L3 now.  Raises
        ``InvalidRequestError`` without an L3 tier or for a prompt ``submit`` would refuse."""
        store = self.ctl.store
        if store is None:
            raise InvalidRequestError("a prefill/decode handoff needs the shared L3 tier (tiers L1+L2+L3)")
        policy = policy or HandoffPolicy()
        valid = self._validate(prompt, SamplingParams(max_tokens=0), cache_salt, lora_name)
        adapter = self.adapters.resolve(valid.lora_name) if valid.lora_name is not None else None
        namespace = adapter_namespace(valid.namespace, adapter.identity if adapter is not None else None)
        chain = chain_hashes(self.ctl.tree.seed(namespace), valid.prompt_ids, self.page_size)
        keys = store.object_keys(chain)

        def probe(start: int) -> int:
            try:
                landed = start + store.backend.batch_exists(keys[start:])
            except Exception as exc:  # noqa: BLE001 - an unreachable L3 has nothing new: the wait runs out
                store.failed("exists", exc)
                return start
            if landed >= len(keys):  # the scheduler's memoized probes may predate the pages: probe afresh
                self._post(store.forget_probes)
            return landed

        present = probe(0) if keys else 0
        missing = len(valid.prompt_ids) - present * self.page_size
        predicted = self.scheduler.cost.extend_seconds(missing, present * self.page_size)
        deadline = policy.deadline(predicted)
        return HandoffWait(
            probe,
            len(keys),
            present,
            deadline,
            policy.stall_s,
            time.monotonic,
            policy.poll_s,
            policy.max_wait_s,
            compute_here=present < len(keys) and missing <= policy.local_tokens,
        )

    def check_accounting(self) -> dict[str, int]:
        """Assert the cache invariants and exact page accounting; returns usage figures."""
        return self._call(lambda: accounting(self.core))

    def start_profile(self, log_dir: str) -> None:
        jax.profiler.start_trace(log_dir)
        self._profile_dir = log_dir

    def stop_profile(self) -> str:
        cast(Callable[[], None], jax.profiler.stop_trace)()  # (jax leaves it unannotated)
        return getattr(self, "_profile_dir", "")

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting work, let running requests finish within ``grace_s``, abort the rest."""
        if self._stopping:
            return
        self._stopping = True
        deadline = time.monotonic() + grace_s
        stop = EngineUnavailableError("the engine shut down before the request finished")
        if self._thread is not None:
            while time.monotonic() < deadline and (self.core.has_live_requests() or self._inbox_size):
                time.sleep(0.01)

            def close() -> None:
                self.core.close(stop)
                self._closed = True

            self._call(close)  # the loop runs until this has run, so the call cannot miss it
            self._post(lambda: None)
            self._thread.join(timeout=30)
            self._thread = None
        else:
            self.core.close(stop)
        self.output.close()
        self.executor.close()
        if self.kv_event_publisher is not None:
            if self.core.kv_event_recorder is not None:
                self.core.kv_event_recorder.end_step()
            self.kv_event_publisher.close()
        self.ctl.close()
        if self.config.freeze_gc:
            gc.unfreeze()  # what this engine leaves behind can be collected again

    def _start_kv_events(self, config: EngineConfig) -> Any:
        """The KV event publisher (``strata_jax.kv_events``) when ``kv_events_endpoint`` is set."""
        if config.kv_events_endpoint is None:
            return None
        from strata_jax.kv_events.publisher import ZmqKVEventPublisher
        from strata_jax.kv_events.recorder import KVEventRecorder

        publisher = ZmqKVEventPublisher(
            config.kv_events_endpoint,
            block_size=self.page_size,
            replay_endpoint=config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            data_parallel_rank=config.data_parallel_rank,
            max_queue_batches=config.kv_events_queue,
            buffer_batches=config.kv_events_buffer,
        )
        recorder = KVEventRecorder(self.ctl.tree, publisher.publish, self.adapters.name_of)
        self.ctl.tree.tier_observer = recorder.observe
        self.core.kv_event_recorder = recorder
        log.info("publishing KV events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint)
        return publisher

    def compile_count(self) -> int:
        return self.runner.compile_count

    # ------------------------------------------------------------------ driving by hand (start=False)
    def admit_pending(self) -> None:
        """Run what the caller's submits and aborts queued for the loop, on the caller's thread
        (``start=False``; ``step`` and ``run_until_idle`` do it too)."""
        self._drain_inbox()

    def step(self) -> None:
        """One engine step on the caller's thread (engines built with ``start=False``)."""
        self._drain_inbox()
        self.core.step()
        self._drain_inbox()

    def run_until_idle(self) -> None:
        """Drive the loop on the caller's thread until no request is left (``start=False``)."""
        self._drain_inbox()
        while self.scheduler.has_work() or self.core.has_pending_step() or self.core.has_live_requests():
            self.core.step()
            self._drain_inbox()

    # ------------------------------------------------------------------ input checks (caller thread)
    def _validate(self, prompt: object, params: object, cache_salt: object, lora_name: object = None) -> ValidRequest:
        return validate_request(
            prompt, params, self.limits, cache_salt=cache_salt, tokenizer=self.tokenizer, lora_name=lora_name
        )

    def _wait_for_output(self, rid: str, prompt_ids: list[int], sink: CollectingSink) -> RequestOutput:
        """Block until ``sink``'s request finishes; its output, or the error it failed with."""
        if self._thread is None:  # nobody else drives this engine
            while not sink.wait(0):
                self.run_until_idle()
        sink.wait()
        if sink.error is not None:
            raise sink.error
        out = collect(rid, sink.chunks)
        out.prompt_token_ids = prompt_ids
        return out

    # ------------------------------------------------------------------ inbox (engine thread side)
    def _post(self, fn: Callable[[], None]) -> None:
        with self._inbox_lock:
            self._inbox_size += 1
        self._inbox.put(fn)
        self._wake.set()

    def _stopped_by_output(self, request_id: str) -> None:
        """A stop string ended a request (on the output side): stop computing it, between steps."""
        self._post(lambda: self.core.stop_request(request_id))

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the engine thread (or here when there is none) and return its result."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        fut: Future[_T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed back to the caller
                fut.set_exception(exc)

        self._post(run)
        return fut.result()

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._inbox_lock:
                self._inbox_size -= 1
            fn()

    def _recover_from(self, exc: Exception, consecutive: int) -> None:
        """A step raised ``exc``: fail its requests and check the engine, or stop it for good.

        Recoverable: anything raised by Python code around the device (a scheduler estimate,
        a storage error that escaped, a bad request that got through): the step's requests
        fail with ``StepFailedError`` and the loop serves on, once the page accounting and
        the tree's invariants check clean.  Unrecoverable (the engine stops, the server
        exits non-zero): ``unrecoverable_step_error`` (the device runtime failed, memory ran
        out), a broken invariant after the failure, or ``MAX_CONSECUTIVE_STEP_FAILURES``
        failed steps in a row (a fault that fails every step is not being recovered from).
        """
        log.error("engine step failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        if unrecoverable_step_error(exc):
            self._die(exc)
            return
        try:
            failed = self.core.fail_step(exc)
            accounting(self.core)
        except Exception as broken:  # the state cannot be trusted: stop rather than serve wrong tokens
            log.error(
                "engine state is broken after a failed step: %s: %s", type(broken).__name__, broken, exc_info=broken
            )
            self._die(broken)
            return
        log.warning("failed %d request(s) of the failed step; the engine state checks clean, serving on", len(failed))
        if consecutive >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._die(RuntimeError(f"{consecutive} engine steps failed in a row; last: {type(exc).__name__}: {exc}"))

    def _die(self, exc: BaseException) -> None:
        """Stop for good (engine thread): fail every request, refuse new ones, tell ``on_fatal``."""
        self.fatal_error = exc
        self.core.abandon(
            EngineFailedError(f"the engine stopped after an unrecoverable error ({type(exc).__name__}: {exc})")
        )
        log.critical("engine stopped: %s: %s", type(exc).__name__, exc)
        callback = self.on_fatal
        if callback is not None:
            callback(exc)

    def _loop(self) -> None:
        core = self.core
        failures = 0  # consecutive failed steps
        while True:
            self._drain_inbox()
            if self._closed and self._inbox.empty() and not core.has_pending_step():
                return
            if self.fatal_error is not None or (not self.scheduler.has_work() and not core.has_pending_step()):
                # (stopped for good: no more steps, but calls are still answered until shutdown)
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                core.step()
            except Exception as exc:  # a failed step fails its requests, not the engine
                failures += 1
                self._recover_from(exc, failures)
            else:
                failures = 0

    def _transfer_compiles(self) -> int:
        pool = self.ctl.device_pool
        return pool.compile_count if pool is not None else 0


# ---------------------------------------------------------------------- helpers
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the fault is not transient: stop, so a supervisor restarts the server


def unrecoverable_step_error(exc: BaseException) -> bool:
    """Errors after which the engine's device state cannot be trusted (docs/serving.md, "Faults").

    A step donates the KV pool to its program: when the device runtime fails (a lost or
    faulted device, a program that could not run), the pool it was given may be gone.
    Memory exhaustion on the host leaves half-built state anywhere.
    """
    return isinstance(exc, (MemoryError, jax.errors.JaxRuntimeError))


def _as_prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(x, int) and not isinstance(x, bool) for x in prompts):
            return [list(prompts)]
        return [p if isinstance(p, str) else list(p) for p in prompts]
    raise InvalidRequestError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}")


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params_list = list(params)
    if len(params_list) != n:
        raise InvalidRequestError(f"{len(params_list)} SamplingParams for {n} prompts")
    return params_list
