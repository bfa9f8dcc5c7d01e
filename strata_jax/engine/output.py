"""Tokens out: incremental text, stop strings and stream chunks, off the engine thread.

The engine thread decides what depends on token ids alone (EOS and stop ids,
``max_tokens``, the context limit: ``StopRules``) and sends one message per step: a
``TokenEvent`` per request that got a token or finished, and ``FailEvent``s.  An
``OutputProcessor`` turns them into ``StreamChunk``s: it detokenizes, matches stop
strings (holding back text that could still become one) and delivers every chunk of
the step at once (``sinks.deliver``).  A stop string ends a request here, after the
engine may already have computed a token or two more: those are discarded, never
shown, and the engine is told to stop the request (``on_stop``).

Where it runs: ``ThreadedOutput`` (the serving engine: its own thread, fed by a queue)
or ``InlineOutput`` (in the caller's thread: the simulator and engines driven by hand).
Per-request state (``OutputStream``) belongs to the processor once the request is
submitted; the engine thread only creates it and sets ``cached``/``prompt_logprobs``
before its first event.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from strata_jax.api import RequestOutput, SamplingParams, StreamChunk, TokenLogprob, empty_tier_counts
from strata_jax.engine.sinks import Delivery, OutputSink, deliver
from strata_jax.tokenizer import IncrementalDetokenizer

log = logging.getLogger("strata_jax.engine")


@dataclass(eq=False)
class OutputStream:
    """What the output side keeps per request."""

    request_id: str
    sink: OutputSink
    params: SamplingParams
    prompt_tokens: int
    submitted_at: float
    detok: IncrementalDetokenizer | None = None
    cached: dict[str, int] = field(default_factory=empty_tier_counts)  # set by the engine before the first event
    prompt_logprobs: list[TokenLogprob] | None = None  # set by the engine before the first event
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # delivered so far
    first_token_at: float | None = None
    done: bool = False
    final_only: bool = False  # the sink wants the final chunk only (``OutputSink.final_only``)


class TokenEvent(NamedTuple):
    """A request's token (or, with ``token=None``, its end without one) as the engine saw it."""

    stream: OutputStream
    token: int | None
    logprob: TokenLogprob | None
    finish: str | None  # "stop" / "length" when a token-id rule ended the request
    at: float  # engine clock when the token was known


class FailEvent(NamedTuple):
    stream: OutputStream
    error: BaseException


Event = TokenEvent | FailEvent


