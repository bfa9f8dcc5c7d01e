"""Delivery of request outputs from the engine thread to callers (sync or asyncio)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from strata_jax.api import StreamChunk


class OutputSink:
    """Receives a request's stream chunks and at most one failure, from the engine thread."""

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
