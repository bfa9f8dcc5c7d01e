"""The choice streams of one OpenAI request, gathered: totals per choice, all choices
collected (non-streaming) or merged as they come (streaming), and the SSE response
that carries merged choices to the client.

Usage counts the prompt once (choice 0's), whatever the number of choices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi.responses import Response

from serving import openai_protocol as oai
from serving.frontend import TIERS
from serving.http_common import SSE_DONE, AbortingStreamingResponse, map_error, sse
from strata_jax.api import StreamChunk

ChunkStream = AsyncGenerator[StreamChunk, None]  # one choice's stream (closing it aborts the request)
Indexed = tuple[int, StreamChunk]  # a chunk tagged with its choice's index


class ChoiceTotals:
    """Accumulates the chunks of one choice."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish_reason = "abort"
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached: dict[str, int] = {t: 0 for t in TIERS}
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.text.append(chunk.text)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens = chunk.completion_tokens or self.completion_tokens
        if chunk.cached_tokens:
            self.cached = dict(chunk.cached_tokens)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"

    def usage(self) -> dict:
        return oai.usage(self.prompt_tokens, self.completion_tokens, self.cached)


async def _collect(stream: ChunkStream) -> ChoiceTotals:
    totals = ChoiceTotals()
    try:
        async for chunk in stream:
            totals.add(chunk)
    finally:
        await stream.aclose()
    return totals


async def collect_all(streams: list[ChunkStream]) -> list[ChoiceTotals]:
    """Run all streams; on the first failure cancel (abort) the rest and re-raise it."""
    tasks = [asyncio.ensure_future(_collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_item(stream: AsyncGenerator[Indexed, None]) -> Indexed | None:
    """The first item (admission errors surface here); ``None`` if the stream is empty."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await stream.aclose()
        raise


async def merged(streams: list[ChunkStream]) -> AsyncGenerator[Indexed, None]:
    """Chunks of several streams as they come, tagged with the stream's index; closing
    this generator closes (aborts) every stream."""
    queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: ChunkStream) -> None:
        try:
            async for chunk in s:
                await queue.put((i, chunk))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


def usage_of(totals: dict[int, ChoiceTotals]) -> dict:
    """Usage over the choices so far: the prompt once (choice 0's), completions summed."""
    lead = totals.get(0) or next(iter(totals.values()))
    return oai.usage(lead.prompt_tokens, sum(t.completion_tokens for t in totals.values()), lead.cached)


def sse_response(
    stream: AsyncGenerator[Indexed, None],
    first: Indexed | None,
    opening: list[dict],
    on_chunk: Callable[[int, StreamChunk], list[dict]],
    usage_chunk: Callable[[dict], dict] | None,
    *,
    continuous_usage: bool = False,
) -> Response:
    """An SSE response over merged choice streams: ``opening`` events, the events
    ``on_chunk`` makes of each chunk (each with the usage so far when
    ``continuous_usage``), the usage event (if the client asked for one), then ``[DONE]``."""

    async def events() -> AsyncIterator[str]:
        totals: dict[int, ChoiceTotals] = {}
        try:
            for event in opening:
                yield sse(event)
            item = first
            while item is not None:
                index, chunk = item
                totals.setdefault(index, ChoiceTotals()).add(chunk)
                for event in on_chunk(index, chunk):
                    if continuous_usage:
                        event["usage"] = usage_of(totals)
                    yield sse(event)
                item = await anext(stream, None)
            if usage_chunk is not None:
                yield sse(usage_chunk(usage_of(totals)))
            yield SSE_DONE
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
            err = map_error(exc)
            yield sse(oai.error_body(err.message, err.type, err.code))
        finally:
            await stream.aclose()

    return AbortingStreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
