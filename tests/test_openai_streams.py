"""``serving/openai_streams.py``'s SSE response: with ``first_unread`` (a prefill replica's part
of a disaggregated stream) the opening events go out before the engine's first chunk, and an
admission error then arrives in-band, after them."""

from __future__ import annotations

import asyncio
import json

from serving.openai_streams import sse_response
from strata_jax.api import OverloadedError, StreamChunk


def _events(texts: list[str]) -> list[dict | str]:
    return [json.loads(t[6:]) if t.startswith("data: {") else t.strip() for t in texts]


def test_the_opening_goes_out_before_the_first_chunk():
    async def scenario() -> tuple[list[str], list[str]]:
        release = asyncio.Event()

        async def chunks():
            await release.wait()  # the prompt is still queued on the engine
            yield 0, StreamChunk(request_id="r", token_ids=[7], text="x", finished=True, finish_reason="length")

        response = sse_response(
            chunks(), None, [{"opening": True}], lambda _i, c: [{"text": c.text}], None, first_unread=True
        )
        body = response.body_iterator
        before = [await anext(body)]  # no chunk yet: the opening is out all the same
        release.set()
        after = [t async for t in body]
        return before, after

    before, after = asyncio.run(scenario())
    assert _events(before) == [{"opening": True}]
    assert _events(after) == [{"text": "x"}, "data: [DONE]"]


def test_an_admission_error_comes_in_band_after_the_opening():
    async def scenario() -> list[str]:
        async def refused():
            raise OverloadedError("the queue is full")
            yield  # an async generator

        response = sse_response(refused(), None, [{"opening": True}], lambda _i, _c: [], None, first_unread=True)
        return [t async for t in response.body_iterator]

    events = _events(asyncio.run(scenario()))
    assert events[0] == {"opening": True}
    assert "the queue is full" in events[1]["error"]["message"] and len(events) == 2