class StopRules:
    """The stop rules that need only token ids, applied on the engine thread."""

    def __init__(self, eos_token_ids: Collection[int], max_context_tokens: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_tokens = max_context_tokens

    def by_token(self, params: SamplingParams, token: int, generated: int) -> bool:
        """Does ``token`` (the ``generated``-th) end the request by a stop or EOS id?"""
        if generated < params.min_tokens:
            return False  # below min_tokens no stop rule ends the request (the ids are masked on device too)
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def by_length(self, params: SamplingParams, prompt_tokens: int, generated: int) -> bool:
        """Is the ``generated``-th token the last one ``max_tokens`` or the context allow?"""
        return generated >= self.most_tokens(params, prompt_tokens)

    def most_tokens(self, params: SamplingParams, prompt_tokens: int) -> int:
        """The tokens ``max_tokens`` and the context allow a request to generate."""
        return min(params.max_tokens, self.max_context_tokens - prompt_tokens)


class OutputProcessor:
    """Events to chunks (single-threaded: whoever calls ``process``)."""

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        self.on_stop = on_stop  # a stop string ended this request: the engine should stop computing it

    def process(self, events: Sequence[Event]) -> list[Delivery]:
        out: list[Delivery] = []
        for ev in events:
            try:
                self._one(ev, out)
            except Exception as exc:  # one stream's failure (e.g. its detokenizer) is its own
                log.exception("output of request %s failed", ev.stream.request_id)
                if not ev.stream.done:
                    ev.stream.done = True
                    out.append((ev.stream.sink, exc))
                    self.on_stop(ev.stream.request_id)  # nobody will see its tokens: stop computing them
        return out

    def _one(self, ev: Event, out: list[Delivery]) -> None:
        s = ev.stream
        if s.done:
            return  # a token computed after the request ended (stop string, abort): never shown
        if isinstance(ev, FailEvent):
            s.done = True
            out.append((s.sink, ev.error))
            return
        if s.final_only and ev.finish is None and not s.params.stop:
            assert ev.token is not None  # only a finishing event comes without a token
            if s.first_token_at is None:
                s.first_token_at = ev.at
            s.token_ids.append(ev.token)  # counted, not delivered
            return
        chunk = self._chunk(s, ev)
        if chunk is not None:
            out.append((s.sink, chunk))

    def _chunk(self, s: OutputStream, ev: TokenEvent) -> StreamChunk | None:
        p = s.params
        finish = ev.finish
        new_ids: list[int] = []
        delta = ""
        if s.first_token_at is None:
            s.first_token_at = ev.at
        if ev.token is not None:
            new_ids.append(ev.token)
            s.token_ids.append(ev.token)
            delta = s.detok.push([ev.token]) if s.detok is not None else ""
        if finish is not None and s.detok is not None:
            delta += s.detok.flush()
        if p.stop and s.detok is not None and len(s.token_ids) >= p.min_tokens:
            full = s.text + delta
            hit = find_stop(full, p.stop, len(s.text))
            if hit is not None:
                delta = full[len(s.text) : hit]
                if finish is None:
                    self.on_stop(s.request_id)
                finish = "stop"
            else:
                hold = stop_prefix_len(full, p.stop)  # a tail that could still become a stop string
                if finish is None and hold:
                    delta = full[len(s.text) : len(full) - hold]
                elif finish is not None:
                    delta = full[len(s.text) :]
        s.text += delta
        chunk = StreamChunk(
            request_id=s.request_id,
            token_ids=new_ids,
            text=delta,
            finished=finish is not None,
            finish_reason=finish,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=len(s.token_ids),
            cached_tokens=dict(s.cached),
        )
        if ev.logprob is not None and p.logprobs is not None:
            chunk.logprobs = [ev.logprob]
        if s.prompt_logprobs is not None:
            chunk.prompt_logprobs = [None, *s.prompt_logprobs]  # delivered once, with the first chunk
            s.prompt_logprobs = None
        if finish is not None:
            s.done = True
            chunk.ttft_s = s.first_token_at - s.submitted_at
            chunk.latency_s = ev.at - s.submitted_at
        return chunk


class InlineOutput:
    """Processes and delivers each step's events at once, in the engine's thread."""

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        self.processor = OutputProcessor(on_stop)

    def emit(self, events: list[Event]) -> None:
        if events:
            deliver(self.processor.process(events))

    def close(self) -> None:
        pass


class ThreadedOutput:
    """Processes and delivers events on a thread of its own (one queue item per step)."""

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        self.processor = OutputProcessor(on_stop)
        self._queue: queue.SimpleQueue[list[Event] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="strata-output", daemon=True)
        self._thread.start()

    def emit(self, events: list[Event]) -> None:
        if events:
            self._queue.put(events)

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            events = self._queue.get()
            if events is None:
                return
            batch = [events]
            while True:  # everything queued behind it goes out in the same delivery
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._deliver(batch)
                    return
                batch.append(more)
            self._deliver(batch)

    def _deliver(self, batch: list[list[Event]]) -> None:
        try:
            deliver(d for events in batch for d in self.processor.process(events))
        except Exception:  # a bad sink must not stop every other stream
            log.exception("delivering outputs failed")


def collect(rid: str, chunks: list[StreamChunk]) -> RequestOutput:
    """One request's chunks as a ``RequestOutput``."""
    last = chunks[-1]
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])] if any(c.logprobs for c in chunks) else None
    prompt_logprobs = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=[],
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finish_reason=last.finish_reason or "abort",
        cached_tokens=dict(last.cached_tokens),
        ttft_s=last.ttft_s or 0.0,
        latency_s=last.latency_s or 0.0,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts (searching where it could newly appear)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
