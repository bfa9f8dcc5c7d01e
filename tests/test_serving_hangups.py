"""Clients that hang up mid-stream cost the others nothing: aborts are queued for the engine
loop, never waited for on the server's event loop.

Eight clients stream long completions while a hundred others come and go, twelve at a
time; each of those reads a few chunks and hangs up (the run under test), or asks for
exactly that many tokens and reads to the end (the same run without the hang-ups: the
same engine load, ended by a stop rule instead of an abort).  The eight streams'
inter-token gaps while the others run must stay within 1.5x (p99) of the run without
hang-ups.  Before aborts stopped blocking, every hang-up stalled every stream for up to
a step.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from serving_harness import assert_no_leaks, shared_server

STREAMERS = 8
OTHERS = 100
IN_FLIGHT = 12  # others at once (8 + 12 stay below the shared server's 8 running + 32 waiting)
CUT = 3  # chunks an other client reads before it hangs up (or tokens it asks for)
STREAM_TOKENS = 400


@pytest.fixture(scope="module")
def server():
    return shared_server()


async def _stream(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, cut_after: int | None = None) -> list[float]:
    """Arrival times of the stream's chunks; with ``cut_after`` the client hangs up after that many."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread())[:200]
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            assert "error" not in json.loads(line[5:]), line
            times.append(time.perf_counter())
            if cut_after is not None and len(times) >= cut_after:
                break  # leaving the block closes the response mid-body: the connection drops
    return times


async def _run(url: str, model: str, *, hang_up: bool) -> tuple[list[float], int]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)  # every client its own connection
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        streams = [asyncio.create_task(_stream(http, model, f"stream number {i} says", STREAM_TOKENS)) for i in range(STREAMERS)]
        gate = asyncio.Semaphore(IN_FLIGHT)
        window: list[float] = []

        async def other(j: int) -> int:
            async with gate:
                window.append(time.perf_counter())
                if hang_up:
                    got = await _stream(http, model, f"client {j} hangs up", STREAM_TOKENS, cut_after=CUT)
                else:
                    got = await _stream(http, model, f"client {j} hangs up", CUT)
                window.append(time.perf_counter())
                return len(got)

        others = await asyncio.gather(*(other(j) for j in range(OTHERS)))
        results = await asyncio.gather(*streams)
    lo, hi = min(window), max(window)
    gaps = [b - a for times in results for a, b in zip(times[1:], times[2:]) if lo <= a and b <= hi]
    assert all(n == CUT for n in others), others
    assert all(len(t) == STREAM_TOKENS for t in results), [len(t) for t in results]
    return sorted(gaps), len(gaps)


def _p99(gaps: list[float]) -> float:
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def test_hang_ups_do_not_stall_the_other_streams(server):
    engine, model = server.frontend.engine(), server.frontend.model_name
    calm, n_calm = asyncio.run(_run(server.http_url, model, hang_up=False))
    rough, n_rough = asyncio.run(_run(server.http_url, model, hang_up=True))
    assert n_calm > 50 and n_rough > 50, (n_calm, n_rough)  # the streams ran while the others came and went
    print(f"HANGUPS p99 gap: {1e3 * _p99(calm):.1f} ms without hang-ups, {1e3 * _p99(rough):.1f} ms with {OTHERS}")
    assert _p99(rough) <= 1.5 * _p99(calm), (_p99(rough), _p99(calm))
    assert_no_leaks(engine, server.baseline_used)
