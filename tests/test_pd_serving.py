"""Prefill/decode disaggregation through the HTTP faces (serving/disaggregation.py): a prefill
replica and a decode replica over one L3 directory, sent the same request at once with the
bootstrap fields sglang-router --pd-disaggregation adds (as the router does; the router
itself in front: tests/test_pd_router.py, heavy).  The decode replica's answer equals a lone
replica's, its prompt comes from L3, and without a prefill replica it answers after the
deadline all the same."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fault_backends import free_port

from serving.config import ServerConfig
from serving.disaggregation import Handoff, RoomBook, handoff_for
from serving.server import ThreadedServer
from serving.server_cli import check_role, role_engine_config
from strata_jax.engine.handoff import HandoffPolicy

PAGE = 16
DOCUMENT = " ".join(f"clause {i} of the shared agreement binds party {i % 7}." for i in range(30))


def _server(
    role: str, storage, handoff: HandoffPolicy | None = None, prefetch_policy: str = "cost", **server_fields
) -> ThreadedServer:
    """A tiny-model replica over the L3 directory ``storage`` (``server_fields``: more ``ServerConfig``)."""
    from strata_jax.engine import Engine, EngineConfig

    config = EngineConfig(
        model="tiny",
        warmup=False,
        show_progress=False,
        page_size=PAGE,
        device_tokens=8192,
        max_context_tokens=4096,
        tiers="L1+L2+L3",
        storage_dir=str(storage),
        prefetch_policy=prefetch_policy,
    )
    server_config = ServerConfig(
        port=0, grpc_port=0, grace_s=5.0, role=role, handoff=handoff or HandoffPolicy(), **server_fields
    )
    config = role_engine_config(role, config)  # as serve does
    return ThreadedServer(server_config, lambda: Engine(config)).start()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared_l3")
    servers = {
        "prefill": _server("prefill", shared),
        # a fixed 4 s (its own prefill times are unmeasured yet): the fallback test waits it out
        # (every page from L3: the tiny model computes so fast that the cost policy may not wait for the last ones)
        "decode": _server(
            "decode",
            shared,
            HandoffPolicy(base_s=4.0, prefill_factor=0.0, max_wait_s=4.0),
            "wait_complete",
        ),
        "alone": _server("both", tmp_path_factory.mktemp("alone_l3")),
    }
    warm = _chat("warming up the programs", max_tokens=2)  # (warmup=False: the first requests compile)
    for server in servers.values():
        httpx.post(f"{server.http_url}/v1/chat/completions", json=warm, timeout=300).raise_for_status()
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _chat(question: str, **extra) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{DOCUMENT}\n\n{question}"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return body | extra


def _router_fields(room: int) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": room}


def _both(replicas, body: dict) -> tuple[httpx.Response, httpx.Response]:
    """The request sent to the prefill and the decode replica at once, as the router does."""

    def post(name: str) -> httpx.Response:
        return httpx.post(f"{replicas[name].http_url}/v1/chat/completions", json=body, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(post, ("prefill", "decode"))
    return prefill, decode


def _metric(server: ThreadedServer, name: str) -> float:
    text = httpx.get(f"{server.http_url}/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_decode_replica_answers_as_one_replica_with_the_prompt_from_l3(replicas):
    body = _chat("Which party does clause 12 bind?")
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    prefill, decode = _both(replicas, {**body, **_router_fields(7)})
    assert prefill.status_code == 200 and decode.status_code == 200
    assert prefill.json()["usage"]["completion_tokens"] == 1  # the prefill replica ran the prompt and one token
    got = decode.json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    prompt_tokens = got["usage"]["prompt_tokens"]
    assert _metric(replicas["decode"], 'strata_pd_handoffs_total{outcome="complete"}') == 1
    assert _metric(replicas["decode"], "strata_pd_pages_received_total") == prompt_tokens // PAGE
    from_l3 = _metric(replicas["decode"], 'strata_request_cached_tokens_total{tier="storage"}')
    assert from_l3 == PAGE * (prompt_tokens // PAGE) and from_l3 >= 0.95 * prompt_tokens - PAGE
    assert _metric(replicas["prefill"], "strata_pd_prefills_total") == 1
    assert _metric(replicas["decode"], "strata_pd_handoff_to_first_token_seconds_count") == 1


def test_streamed_answers_are_the_lone_replicas(replicas):
    body = _chat("Name the party clause 3 binds.")
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    prefill, decode = _both(replicas, {**body, **_router_fields(8), "stream": True})
    assert prefill.status_code == 200 and decode.status_code == 200
    events = [line[6:] for line in decode.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == want["choices"][0]["message"]["content"]


def test_without_a_prefill_replica_the_decode_replica_computes_after_the_deadline(replicas):
    # the document's pages are in L3 from the tests before: the wait is for the question's (which
    # never come), the prompt then reads the document from L3 and computes the question
    body = _chat("What does clause 20 say?")
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    before = _metric(replicas["decode"], 'strata_pd_handoffs_total{outcome="deadline"}')
    got = httpx.post(
        f"{replicas['decode'].http_url}/v1/chat/completions", json={**body, **_router_fields(9)}, timeout=120
    )
    assert got.status_code == 200
    assert got.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert _metric(replicas["decode"], 'strata_pd_handoffs_total{outcome="deadline"}') == before + 1


def test_requests_without_a_room_are_served_as_usual_by_either_role(replicas):
    body = _chat("Which clause binds party 3 first?")
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    for name in ("prefill", "decode"):
        got = httpx.post(f"{replicas[name].http_url}/v1/chat/completions", json=body, timeout=120).json()
        assert got["choices"][0]["message"] == want["choices"][0]["message"], name
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_completions_with_a_list_of_prompts_carry_a_room_each(replicas):
    prompts = [f"{DOCUMENT} Question {i}:" for i in range(2)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 6, "temperature": 0}
    want = httpx.post(f"{replicas['alone'].http_url}/v1/completions", json=body, timeout=120).json()
    routed = {**body, "bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [None, None], "bootstrap_room": [1, 2]}

    def post(name: str) -> httpx.Response:
        return httpx.post(f"{replicas[name].http_url}/v1/completions", json=routed, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(post, ("prefill", "decode"))
    assert prefill.status_code == 200 and decode.status_code == 200
    assert [c["text"] for c in decode.json()["choices"]] == [c["text"] for c in want["choices"]]


def test_roles_need_a_shared_l3_and_write_through():
    from strata_jax.engine import EngineConfig

    check_role("both", EngineConfig(model="tiny", tiers="L1+L2"))
    with pytest.raises(ValueError, match="--tiers L1\\+L2\\+L3"):
        check_role("decode", EngineConfig(model="tiny", tiers="L1+L2"))
    with pytest.raises(ValueError, match="write_through"):
        check_role("prefill", EngineConfig(model="tiny", tiers="L1+L2+L3", write_policy="write_back"))
    check_role("decode", EngineConfig(model="tiny", tiers="L1+L2+L3", write_policy="write_back"))
    plain = EngineConfig(model="tiny", tiers="L1+L2+L3")
    assert role_engine_config("prefill", plain).publish_prefill_chunks  # its pages land as it goes
    assert role_engine_config("decode", plain) is plain and role_engine_config("both", plain) is plain
    with pytest.raises(ValueError, match="role"):
        ServerConfig(role="middle")


def test_a_bad_room_is_a_400_and_a_client_gone_while_waiting_leaves_nothing_behind(replicas):
    decode = replicas["decode"]
    bad = httpx.post(f"{decode.http_url}/v1/chat/completions", json=_chat("Q?", bootstrap_room="abc"), timeout=60)
    assert bad.status_code == 400 and "bootstrap_room" in bad.text
    # no prefill replica: the decode replica waits (4 s); the client hangs up after 0.5 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{decode.http_url}/v1/chat/completions", json={**_chat("Who hangs up?"), **_router_fields(11)}, timeout=0.5
        )
    deadline = time.monotonic() + 30
    while _metric(decode, "strata_requests_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(decode, "strata_requests_in_flight") == 0
    assert _metric(decode, 'strata_requests_total{api="http",status="cancelled"}') >= 1
    accounting = decode.frontend.engine().check_accounting()
    assert accounting["live_requests"] == 0 and accounting["locked_nodes"] == 0
    ok = httpx.post(f"{decode.http_url}/v1/chat/completions", json=_chat("Still there?"), timeout=120)
    assert ok.status_code == 200


def test_a_prefill_replica_tells_how_its_rooms_stand(replicas):
    prefill = replicas["prefill"]
    prefill_answer, _ = _both(replicas, {**_chat("Which clause names party 4?"), **_router_fields(21)})
    assert prefill_answer.status_code == 200

    def room(r: object) -> httpx.Response:
        return httpx.get(f"{prefill.http_url}/pd/rooms/{r}", timeout=10)

    assert room(21).json() == {"room": 21, "state": "done"}
    assert room(2**62).json() == {"room": 2**62, "state": "unknown"}
    assert room("abc").status_code == 400


def test_room_book_states():
    book = RoomBook(kept=2)
    assert book.state(1) == "unknown"
    book.start(1)
    book.start(1)  # the router retried the room: two requests hold it
    assert book.state(1) == "in_flight"
    book.end(1, prefilled=False)
    assert book.state(1) == "in_flight"
    book.end(1, prefilled=True)
    assert book.state(1) == "done"
    book.start(2)
    book.end(2, prefilled=False)
    assert book.state(2) == "failed"
    book.start(3)
    book.end(3, prefilled=True)
    assert [book.state(r) for r in (1, 2, 3)] == ["unknown", "failed", "done"]  # the oldest is forgotten


def test_router_fields_name_the_prefill_replicas_room_url():
    class Req:
        bootstrap_host, bootstrap_port, bootstrap_room = "10.0.0.7", 18100, 5

    assert handoff_for("decode", Req()) == Handoff("decode", 5, "http://10.0.0.7:18100/pd/rooms/5")
    assert handoff_for("prefill", Req()) == Handoff("prefill", 5, None)
    assert handoff_for("both", Req()) is None
    Req.bootstrap_host, Req.bootstrap_port = "::1", None
    assert handoff_for("decode", Req()) == Handoff("decode", 5, None)  # no bootstrap port: L3 and the deadline
    Req.bootstrap_port = 9
    assert handoff_for("decode", Req()).peer_url == "http://[::1]:9/pd/rooms/5"
    Req.bootstrap_host, Req.bootstrap_port, Req.bootstrap_room = ["h0", "h1"], [1, 2], [7, 8]
    assert handoff_for("decode", Req(), 1) == Handoff("decode", 8, "http://h1:2/pd/rooms/8")


@pytest.fixture(scope="module")
def patient_decode(tmp_path_factory, replicas):
    """A decode replica over the shared L3 that asks the prefill replica: its own deadline is
    0.5 s, so only what the prefill replica says keeps it waiting longer."""
    shared = Path(replicas["decode"].frontend.engine().config.storage_dir)
    policy = HandoffPolicy(base_s=0.5, prefill_factor=0.0, stall_s=1.0, max_wait_s=30.0, peer_poll_s=0.1)
    server = _server("decode", shared, policy)
    httpx.post(f"{server.http_url}/v1/chat/completions", json=_chat("warm", max_tokens=2), timeout=300)
    try:
        yield server
    finally:
        server.stop()


def test_the_decode_replica_waits_while_the_prefill_replica_holds_the_room_and_stops_when_it_fails(
    replicas, patient_decode
):
    prefill, decode = replicas["prefill"], patient_decode
    port = int(prefill.http_url.rsplit(":", 1)[1])
    body = _chat("Which clause binds party 6 last?")
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    prefill.frontend.rooms.start(31)  # queued there, behind other prompts
    routed = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 31}
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answer = pool.submit(httpx.post, f"{decode.http_url}/v1/chat/completions", json=routed, timeout=120)
        time.sleep(2.5)  # five times the decode replica's own deadline
        assert not answer.done()
        prefill.frontend.rooms.end(31, prefilled=False)  # then the prefill replica fails it
        got = answer.result()
    waited = time.monotonic() - started
    assert got.status_code == 200
    assert got.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert _metric(decode, 'strata_pd_handoffs_total{outcome="prefill_lost"}') == 1
    assert 2.5 <= waited < 10


def test_a_dead_prefill_replica_ends_the_wait_at_once(replicas, patient_decode):
    decode = patient_decode
    body = _chat("Which clause binds party 7?")
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    before = _metric(decode, 'strata_pd_handoffs_total{outcome="prefill_lost"}')
    routed = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 32}
    got = httpx.post(f"{decode.http_url}/v1/chat/completions", json=routed, timeout=120)
    assert got.status_code == 200
    assert got.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert _metric(decode, 'strata_pd_handoffs_total{outcome="prefill_lost"}') == before + 1


def _grpc_generate(server: ThreadedServer, prompt: str, room: int | None = None, peer_port: int = 0) -> list:
    """``Generate`` over gRPC, greedy, 12 tokens; ``room``: with the router's ``disaggregated_params``."""
    from serving.grpc_client import StrataClient
    from serving.protos import strata_pb2

    request = strata_pb2.GenerateRequest(text=prompt, params=strata_pb2.SamplingParams(max_tokens=12, temperature=0))
    if room is not None:
        request.disaggregated_params.CopyFrom(
            strata_pb2.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=peer_port, bootstrap_room=room)
        )
    with StrataClient(server.grpc_target) as client:
        return list(client.stub.Generate(request, timeout=120))


