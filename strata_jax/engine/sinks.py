"""Delivery of request outputs to callers (sync or asyncio), from the output thread.

Sinks receive a request's stream chunks and at most one failure.  ``deliver`` hands
one step's chunks of many requests over at once: chunks bound for the same asyncio
event loop travel in a single ``call_soon_threadsafe``, so a step of 256 streaming
requests wakes each loop once, not 256 times.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable

from strata_jax.api import StreamChunk

log = logging.getLogger("strata_jax.engine")


class OutputSink:
    """Receives a request's stream chunks and at most one failure.

    ``final_only``: the sink needs only the request's last chunk (its counts and timings);
    the output side then builds no chunk for the tokens before it.
    """

    final_only = False

    def push(self, chunk: StreamChunk) -> None:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        raise NotImplementedError


class CollectingSink(OutputSink):
    """Collects chunks; ``wait()`` blocks until the request finished or failed."""

    def __init__(self) -> None:
        self.chunks: list[StreamChunk] = []
        self.error: BaseException | None = None
        self._done = threading.Event()

    def push(self, chunk: StreamChunk) -> None:
        self.chunks.append(chunk)
        if chunk.finished:
            self._done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class AsyncQueueSink(OutputSink):
    """Forwards chunks into an ``asyncio.Queue`` owned by an event loop (thread-safe)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamChunk | BaseException] = asyncio.Queue()

    def _put(self, item: StreamChunk | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def push(self, chunk: StreamChunk) -> None:
        self._put(chunk)

    def fail(self, exc: BaseException) -> None:
        self._put(exc)


class CallbackSink(OutputSink):
    def __init__(self, on_chunk: Callable[[StreamChunk], None], on_error: Callable[[BaseException], None]) -> None:
        self.on_chunk, self.on_error = on_chunk, on_error

    def push(self, chunk: StreamChunk) -> None:
        self.on_chunk(chunk)

    def fail(self, exc: BaseException) -> None:
        self.on_error(exc)


Delivery = tuple[OutputSink, "StreamChunk | BaseException"]
# an item bound for an ``AsyncQueueSink``'s queue
_Queued = tuple["asyncio.Queue[StreamChunk | BaseException]", "StreamChunk | BaseException"]


def deliver(items: Iterable[Delivery]) -> None:
    """Hand chunks and failures to their sinks, in order per sink; one wake-up per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Queued]] = {}
    for sink, item in items:
        if type(sink) is AsyncQueueSink:
            by_loop.setdefault(sink.loop, []).append((sink.queue, item))
            continue
        try:
            if isinstance(item, BaseException):
                sink.fail(item)
            else:
                sink.push(item)
        except Exception as exc:  # a sink that raises loses its own stream, not the others'
            log.exception("an output sink failed")
            if not isinstance(item, BaseException):
                try:
                    sink.fail(exc)
                except Exception:  # its stream is lost either way: the other sinks still get theirs
                    pass
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass


def _put_all(batch: list[_Queued]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
