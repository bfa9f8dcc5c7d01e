"""LoRA adapters through the OpenAI face, driven by the real ``openai`` client: ``model``
selects an adapter, ``/v1/models`` lists them with their base, vLLM's load/unload routes
work at run time, an adapter in use cannot be unloaded, and ``serve``'s flags parse."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from hf_reference import hf_logits, make_hf_model

pytest.importorskip("peft", reason="the LoRA references need peft (pip install -e '.[test]')")
openai = pytest.importorskip("openai")
from lora_reference import ALL_MODULES, save_random_adapter  # noqa: E402

from serving.config import ServerConfig  # noqa: E402
from serving.server import ThreadedServer  # noqa: E402
from serving.server_cli import lora_overrides  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from strata_jax.engine import Engine, EngineConfig

    root = tmp_path_factory.mktemp("lora_serving")
    base = make_hf_model("llama_tied", root / "base").eval()
    refs = {
        "first": save_random_adapter(base, root / "first", 8, 16, False, ALL_MODULES, 11),
        "second": save_random_adapter(base, root / "second", 4, 4, True, ["q_proj", "v_proj"], 12),
    }
    config = EngineConfig(
        model=str(root / "base"),
        warmup=False,
        show_progress=False,
        page_size=4,
        device_tokens=1024,
        max_context_tokens=256,
        max_loras=2,
        lora_modules=(("first", str(root / "first")),),
    )
    server = ThreadedServer(ServerConfig(port=0, grpc_port=0, grace_s=5.0), lambda: Engine(config)).start()
    try:
        yield server, root, base, refs
    finally:
        server.stop()


def _greedy(model, ids, n):
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids) :]


def _tokens(completion) -> list[int]:
    """Token ids of a completion of this tokenizer-less model (its logprobs name them ``<id>``)."""
    return [int(t.strip("<>")) for t in completion.choices[0].logprobs.tokens]


def test_model_field_selects_the_adapter_and_models_lists_it(served):
    server, root, base, refs = served
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    listed = {m.id: m for m in client.models.list().data}
    base_name = server.server.frontend.model_name
    assert set(listed) == {base_name, "first"}
    first = listed["first"].model_dump()
    assert first["parent"] == base_name and first["root"] == str(root / "first")
    prompt = np.random.default_rng(3).integers(0, 96, size=30).tolist()
    for model, ref in ((base_name, base), ("first", refs["first"])):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
        assert out.model == model
        assert _tokens(out) == _greedy(ref, prompt, 6), model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="second", prompt=prompt, max_tokens=2)
    metrics = httpx.get(f"{server.http_url}/metrics").text
    assert 'strata_lora_requests_total{adapter="first",status="length"} 1.0' in metrics
    assert 'strata_lora_completion_tokens_total{adapter="first"} 6.0' in metrics
    assert 'strata_lora_prompt_tokens_total{adapter="first"} 30.0' in metrics
    assert f'adapter="{base_name}"' not in metrics  # the base model's requests are not an adapter's


def test_load_and_unload_at_run_time_as_vllm_does(served):
    server, root, _base, refs = served
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    prompt = np.random.default_rng(4).integers(0, 96, size=25).tolist()
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(root / "second")})
        assert r.status_code == 200 and "second" in r.text
        out = client.completions.create(model="second", prompt=prompt, max_tokens=5, temperature=0, logprobs=0)
        assert _tokens(out) == _greedy(refs["second"], prompt, 5)
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(root / "second")})
        assert again.status_code == 400 and "already loaded" in again.text
        full = http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(root / "first")})
        assert full.status_code == 200  # the same content as "first": it shares first's slot, not a new one
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "nowhere")})
        assert bad.status_code == 400 and "not a directory" in bad.text
        flushed = http.post("/admin/flush_cache", json={"tier": "all", "lora_name": "second"})
        assert flushed.status_code == 200 and flushed.json() == {"flushed": "all", "lora_name": "second"}
        wrong = http.post("/admin/flush_cache", json={"tier": "host", "lora_name": "second"})
        assert wrong.status_code == 400 and "tier 'all'" in wrong.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "third"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="second", prompt=prompt, max_tokens=2)


def test_an_adapter_with_live_requests_is_not_unloaded(served):
    server, _root, _base, _refs = served
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    started, release = threading.Event(), threading.Event()
    result: dict = {}

    def stream():
        s = client.completions.create(model="first", prompt=[5, 6, 7], max_tokens=200, stream=True, temperature=0)
        for i, _chunk in enumerate(s):
            if i == 1:
                started.set()
                release.wait(60)
        result["done"] = True

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "first"})
    release.set()
    worker.join(120)
    assert busy.status_code == 409 and "live requests" in busy.text
    assert result.get("done")
    assert "first" in {m.id for m in client.models.list().data}


def test_serve_lora_flags():
    assert lora_overrides(False, None, None) == {}
    assert lora_overrides(True, None, None) == {"lora_modules": (), "max_loras": 1}
    assert lora_overrides(False, ["a=/x", '{"name": "b", "path": "/y"}'], None) == {
        "lora_modules": (("a", "/x"), ("b", "/y")),
        "max_loras": 2,
    }
    assert lora_overrides(False, ["a=/x"], 8) == {"lora_modules": (("a", "/x"),)}
    with pytest.raises(ValueError, match="expected name=path"):
        lora_overrides(False, ["nopath"], None)
    with pytest.raises(ValueError, match='needs "name" and "path"'):
        lora_overrides(False, ['{"name": "b"}'], None)


def test_grpc_generate_takes_the_adapter(served):
    import grpc

    from serving.grpc_client import StrataClient

    server, _root, _base, refs = served
    prompt = np.random.default_rng(9).integers(0, 96, size=20).tolist()
    with StrataClient(server.grpc_target) as client:
        tokens = [t for msg in client.generate(prompt, lora_name="first", max_tokens=5) for t in msg.token_ids]
        assert tokens == _greedy(refs["first"], prompt, 5)
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompt, lora_name="missing", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_serve_refuses_a_bad_adapter_at_start_naming_it(tmp_path):
    import subprocess
    import sys

    base = [sys.executable, "-m", "serving.cli", "serve", "--model", "tiny", "--port", "0", "--grpc-port", "0"]
    missing = subprocess.run(
        [*base, "--lora-modules", f"x={tmp_path / 'nowhere'}"], capture_output=True, text=True, timeout=300
    )
    assert missing.returncode == 1 and f"{tmp_path / 'nowhere'}: not a directory" in missing.stderr
    too_many = subprocess.run(
        [*base, "--max-loras", "1", "--lora-modules", "a=/x", "b=/y"], capture_output=True, text=True, timeout=300
    )
    assert too_many.returncode == 2 and "raise max_loras" in too_many.stderr


def test_serve_refuses_lora_flags_that_cannot_work():
    with pytest.raises(ValueError, match="is --served-model-name"):
        lora_overrides(False, ["base=/x"], None, "base")
    with pytest.raises(ValueError, match="--max-loras 0"):
        lora_overrides(True, None, 0)
