"""What a router asks of a worker (serving/worker_info.py): SGLang's /server_info, /model_info,
their older /get_ names, /get_load and /flush_cache, and the X-Strata-Instance header.

The field names and types are the ones sglang-router 0.3.2 deserializes (its
``discover_metadata.rs`` structs: a wrongly typed field voids the whole answer, and the
worker is then listed as ``unknown``); the values are checked against the engine itself.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serving_harness import fake_engine_factory, shared_server, wait_idle

import strata_jax
from serving import worker_info
from serving.config import ServerConfig
from serving.server import ThreadedServer

# sglang-router 0.3.2, src/core/steps/worker/local/discover_metadata.rs: `ServerInfo` and `ModelInfo`
# (every field Option<...>: absent or null is fine, another type is not).
ROUTER_SERVER_INFO = {
    "model_id": str,
    "model": str,
    "model_path": str,
    "served_model_name": str,
    "tp_size": int,
    "dp_size": int,
    "load_balance_method": str,
    "disaggregation_mode": str,
    "version": str,
    "max_batch_size": int,
    "max_total_tokens": int,
    "max_prefill_tokens": int,
    "max_running_requests": int,
    "max_num_reqs": int,
}
ROUTER_MODEL_INFO = {
    "model_path": str,
    "tokenizer_path": str,
    "is_generation": bool,
    "model_type": str,
    "architectures": list,
}


def _router_would_parse(body: dict, schema: dict) -> None:
    for name, typ in schema.items():
        value = body.get(name)
        if value is None:
            continue
        assert isinstance(value, typ) and not (typ is int and isinstance(value, bool)), (name, value)
        if typ is int:
            assert value >= 0, (name, value)  # usize


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


def test_server_info_is_what_the_router_reads(server, http):
    engine = server.frontend.engine()
    r = http.get("/server_info")
    assert r.status_code == 200
    body = r.json()
    _router_would_parse(body, ROUTER_SERVER_INFO)
    assert http.get("/get_server_info").json() == body  # the older name, same answer
    stats = engine.cache_stats()
    assert body["served_model_name"] == server.frontend.model_name == "tiny"
    assert body["model_path"] is None and body["tokenizer_path"] is None  # the embedded model: nothing on disk
    assert body["is_generation"] is True and body["tp_size"] == 1 and body["dp_size"] == 1
    assert body["version"] == strata_jax.__version__
    assert body["max_batch_size"] == engine.config.max_batch_size
    assert body["max_prefill_tokens"] == engine.config.max_batch_tokens
    assert body["max_running_requests"] == engine.config.resolved_max_running_requests
    assert body["max_total_tokens"] == stats["device_pool"]["total_pages"] * stats["device_pool"]["page_size"]
    assert body["context_length"] == engine.max_context_tokens
    assert body["page_size"] == engine.page_size == stats["device_pool"]["page_size"]
    assert body["tiers"] == engine.config.tiers and body["engine"] == "strata-jax"
    # the instance id names this server on every response, generation included
    iid = body["instance_id"]
    assert len(iid) == 16 and r.headers["x-strata-instance"] == iid
    for path in ("/health", "/v1/models", "/metrics", "/model_info", "/no-such-route"):
        assert http.get(path).headers["x-strata-instance"] == iid, path
    out = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert out.status_code == 200 and out.headers["x-strata-instance"] == iid
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "tiny", "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    ) as s:
        assert s.status_code == 200 and s.headers["x-strata-instance"] == iid
        assert any(line == "data: [DONE]" for line in s.iter_lines())


def test_model_info_is_what_the_router_reads(server, http):
    body = http.get("/model_info").json()
    _router_would_parse(body, ROUTER_MODEL_INFO)
    assert http.get("/get_model_info").json() == body
    assert body == {
        "model_path": None,
        "tokenizer_path": None,
        "served_model_name": "tiny",
        "is_generation": True,
        "model_type": "llama",  # the tiny model is a Llama
        "architectures": ["LlamaForCausalLM"],
        "max_context_length": server.frontend.engine().max_context_tokens,
    }


def test_get_load_counts_the_requests_in_flight(server, http):
    engine = server.frontend.engine()
    wait_idle(engine)
    assert http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    with (
        httpx.Client(base_url=server.http_url, timeout=60) as other,
        other.stream("POST", "/v1/completions", json=body) as s,
    ):
        lines = s.iter_lines()
        got = 0
        for line in lines:  # the prefill is done and some tokens are out
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        load = http.get("/get_load").json()
        assert len(load) == 1 and load[0]["dp_rank"] == 0
        assert load[0]["num_reqs"] == 1 and load[0]["num_waiting_reqs"] == 0
        assert len(prompt) < load[0]["num_tokens"] <= len(prompt) + 200  # its prompt and what it generated so far
    wait_idle(engine)
    for _ in range(100):  # closing the stream aborts the request; the count drops when it ends
        if http.get("/get_load").json()[0]["num_reqs"] == 0:
            break
        time.sleep(0.05)
    assert http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_sglang_flush_cache_drops_this_servers_tiers(server, http):
    body = {
        "model": "tiny",
        "prompt": "a prompt that is long enough to fill whole pages " * 4,
        "max_tokens": 1,
        "temperature": 0,
    }
    http.post("/v1/completions", json=body)
    again = http.post("/v1/completions", json=body).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] > 0  # the prompt's pages were cached
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json() == {"flushed": ["device", "host"]}
    cold = http.post("/v1/completions", json=body).json()["usage"]
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0 and cold["cached_tokens_per_tier"] == {
        "device": 0,
        "host": 0,
        "storage": 0,
    }


def test_worker_routes_need_the_api_key_and_wait_for_the_engine():
    gate = threading.Event()
    build = fake_engine_factory()

    def slow_build():
        gate.wait(60)
        return build()

    cfg = ServerConfig(port=0, grpc_port=0, api_key="s3cret", served_model_name="fleet-model", grace_s=2.0)
    srv = ThreadedServer(cfg, slow_build)
    srv.start_nowait()
    assert srv.server.bound.wait(30)
    key = {"Authorization": "Bearer s3cret"}
    routes = ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load")
    try:
        with httpx.Client(base_url=srv.http_url, timeout=30) as http:
            for path in routes:  # warming up: 503, as SGLang's worker is not ready either
                r = http.get(path, headers=key)
                assert r.status_code == 503 and "warming up" in r.json()["error"]["message"], path
            gate.set()
            assert srv.server.ready.wait(60)
            for path in routes:
                assert http.get(path).status_code == 401, path
                assert http.get(path, headers=key).status_code == 200, path
            assert http.post("/flush_cache").status_code == 401
            assert http.post("/flush_cache", headers=key).json() == {"flushed": ["device", "host"]}
            info = http.get("/server_info", headers=key).json()
            assert info["served_model_name"] == "fleet-model"  # --served-model-name: the router's model id
            assert http.get("/model_info", headers=key).json()["served_model_name"] == "fleet-model"
    finally:
        gate.set()
        srv.stop()


def test_model_and_tokenizer_paths(tmp_path, monkeypatch):
    assert worker_info.model_path("tiny") is None and worker_info.model_path(None) is None
    hf = tmp_path / "hf_model"
    hf.mkdir()
    assert worker_info.model_path(str(hf)) == str(hf)
    assert worker_info.tokenizer_path(str(hf)) is None  # a folder without tokenizer.json: no tokenizer to name
    (hf / "tokenizer.json").write_text("{}")
    assert worker_info.tokenizer_path(str(hf)) == str(hf)
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert worker_info.tokenizer_path(worker_info.model_path(str(gguf))) == str(gguf)  # the tokenizer is inside
    monkeypatch.chdir(tmp_path)
    assert worker_info.model_path("model.Q4_1.gguf") == str(gguf)  # absolute: the router runs elsewhere
