"""Fault matrix, L2: the host pool exhausted by a burst of long prompts.

A real server (tiny engine, tiers L1+L2) with a small L1 (4,096 tokens: three 1,200-token
prompts) and a host pool a quarter of it (``hicache_ratio`` 0.25: 1,024 tokens, less than
one prompt), ``max_waiting`` 4; then 16 long prompts at once (pairs share a 1,000-token
document, so the second of a pair can hit the first's pages in L1 or L2 while they are being
evicted).  Once under ``write_through`` (every new node backed up to the full L2) and once
under ``write_back`` (L1 evictions need room in the full L2).

Checks: every answer is 200 or 429 (admission refused, with ``Retry-After``), never 5xx;
every 200 has its prompt's cold tokens (each prompt's cold run on the same server, every tier
flushed before it); the refused ones succeed, with their cold tokens, when sent again; no
leaked page; the server alive.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import fault_backends as fb
import httpx
import pytest
from serving_harness import assert_no_leaks, real_engine_available, start_server, wait_idle, with_baseline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOCS, QUESTIONS, DOC_TOKENS, QUESTION_TOKENS = 8, 2, 1000, 200


def _prompts() -> list[list[int]]:
    rng = random.Random(2024)
    out = []
    for _ in range(DOCS):
        doc = [rng.randrange(3, 250) for _ in range(DOC_TOKENS)]
        for _ in range(QUESTIONS):
            out.append(doc + [rng.randrange(3, 250) for _ in range(QUESTION_TOKENS)])
    return out


@pytest.fixture(scope="module", params=["write_through", "write_back"])
def server(request):
    if not real_engine_available():
        pytest.skip("needs the real engine")
    srv = start_server(
        max_waiting=4,
        max_running=8,
        max_context_tokens=2048,
        device_tokens=4096,
        tiers="L1+L2",
        hicache_ratio=0.25,
        write_policy=request.param,
    )
    yield with_baseline(srv)
    srv.stop(30.0)


def test_host_pool_exhausted_by_a_burst(server):
    url, engine = server.http_url, server.frontend.engine()
    stats = engine.cache_stats()
    assert stats["host_pool"]["total_pages"] * 16 < DOC_TOKENS + QUESTION_TOKENS, stats["host_pool"]  # L2 < one prompt
    errors = fb.server_errors(server)
    prompts = _prompts()
    cold = []
    for p in prompts:
        engine.flush_cache("all")
        r = fb.complete(url, p, max_tokens=8)
        assert r.status_code == 200 and fb.cached(r) == {"device": 0, "host": 0, "storage": 0}, r.text
        cold.append(fb.tokens_of(r))
    engine.flush_cache("all")
    evicted_before = engine.cache_stats()["evictions"]["host"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: fb.complete(url, p, max_tokens=8), prompts))
    statuses = [a.status_code for a in answers]
    assert set(statuses) <= {200, 429}, [
        (a.status_code, a.text[:300]) for a in answers if a.status_code not in (200, 429)
    ]
    assert statuses.count(200) >= 1
    for a, c in zip(answers, cold):
        if a.status_code == 200:
            fb.assert_same_tokens(a, c)
        else:
            assert a.headers.get("retry-after"), a.headers
    refused = [i for i, a in enumerate(answers) if a.status_code == 429]
    for i in refused:  # sent again once the burst is over: served, the cold tokens
        fb.assert_same_tokens(fb.complete(url, prompts[i], max_tokens=8), cold[i])
    after = engine.cache_stats()
    print(
        f"\n{engine.config.write_policy}: {statuses.count(200)} answered, {len(refused)} refused (429) of "
        f"{len(prompts)}; host pool {after['host_pool']}; hits {after.get('hit_tokens')}"
    )
    assert after["evictions"]["host"] > evicted_before  # L2 really was full
    assert fb.server_errors(server) == errors
    fb.assert_alive(url)
    wait_idle(engine)
    acc = engine.check_accounting()  # tree invariants and exact page accounting
    assert acc["live_requests"] == acc["device_request_pages"] == acc["locked_nodes"] == acc["transient_nodes"] == 0, (
        acc
    )
    engine.flush_cache("all")
    left = engine.cache_stats()
    assert left["device_pool"]["used_pages"] <= server.baseline_used and left["host_pool"]["used_pages"] == 0, (  # type: ignore[attr-defined]
        f"flush_cache('all') left L1 {left['device_pool']} and L2 {left['host_pool']} cached "
        f"({engine.config.write_policy}; the pages are owned by unlocked tree nodes, not leaked)"
    )
    assert_no_leaks(engine, server.baseline_used)  # type: ignore[attr-defined]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
