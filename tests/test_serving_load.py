"""Overload (queue full -> 429 / RESOURCE_EXHAUSTED, nothing accepted lost) and a bounded load test.

The load test runs 32 concurrent streaming clients (24 HTTP/SSE, 8 gRPC) for ``STRATA_LOAD_SECONDS``
(default 10; the figure reported in docs/serving.md uses 30) and prints requests/s
and TTFT percentiles; ``STRATA_LOAD_REPORT=path.json`` also writes them to a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import grpc
import httpx
import pytest

from serving.grpc_client import StrataClient
from serving_harness import assert_no_leaks, start_server, wait_idle


def _wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_overload_rejects_promptly_and_loses_nothing_accepted():
    srv = start_server(max_waiting=2, max_running=1, step_s=0.01)
    try:
        engine, model = srv.frontend.engine(), srv.frontend.model_name
        engine.flush_cache("all")
        baseline = engine.cache_stats()["device_pool"]["used_pages"]
        n_tokens = min(150, engine.max_context_tokens - 64)
        results: list[tuple[int, str, int]] = []

        def accepted(i: int) -> None:
            body = {"model": model, "prompt": f"accepted request {i}", "max_tokens": n_tokens,
                    "ignore_eos": True, "temperature": 0}
            r = httpx.post(srv.http_url + "/v1/completions", json=body, timeout=300)
            data = r.json()
            results.append((r.status_code, data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]))

        threads = []
        for i in range(3):  # 1 running + 2 waiting = full
            t = threading.Thread(target=accepted, args=(i,))
            t.start()
            threads.append(t)
            stats_ok = lambda i=i: engine.cache_stats()["running"] + engine.cache_stats()["waiting"] >= i + 1  # noqa: E731
            assert _wait_for(stats_ok, 60), engine.cache_stats()
        assert engine.cache_stats()["waiting"] == 2, engine.cache_stats()

        # HTTP: 429 quickly, in OpenAI's error envelope, streaming or not
        for stream in (False, True):
            t0 = time.perf_counter()
            r = httpx.post(srv.http_url + "/v1/completions",
                           json={"model": model, "prompt": "one too many", "max_tokens": 4, "stream": stream}, timeout=30)
            assert r.status_code == 429, r.text
            assert time.perf_counter() - t0 < 1.0
            assert r.json()["error"]["message"] and r.headers.get("retry-after")
        # gRPC: RESOURCE_EXHAUSTED quickly
        with StrataClient(srv.grpc_target) as client:
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate("one too many", max_tokens=4))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert time.perf_counter() - t0 < 1.0

        for t in threads:
            t.join(300)
        assert sorted(results) == [(200, "length", n_tokens)] * 3  # every accepted request ran to the end
        assert_no_leaks(engine, baseline)
    finally:
        srv.stop()


SHARED = "You are a helpful assistant. Answer the question briefly. " * 2


async def _grpc_client(target: str, i: int, stop_at: float, ttfts: list[float], errors: list[str], done: list[int]) -> None:
    from serving.protos import strata_pb2, strata_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = strata_pb2_grpc.StrataStub(channel)
        n = 0
        while time.monotonic() < stop_at:
            request = strata_pb2.GenerateRequest(
                text=f"{SHARED} Question {i}-{n}: what is {i} * {n}?",
                params=strata_pb2.SamplingParams(max_tokens=16, temperature=0.0),
            )
            n += 1
            t0 = time.perf_counter()
            first, last = None, None
            try:
                async for msg in stub.Generate(request, timeout=120):
                    first = first if first is not None else time.perf_counter() - t0
                    last = msg
            except grpc.aio.AioRpcError as exc:
                errors.append(f"grpc {exc.code().name}: {exc.details()}")
                continue
            if last is None or not last.finished:
                errors.append("grpc stream ended without a final message")
                continue
            ttfts.append(first or 0.0)
            done.append(1)


async def _client(url: str, model: str, i: int, stop_at: float, ttfts: list[float], errors: list[str], done: list[int]) -> None:
    shared = SHARED
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        n = 0
        while time.monotonic() < stop_at:
            body = {"model": model, "prompt": f"{shared} Question {i}-{n}: what is {i} + {n}?",
                    "max_tokens": 16, "temperature": 0, "stream": True}
            n += 1
            t0 = time.perf_counter()
            first = None
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    finished = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            break
                        data = json.loads(payload)
                        if "error" in data:
                            errors.append(str(data["error"]))
                            break
                        if first is None:
                            first = time.perf_counter() - t0
                        finished = finished or any(c.get("finish_reason") for c in data["choices"])
                    if not finished:
                        errors.append("stream ended without a finish_reason")
                        continue
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                continue
            ttfts.append(first or 0.0)
            done.append(1)


def test_load_32_streaming_clients():
    seconds = float(os.environ.get("STRATA_LOAD_SECONDS", "10"))
    clients = int(os.environ.get("STRATA_LOAD_CLIENTS", "32"))
    srv = start_server(max_waiting=256, max_running=32)
    try:
        engine, model = srv.frontend.engine(), srv.frontend.model_name
        engine.flush_cache("all")
        baseline = engine.cache_stats()["device_pool"]["used_pages"]
        ttfts: list[float] = []
        errors: list[str] = []
        done: list[int] = []

        async def main() -> float:
            t0 = time.monotonic()
            stop_at = t0 + seconds
            await asyncio.gather(
                *(
                    _grpc_client(srv.grpc_target, i, stop_at, ttfts, errors, done)
                    if i % 4 == 3  # a quarter of the clients use gRPC, the rest SSE
                    else _client(srv.http_url, model, i, stop_at, ttfts, errors, done)
                    for i in range(clients)
                )
            )
            return time.monotonic() - t0

        elapsed = asyncio.run(main())
        assert not errors, errors[:5]
        assert done, "no request completed"
        ttfts.sort()
        report = {
            "clients": clients,
            "seconds": round(elapsed, 2),
            "requests": len(done),
            "requests_per_s": round(len(done) / elapsed, 2),
            "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "errors": len(errors),
            "engine": type(engine).__module__,
        }
        print("LOAD", json.dumps(report))
        if os.environ.get("STRATA_LOAD_REPORT"):
            with open(os.environ["STRATA_LOAD_REPORT"], "w") as f:
                json.dump(report, f)
        stats = wait_idle(engine)
        assert stats["locked_nodes"] == 0
        assert_no_leaks(engine, baseline)
    finally:
        srv.stop()