def test_grpc_carries_the_bootstrap_fields(replicas):
    """A router speaking gRPC: the same handoff as over HTTP (the prefill replica runs the prompt
    and one token, the decode replica answers as a lone replica with the prompt from L3, the
    prefill replica books the room for the decode replica to ask)."""
    prompt = f"Over gRPC: {DOCUMENT}\n\nWhich clause binds party 5 first?"  # a prefix no other test left in L1
    want = [t for r in _grpc_generate(replicas["alone"], prompt) for t in r.token_ids]
    assert len(want) == 12
    decode = replicas["decode"]
    complete = 'strata_pd_handoffs_total{outcome="complete"}'
    completed_before = _metric(decode, complete)
    prefills_before = _metric(replicas["prefill"], "strata_pd_prefills_total")
    peer_port = replicas["prefill"].server.http_port
    with ThreadPoolExecutor(2) as pool:
        prefill_replies, decode_replies = pool.map(
            lambda name: _grpc_generate(replicas[name], prompt, room=31, peer_port=peer_port), ("prefill", "decode")
        )
    assert [t for r in prefill_replies for t in r.token_ids] == want[:1]  # the prompt and one token
    assert [t for r in decode_replies for t in r.token_ids] == want
    usage = decode_replies[-1].usage
    assert usage.cached_tokens_per_tier.storage == PAGE * (usage.prompt_tokens // PAGE)
    assert _metric(decode, complete) == completed_before + 1
    assert _metric(replicas["prefill"], "strata_pd_prefills_total") == prefills_before + 1
    # the room ends as the handler closes its stream, just after the client has the last message
    deadline = time.monotonic() + 10
    while (state := httpx.get(f"{replicas['prefill'].http_url}/pd/rooms/31", timeout=10).json()["state"]) != "done":
        assert state == "in_flight" and time.monotonic() < deadline, state
        time.sleep(0.05)
    # no disaggregated_params: an ordinary request, whole, on either role
    assert [t for r in _grpc_generate(replicas["prefill"], prompt) for t in r.token_ids] == want


def test_a_short_prompt_is_decoded_at_once_without_waiting_for_the_prefill_replica(replicas, tmp_path):
    """A chat turn of a few dozen tokens (``--handoff-local-tokens 64``): a decode replica
    computes it at once (``local``) instead of waiting out its 30 s deadline with no prefill
    replica answering, and the answer is a lone replica's."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    want = httpx.post(f"{replicas['alone'].http_url}/v1/chat/completions", json=body, timeout=120).json()
    assert 16 < want["usage"]["prompt_tokens"] <= 64  # a full page or more, all of it short
    decode = _server("decode", tmp_path, HandoffPolicy(base_s=30.0, max_wait_s=30.0, local_tokens=64))
    try:
        t0 = time.monotonic()
        got = httpx.post(f"{decode.http_url}/v1/chat/completions", json={**body, **_router_fields(41)}, timeout=120)
        assert got.status_code == 200 and time.monotonic() - t0 < 20.0  # compiling included; no 30 s wait
        assert got.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert _metric(decode, 'strata_pd_handoffs_total{outcome="local"}') == 1
        assert _metric(decode, 'strata_pd_handoffs_total{outcome="deadline"}') == 0
    finally:
        decode.stop()
