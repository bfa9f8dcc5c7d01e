"""The one seam between the faces (gRPC, HTTP) and the engine.

``Frontend`` owns the engine's lifecycle as the faces see it
(warming -> ready -> draining -> stopped), names requests and refuses a second
one with an id already in flight, fans a request's ``n`` choices out, records
request metrics and the load report, and guarantees that a stream which is closed,
cancelled or errored early aborts its engine request (so its pages and tree locks
are released).  Both faces call ``Frontend.stream``; neither talks to the engine's
request API directly.  What a request may hold (prompt, ids, lengths) is checked
once, by the engine (``strata_jax.api.validate_request``); the faces only map its
errors to their status codes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from serving.disaggregation import Handoff, RoomBook, prefill_only
from serving.metrics import ServingMetrics
from strata_jax.api import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RequestAbortedError,
    SamplingParams,
    StreamChunk,
    fan_out,
)
from strata_jax.engine.handoff import PEER_STATES, HandoffPolicy, HandoffWait

log = logging.getLogger(__name__)

TIERS = ("device", "host", "storage")


class EngineLike(Protocol):
    """What the faces use of ``strata_jax.engine.Engine``."""

    model_name: str
    tokenizer: Any

    @property
    def max_context_tokens(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        follows: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[StreamChunk]: ...  # closing the iterator early aborts the request
    def abort(self, request_id: str) -> object: ...  # queues the abort; never waits for the engine
    def cache_stats(self) -> dict: ...
    def check_accounting(self) -> dict: ...  # raises AssertionError when an invariant is broken
    def flush_cache(self, tier: str = "all", lora_name: str | None = None) -> None: ...
    def handoff_wait(
        self,
        prompt: object,
        *,
        cache_salt: object = None,
        lora_name: object = None,
        policy: HandoffPolicy | None = None,
    ) -> HandoffWait: ...
    def start_profile(self, log_dir: str) -> None: ...
    def stop_profile(self) -> str: ...
    def shutdown(self, grace_s: float = 10.0) -> None: ...


@dataclass
class _RequestLoad:
    """One in-flight request as the load report counts it."""

    prompt_tokens: int
    generated_tokens: int = 0
    started: bool = False  # its first chunk (the end of its prefill) has come
    adapter: str | None = None  # its LoRA adapter (per-adapter counters)


@dataclass(frozen=True)
class Load:
    """What this server holds now, as the faces see it (SGLang's ``/get_load`` counts).

    ``requests``: admitted and not finished; ``waiting``: of those, the ones whose first
    token has not come yet (queued or prefilling); ``tokens``: their prompt tokens plus
    the tokens generated so far (the KV they hold or will hold).
    """

    requests: int
    waiting: int
    tokens: int


class State(enum.Enum):
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class Frontend:
    """Engine lifecycle + request streaming with guaranteed abort, shared by both faces."""

    def __init__(
        self,
        metrics: ServingMetrics,
        served_model_name: str | None = None,
        handoff_policy: HandoffPolicy | None = None,
    ) -> None:
        self.metrics = metrics
        self.handoff_policy = handoff_policy or HandoffPolicy()  # a decode replica's wait (_await_handoff)
        self.rooms = RoomBook()  # a prefill replica's disaggregated prompts, as the decode replica asks
        self._engine: EngineLike | None = None
        self._state = State.WARMING
        self._served_name = served_model_name
        self._in_flight: set[str] = set()
        self._load: dict[str, _RequestLoad] = {}  # in-flight requests admitted with a known prompt length
        self.failure: str | None = None
        self.warmup_progress: Any = None  # a strata_jax WarmupProgress while the engine starts (serve sets it)

    # ---- lifecycle ------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def ready(self) -> bool:
        return self._state is State.READY

    @property
    def engine_or_none(self) -> EngineLike | None:
        return self._engine

    def attach(self, engine: EngineLike) -> None:
        """Hand over a warmed-up engine; requests are served from now on."""
        self._engine = engine
        if self._state is State.WARMING:
            self._state = State.READY

    def fail(self, reason: str) -> None:
        """The engine could not be built, or stopped for good; every request gets UNAVAILABLE with ``reason``."""
        self.failure = reason
        self._state = State.FAILED

    def begin_drain(self) -> None:
        """Stop accepting requests (SIGTERM); in-flight ones carry on."""
        if self._state in (State.READY, State.WARMING):
            self._state = State.DRAINING

    def mark_stopped(self) -> None:
        self._state = State.STOPPED

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def load(self) -> Load:
        """The in-flight requests, those still waiting for their first token, and their tokens."""
        loads = list(self._load.values())
        return Load(
            requests=len(loads),
            waiting=sum(1 for r in loads if not r.started),
            tokens=sum(r.prompt_tokens + r.generated_tokens for r in loads),
        )

    @property
    def model_name(self) -> str:
        if self._served_name:
            return self._served_name
        return self._engine.model_name if self._engine is not None else "unknown"

    def engine(self) -> EngineLike:
        """The engine, or ``EngineUnavailableError`` while warming up / shutting down."""
        if self._state is State.READY and self._engine is not None:
            return self._engine
        if self._state is State.WARMING:
            raise EngineUnavailableError("the engine is warming up; retry shortly")
        if self._state is State.FAILED:
            raise EngineUnavailableError(f"the engine is not serving: {self.failure}")
        raise EngineUnavailableError("the server is shutting down")

    def check_model(self, name: object) -> None:
        """Raise ``LookupError`` unless ``name`` is the served model or one of its LoRA adapters."""
        if name != self.model_name and name not in self.adapter_names():
            raise LookupError(f"model {name!r} does not exist; this server serves {self.model_name!r}")

    def adapter_names(self) -> list[str]:
        """The LoRA adapters the engine holds (``model`` names one of them)."""
        adapters = getattr(self._engine, "adapters", None)
        return [e.adapter.name for e in adapters.listing()] if adapters is not None else []

    def play_prefill(self, params: SamplingParams) -> SamplingParams:
        """A prefill replica's part of a disaggregated request (either face): the prompt and one
        token, counted in ``strata_pd_prefills_total``."""
        self.metrics.pd_prefills.inc()
        return prefill_only(params)

    def lora_name(self, model: object) -> str | None:
        """The adapter a request's ``model`` selects: None for the base model (checked first)."""
        self.check_model(model)
        return None if model == self.model_name else str(model)

    # ---- requests -------------------------------------------------------
    def count_rejected(self, api: str, exc: BaseException) -> None:
        """Count a request a face refused before handing it to ``stream`` (which counts its own)."""
        reason = rejection_reason(exc)
        if reason is None:
            self.metrics.requests.labels(api, "error").inc()
        else:
            self.metrics.count_rejected(api, reason)

    def stream_choices(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        n: int,
        *,
        api: str,
        cache_salt: str | None = None,
        request_id: str | None = None,
        lora_name: str | None = None,
        handoff: Handoff | None = None,
    ) -> list[AsyncGenerator[StreamChunk, None]]:
        """``n`` choices of one prompt (OpenAI's ``n``), each a ``stream`` of one of the
        requests ``strata_jax.api.fan_out`` makes of it (choice 0 prefills, the others follow)."""
        return [
            self.stream(
                prompt,
                c.params,
                api=api,
                cache_salt=cache_salt,
                request_id=c.request_id,
                follows=c.follows,
                lora_name=lora_name,
                handoff=handoff,
            )
            for c in fan_out(params, n, request_id)
        ]

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        api: str,
        cache_salt: str | None = None,
        request_id: str | None = None,
        follows: str | None = None,
        lora_name: str | None = None,
        handoff: Handoff | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream one request's chunks; closing this generator early aborts the request.

        ``follows``: another choice (n > 1) of the same prompt whose prefill this
        request waits for, so it reuses the prompt's pages (``Engine.submit``).
        ``handoff`` (a disaggregated prompt, ``serving/disaggregation.py``): a decode replica
        first waits until the prefill replica has put the prompt's pages in L3
        (``_await_handoff``; a follower waits for its leader instead); a prefill replica
        keeps the room's state in ``rooms`` for the decode replica to ask.

        Errors from admission (``InvalidRequestError``, ``OverloadedError``,
        ``EngineUnavailableError``) surface on the first ``__anext__``.  The request
        is counted once in ``strata_requests_total`` when it ends: with its finish
        reason once the final chunk is out (whatever the consumer does after it),
        ``cancelled`` when the consumer stops before that (the client went away),
        ``rejected`` (by reason) when admission refuses it, ``error`` on a bug.
        """
        status = "error"
        reason: str | None = None
        t0 = time.perf_counter()
        rid: str | None = None
        engine_stream: AsyncIterator[StreamChunk] | None = None
        finished = False
        room = handoff.room if handoff is not None and handoff.role == "prefill" and follows is None else None
        if room is not None:
            self.rooms.start(room)
        self.metrics.in_flight.inc()
        try:
            engine = self.engine()
            prompt = self._encode(engine, prompt)
            rid = request_id or uuid.uuid4().hex
            if rid in self._in_flight:
                rid = None
                raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
            self._in_flight.add(rid)
            load = self._load[rid] = _RequestLoad(len(prompt) if isinstance(prompt, list) else 0, adapter=lora_name)
            handed_over = None
            if handoff is not None and handoff.role == "decode" and follows is None:
                handed_over = await self._await_handoff(engine, prompt, cache_salt, lora_name, handoff.peer_url)
            engine_stream = engine.stream(
                prompt,
                params,
                cache_salt=cache_salt or None,
                request_id=rid,
                follows=follows,
                lora_name=lora_name,
            )
            last: float | None = None
            async for chunk in engine_stream:
                if last is None and handed_over is not None:
                    self.metrics.pd_handoff_to_first_token.observe(time.perf_counter() - handed_over)
                last = self._observe(chunk, load, t0, last)
                if chunk.finished:
                    finished = True
                    status = chunk.finish_reason or "stop"
                yield chunk  # the consumer may close us here, even after the final chunk
                if finished:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                status = "cancelled"
            raise
        except RequestAbortedError:
            status = "abort"
            raise
        except Exception as exc:
            reason = rejection_reason(exc)
            status = "rejected" if reason is not None else "error"
            raise
        finally:
            if room is not None:
                self.rooms.end(room, prefilled=finished)
            await self._release(rid, engine_stream, finished)
            self.metrics.in_flight.dec()
            if reason is not None:
                self.metrics.count_rejected(api, reason)
            else:
                self.metrics.e2e.observe(time.perf_counter() - t0)
                self.metrics.requests.labels(api, status).inc()
            if lora_name is not None:
                self.metrics.lora_requests.labels(lora_name, status).inc()

    async def _await_handoff(
        self,
        engine: EngineLike,
        prompt: str | Sequence[int],
        cache_salt: str | None,
        lora_name: str | None,
        peer_url: str | None,
    ) -> float | None:
        """Wait for the prompt's pages, which the prefill replica computes, in L3 (polled, so
        no thread is held while waiting), asking the prefill replica at ``peer_url`` how the
        room stands every ``peer_poll_s``; counted and, when the wait gave up, logged.  Returns
        when the last page was seen (``perf_counter``), None when the replica computes part of
        the prompt itself."""
        policy = self.handoff_policy
        wait = await asyncio.to_thread(
            engine.handoff_wait, prompt, cache_salt=cache_salt or None, lora_name=lora_name, policy=policy
        )
        asker = asyncio.create_task(self._ask_peer(wait, peer_url, policy.peer_poll_s)) if peer_url else None
        try:
            while (result := await asyncio.to_thread(wait.poll)) is None:
                await asyncio.sleep(wait.poll_s)
        finally:
            if asker is not None:
                asker.cancel()
        self.metrics.pd_handoffs.labels(result.outcome).inc()
        self.metrics.pd_pages_received.inc(result.landed_pages)
        self.metrics.pd_wait.observe(result.waited_s)
        if result.gave_up:  # (a short prompt computed at once, ``local``, is by design: not logged)
            log.warning(
                "prefill/decode handoff %s after %.2f s: %d of the prompt's %d pages in L3; computing the rest here",
                result.outcome,
                result.waited_s,
                result.landed_pages,
                result.wanted_pages,
            )
        return None if result.fell_back else time.perf_counter()

    @staticmethod
    async def _ask_peer(wait: HandoffWait, url: str, every_s: float) -> None:
        """Tell ``wait`` what the prefill replica says of the room, every ``every_s`` until cancelled."""
        async with httpx.AsyncClient(timeout=max(every_s * 4, 1.0)) as client:
            while True:
                try:
                    answer = await client.get(url)
                    state = answer.json().get("state") if answer.status_code == 200 else None
                except (httpx.HTTPError, ValueError, AttributeError):
                    state = "unreachable"
                wait.note_peer(state if state in PEER_STATES else "unknown")
                await asyncio.sleep(every_s)

    @staticmethod
    def _encode(engine: EngineLike, prompt: str | Sequence[int]) -> str | Sequence[int]:
        """A text prompt as token ids when the engine has a tokenizer (encoded once, here, so
        the load report knows its length); anything else as it came (the engine checks it)."""
        if isinstance(prompt, str) and prompt and getattr(engine, "tokenizer", None) is not None:
            return list(engine.tokenizer.encode(prompt))
        return prompt

    def _observe(self, chunk: StreamChunk, load: _RequestLoad, t0: float, last: float | None) -> float:
        """Record a chunk in the metrics and the load report; returns when it came."""
        now = time.perf_counter()
        if last is None:
            load.started = True
            self.metrics.ttft.observe(now - t0)
            self.metrics.prompt_tokens.inc(chunk.prompt_tokens)  # the prefill is done
            if load.adapter is not None:
                self.metrics.lora_prompt_tokens.labels(load.adapter).inc(chunk.prompt_tokens)
            for tier in TIERS:
                self.metrics.cached_prompt_tokens.labels(tier).inc(chunk.cached_tokens.get(tier, 0))
        elif chunk.token_ids:
            gap = (now - last) / len(chunk.token_ids)
            for _ in chunk.token_ids:
                self.metrics.inter_token.observe(gap)
        if chunk.token_ids:
            load.generated_tokens += len(chunk.token_ids)
            self.metrics.completion_tokens.inc(len(chunk.token_ids))
            if load.adapter is not None:
                self.metrics.lora_completion_tokens.labels(load.adapter).inc(len(chunk.token_ids))
        return now

    async def _release(self, rid: str | None, engine_stream: AsyncIterator[StreamChunk] | None, finished: bool) -> None:
        """Close the engine stream (which aborts an unfinished request) and forget ``rid``."""
        if engine_stream is not None:
            try:
                await aclose(engine_stream)  # the engine aborts unfinished requests here
            except Exception:
                log.exception("closing the engine stream of %s failed", rid)
        if rid is None:
            return
        if not finished and self._engine is not None:
            try:
                self._engine.abort(rid)  # belt and braces: idempotent, and only queued (never blocks the loop)
            except Exception:
                log.exception("abort(%s) failed", rid)
        self._in_flight.discard(rid)
        self._load.pop(rid, None)


async def aclose(stream: object) -> None:
    """Close ``stream`` if it can be closed (an async generator: the engine's stream is one)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def rejection_reason(exc: BaseException) -> str | None:
    """Why ``exc`` refused a request (one of ``serving.metrics.REJECT_REASONS``), or ``None`` for a bug.

    An exception may carry its own ``rejection_reason`` attribute (the faces' HTTP/gRPC errors do).
    """
    own = getattr(exc, "rejection_reason", None)
    if isinstance(own, str):
        return own
    if isinstance(exc, PromptTooLongError):
        return "too_long"
    if isinstance(exc, InvalidRequestError):
        return "invalid_request"
    if isinstance(exc, LookupError):
        return "not_found"
    if isinstance(exc, OverloadedError):
        return "overloaded"
    if isinstance(exc, EngineUnavailableError):
        return "unavailable"
    return None
