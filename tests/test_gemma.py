"""Gemma 2 / Gemma 3 and sliding-window Mistral / Qwen2 models against Hugging Face transformers.

* Configs: layer windows, rope bases, soft-caps and the Gemma defaults read as transformers reads them.
* Random small models (``hf_reference.SLIDING_CONFIGS``; windows of 12-16 tokens, prompts of 100)
  saved by transformers and loaded from the folder: logits equal transformers' in one forward, in
  an incremental paged decode past the window and in a ragged batch; with the window (or the
  soft-caps, or Gemma 3's local rope base) taken away they do not, so each feature is exercised.
* GGUF files written the way llama.cpp's converter writes ``gemma2`` / ``gemma3`` (norms + 1,
  Gemma's norm names, window pattern) load to the same logits, and ``convert`` gives a folder
  transformers loads to the same logits.
* The real gemma-3-270m (Q4_K_M GGUF from the registry, ``tests/real_model.py``): greedy tokens and
  logprobs through the Engine equal transformers' on a prompt of more than three windows, cold
  and with the prefix from L1, L2 and L3.  Skips, saying why, when the model cannot be fetched.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flax import nnx
from hf_reference import SLIDING_CONFIGS, hf_gemma3_270m_from_gguf, hf_logits, make_hf_model

from strata_jax.models.config import ModelConfig, ModelConfigError
from strata_jax.models.loader import load_model
from strata_jax.models.weights import model_class
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4


# ---- configs ------------------------------------------------------------------------------------

_GEMMA3_RAW = {
    "model_type": "gemma3_text",
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 7,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
}


def test_gemma3_config_transformers4_spelling_and_defaults():
    raw = dict(
        _GEMMA3_RAW, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_windows == (512, 512, 512, 512, 512, 0, 512)  # every 6th layer global (the default pattern)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 8.0  # global layers only
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.attention_scale == 256**-0.5 and cfg.final_logit_softcapping is None
    assert cfg.max_context_tokens == 131072  # a window no longer caps the context


def test_gemma3_config_transformers5_spelling():
    raw = dict(
        _GEMMA3_RAW,
        query_pre_attn_scalar=168,
        layer_types=["sliding_attention", "full_attention"] * 3 + ["sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_windows == (512, 0, 512, 0, 512, 0, 512)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.attention_scale == 168**-0.5


def test_gemma2_defaults_and_window_configs_of_other_families():
    gemma2 = ModelConfig.from_hf_dict(dict(_GEMMA3_RAW, model_type="gemma2", num_hidden_layers=4))
    assert gemma2.layer_windows == (512, 0, 512, 0)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)  # transformers' defaults
    assert not gemma2.qk_norm and gemma2.rope_local_theta is None
    base = {k: v for k, v in _GEMMA3_RAW.items() if k != "head_dim"} | {"num_hidden_layers": 4, "sliding_window": 64}
    assert ModelConfig.from_hf_dict(dict(base, model_type="mistral")).layer_windows == (64,) * 4
    assert ModelConfig.from_hf_dict(dict(base, model_type="llama")).layer_windows == ()  # transformers' Llama has none
    assert ModelConfig.from_hf_dict(dict(base, model_type="qwen2")).layer_windows == ()  # use_sliding_window off
    qwen = ModelConfig.from_hf_dict(dict(base, model_type="qwen2", use_sliding_window=True, max_window_layers=3))
    assert qwen.layer_windows == (0, 0, 0, 64) and qwen.max_context_tokens == 4096  # the model's, not the window
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert ModelConfig.from_hf_dict(
        dict(base, model_type="qwen2", use_sliding_window=True, layer_types=types)
    ).layer_windows == (0, 64, 0, 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["chunked_attention"] * 7}, r"layer_types \['chunked_attention'\] are not supported"),
        ({"layer_types": ["full_attention"]}, "one type per layer"),
        ({"sliding_window": -4}, "sliding_window=-4 must be null or a positive integer"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
        ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
        ({"final_logit_softcapping": "x"}, "final_logit_softcapping='x' must be null or a positive number"),
        ({"model_type": "gemma3", "text_config": {}}, "multimodal Gemma 3"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "scaled rope on local layers",
        ),
    ],
)
def test_configs_this_runtime_cannot_run_fail_in_one_line(change, message):
    with pytest.raises(ModelConfigError, match=message) as info:
        ModelConfig.from_hf_dict(dict(_GEMMA3_RAW, **change))
    assert "\n" not in str(info.value)


# ---- random models against transformers -----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str):
        if kind not in built:
            folder = tmp_path_factory.mktemp(kind)
            built[kind] = (folder, make_hf_model(kind, folder))
        return built[kind]

    return get


def _runner(model, page_size: int = 4, pages: int = 160) -> ModelRunner:
    return ModelRunner(
        model,
        RunnerConfig(
            page_size=page_size, num_device_pages=pages, max_batch_tokens=256, max_batch_size=4, max_context_tokens=512
        ),
    )


def _with_config(model, **changes):
    """The same weights under a config with ``changes`` (to show a feature matters)."""
    config = dataclasses.replace(model.config, **changes)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(params=0)))
    return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


def _forward(model, ids, page_size=4):
    return (
        _runner(model, page_size)
        .step([SeqInput(ids, 0, list(range(-(-len(ids) // page_size))))], all_logits=True)
        .logits
    )


# Taken away one at a time, each of these features moves the logits well past the tolerance:
# the comparisons above are sensitive to them (one compile each, so not every feature of every kind).
_ABLATIONS = {
    "mistral_window": {"layer_windows": ()},
    "qwen2_window": {},
    "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma3": {"layer_windows": (), "rope_local_theta": None},
}


@pytest.mark.parametrize("kind", sorted(SLIDING_CONFIGS))
def test_full_forward_logits_match_hf(hf_models, kind):
    folder, hf = hf_models(kind)
    loaded = load_model(str(folder))
    assert loaded.config.has_sliding_window
    ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=100).tolist()
    ref = hf_logits(hf, ids).numpy()
    ours = _forward(loaded.model, ids)
    assert np.abs(ours - ref).max() <= TOL, kind
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), kind
    if kind == "gemma3":  # per-layer values (window, rope table) static when unrolled, traced under scan
        unrolled = (
            ModelRunner(
                loaded.model,
                RunnerConfig(
                    page_size=4,
                    num_device_pages=160,
                    max_batch_tokens=256,
                    max_batch_size=4,
                    max_context_tokens=512,
                    scan_layers=False,
                ),
            )
            .step([SeqInput(ids, 0, list(range(25)))], all_logits=True)
            .logits
        )
        assert np.abs(unrolled - ours).max() <= 1e-5
    for field, value in _ABLATIONS[kind].items():
        ablated = _forward(_with_config(loaded.model, **{field: value}), ids)
        assert np.abs(ablated - ref).max() > 20 * TOL, f"{kind}: {field} made no difference"


@pytest.mark.parametrize(("kind", "page_size"), [("gemma3", 1), ("gemma2", 16)])
def test_incremental_paged_decode_past_the_window_matches_hf(hf_models, kind, page_size):
    folder, hf = hf_models(kind)
    loaded = load_model(str(folder))
    rng = np.random.default_rng(2)
    ids = rng.integers(0, loaded.config.vocab_size, size=70).tolist()
    num_pages = 160
    runner = _runner(loaded.model, page_size, pages=num_pages)
    pages = rng.permutation(num_pages)[: -(-len(ids) // page_size)].tolist()  # scattered, shuffled
    prefix = 30  # then 3 chunks of 7 (extends on a cached prefix crossing the window), then decodes
    got = [runner.step([SeqInput(ids[:prefix], 0, pages)], all_logits=True).logits]
    pos = prefix
    for _ in range(3):
        got.append(runner.step([SeqInput(ids[pos : pos + 7], pos, pages)], all_logits=True).logits)
        pos += 7
    for p in range(pos, len(ids)):
        got.append(runner.step([SeqInput([ids[p]], p, pages)], all_logits=True).logits)
    got = np.concatenate(got)
    ref = hf_logits(hf, ids).numpy()
    assert np.abs(got - ref).max() <= TOL
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_ragged_batch_of_extends_and_decodes_matches_hf(hf_models):
    folder, hf = hf_models("gemma3")
    loaded = load_model(str(folder))
    rng = np.random.default_rng(3)
    runner = _runner(loaded.model, 4, pages=128)
    seqs = [rng.integers(0, loaded.config.vocab_size, size=n).tolist() for n in (43, 9, 51)]
    page_sets = np.split(rng.permutation(120)[:39], 3)
    runner.step([SeqInput(ids[:done], 0, pages.tolist()) for ids, pages, done in zip(seqs, page_sets, (40, 8, 50))])
    batch = [
        SeqInput(seqs[0][40:43], 40, page_sets[0].tolist()),
        SeqInput(seqs[1][8:9], 8, page_sets[1].tolist()),
        SeqInput(seqs[2][50:51], 50, page_sets[2].tolist()),
    ]
    logits = runner.step(batch, all_logits=True).logits
    expected = np.concatenate(
        [
            hf_logits(hf, seqs[0]).numpy()[40:43],
            hf_logits(hf, seqs[1]).numpy()[8:9],
            hf_logits(hf, seqs[2]).numpy()[50:51],
        ]
    )
    assert np.abs(logits - expected).max() <= TOL


def test_checkpoint_round_trip_keeps_the_layer_windows(hf_models, tmp_path):
    from strata_jax.models.checkpoint import restore_checkpoint, save_checkpoint

    folder, _ = hf_models("gemma2")
    loaded = load_model(str(folder))
    restored = restore_checkpoint(save_checkpoint(loaded.model, tmp_path / "ckpt"))
    assert restored.config == loaded.config and type(restored) is type(loaded.model)
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(nnx.state(restored)), nnx.to_flat_state(nnx.state(loaded.model))
    ):
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()), err_msg=str(path))


# ---- GGUF ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_written_like_llama_cpp_loads_to_hf_logits(tmp_path, kind):
    pytest.importorskip("gguf")
    from gguf_reference import write_gguf

    # llama.cpp does not store query_pre_attn_scalar: outside the 27B models it is head_dim
    hf = make_hf_model(kind, tmp_path / "hf", query_pre_attn_scalar=32)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf")
    loaded = load_model(str(path))
    assert loaded.config.model_type == hf.config.model_type and loaded.config.layer_windows
    ids = np.random.default_rng(4).integers(0, loaded.config.vocab_size, size=60).tolist()
    ref = hf_logits(hf, ids).numpy()
    assert np.abs(_forward(loaded.model, ids) - ref).max() <= TOL
    if kind == "gemma2":
        return  # convert is the same code for both architectures
    out = tmp_path / "converted"
    cmd = [sys.executable, "-m", "serving.cli", "convert", str(path), str(out)]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", **__import__("os").environ},
    )
    assert done.returncode == 0, done.stderr
    import transformers

    assert load_model(str(out)).config == loaded.config  # the folder convert writes is the same model to us
    converted = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert json.loads((out / "config.json").read_text())["model_type"] == hf.config.model_type
    assert np.abs(hf_logits(converted, ids).numpy() - ref).max() <= TOL


# ---- the real gemma-3-270m ------------------------------------------------------------------------

NEW_TOKENS = 8
LONG_PROMPT_TOKENS = 1700  # > 3 windows of 512


@pytest.fixture(scope="module")
def gemma3_gguf() -> str:
    """The real gemma-3-270m Q4_K_M GGUF, fetched once; skips when it cannot be."""
    pytest.importorskip("gguf", reason="the real-model tests need the gguf extra: pip install -e '.[gguf]'")
    from real_model import FetchError, gemma3_gguf_path

    try:
        return str(gemma3_gguf_path())
    except FetchError as exc:
        pytest.skip(f"real model unavailable: {exc}")


# the L1 pool layer-first (the default) and with layer groups (--kv-layer-groups; heavy: 2 more minutes),
# whose 77 local-layer pages for 256 global ones (--kv-local-ratio 0.3) cannot hold the
# 1,700-token prompt's 106 pages: its local KV is trimmed as the prefill goes
@pytest.fixture(
    scope="module", params=[False, pytest.param(True, marks=pytest.mark.heavy)], ids=["layer_first", "grouped"]
)
def gemma_engine(request, gemma3_gguf, tmp_path_factory):
    from strata_jax.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=gemma3_gguf,
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            page_size=16,
            dtype="float32",
            device_tokens=4096,
            max_batch_tokens=512,
            max_batch_size=2,
            max_context_tokens=2048,
            prefetch_policy="wait_complete",
            prefetch_min_tokens=0,
            storage_dir=str(tmp_path_factory.mktemp("kv")),
            kv_layer_groups=request.param,
            kv_local_ratio=0.3 if request.param else 1.0,
        )
    )
    assert (engine.ctl.device_pool.grouped is not None) == request.param
    yield engine
    engine.shutdown()


def test_real_gemma3_loads_with_its_layer_pattern_and_tokenizer(gemma_engine):
    config = gemma_engine.model_config
    assert config.model_type == "gemma3_text" and config.num_layers == 18 and config.head_dim == 256
    assert config.layer_windows == ((512,) * 5 + (0,)) * 3  # 5 local layers to 1 global
    assert (config.rope_theta, config.rope_local_theta, config.query_pre_attn_scalar) == (1e6, 1e4, 256)
    tok = gemma_engine.tokenizer
    assert tok.bos_token_id == 2 and gemma_engine.eos_token_ids == (1,)
    assert tok.encode("The quick brown fox") == [2, 818, 3823, 8864, 37423]  # transformers' GGUF tokenizer's ids


@pytest.mark.slow  # ~2 min of CPU: transformers' GGUF load, a 1,700-token prompt through both, four tiers
def test_real_gemma3_greedy_tokens_and_logprobs_match_transformers_from_every_tier(gemma_engine, gemma3_gguf):
    from strata_jax.api import SamplingParams

    hf = hf_gemma3_270m_from_gguf(gemma3_gguf)
    tok = gemma_engine.tokenizer
    long_ids = tok.encode((REPO / "README.md").read_text() * 4)[:LONG_PROMPT_TOKENS]
    assert len(long_ids) == LONG_PROMPT_TOKENS
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    cold = gemma_engine.generate([long_ids], params)[0]
    with torch.no_grad():  # teacher-forced on our tokens: greedy agrees iff every argmax does
        logits = hf(torch.tensor([long_ids + cold.token_ids]), logits_to_keep=NEW_TOKENS + 1).logits[0, :-1].float()
    ref = torch.log_softmax(logits, dim=-1).numpy()
    assert cold.token_ids == ref.argmax(-1).tolist()
    got = np.asarray([lp.logprob for lp in cold.logprobs])
    assert np.abs(got - ref[np.arange(NEW_TOKENS), cold.token_ids]).max() <= 2e-3
    full_pages = LONG_PROMPT_TOKENS // 16 * 16
    l1 = gemma_engine.generate([long_ids], params)[0]
    gemma_engine.flush_cache("device")
    l2 = gemma_engine.generate([long_ids], params)[0]
    gemma_engine.flush_cache("device")
    gemma_engine.flush_cache("host")
    l3 = gemma_engine.generate([long_ids], params)[0]
    assert l1.cached_tokens["device"] == full_pages
    assert l2.cached_tokens["host"] == full_pages and l2.cached_tokens["device"] == 0
    assert l3.cached_tokens["storage"] == full_pages
    assert cold.token_ids == l1.token_ids == l2.token_ids == l3.token_ids
    if gemma_engine.ctl.local_pages is not None:
        assert gemma_engine.ctl.device_pool.local.evicted > 0  # trimmed, and exact all the same
