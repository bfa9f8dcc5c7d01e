"""Rope scalings of long-context checkpoints (yarn, longrope, dynamic NTK) against transformers.

Random-weight Llama / Qwen2 / Qwen3 models are saved to a folder and run by strata-jax
(``ModelRunner`` for logits, ``Engine`` for greedy tokens) and by transformers (float32,
CPU).  ``docs/models.md`` ("Rope scaling") gives the semantics; where they depart from
transformers (``dynamic`` past the original length, ``longrope``'s short/long choice) the
tests pin what transformers' own KV-cached generation does, or a plain numpy formula.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import save_random_hf_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.models.checkpoint import CONFIG_FILE, read_checkpoint_config
from strata_jax.models.config import ModelConfig, ModelConfigError
from strata_jax.models.loader import load_model
from strata_jax.models.rope import RopeApplication, apply_rope, inverse_frequencies, rope_application
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

FAMILIES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
# initializer_range 0.1 (not HF's 0.02): sharper attention, so a wrong rotation or a missing
# cos/sin factor moves the logits by far more than the 1e-4 tolerance
BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)
SHORT = [round(1.0 + 0.05 * i, 4) for i in range(8)]  # longrope divisors, head_dim 16 -> 8 pairs
LONG = [round(1.0 + 0.9 * i, 4) for i in range(8)]

# name: (family, max_position_embeddings, rope dict, extra config fields, logits length, spelling)
CASES: dict[str, tuple[str, int, dict, dict, int, str]] = {
    "llama_yarn4": (
        "llama",
        128,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {},
        100,
        "t5",
    ),
    # mscale without mscale_all_dim: transformers ignores it (attention factor from factor alone)
    "llama_yarn2_mscale_only": (
        "llama",
        128,
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "mscale": 0.707},
        {},
        120,
        "t5",
    ),
    "qwen3_yarn8_mscale_ratio_untruncated": (
        "qwen3",
        128,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
            "truncate": False,
        },
        {"head_dim": 32},
        100,
        "t5",
    ),
    "qwen2_yarn_attention_factor_t4_spelling": (
        "qwen2",
        100,
        {
            "rope_type": "yarn",
            "factor": 2.5,
            "original_max_position_embeddings": 40,
            "attention_factor": 1.25,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        {},
        100,
        "t4",
    ),
    # max_position_embeddings > original: long factors at every position (a sequence of 100 > 32: transformers too)
    "llama_longrope_long": (
        "llama",
        128,
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "short_factor": SHORT,
            "long_factor": LONG,
        },
        {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
        100,
        "t5",
    ),
    # max_position_embeddings == original: short factors (transformers too, within the original length)
    "qwen3_longrope_short_t4_spelling": (
        "qwen3",
        64,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 64,
            "short_factor": SHORT,
            "long_factor": LONG,
            "attention_factor": 1.1,
        },
        {"head_dim": 16},
        60,
        "t4",
    ),
    # within max_position_embeddings (the original length of dynamic NTK): the unscaled rope
    "llama_dynamic_within": ("llama", 128, {"rope_type": "dynamic", "factor": 4.0}, {}, 128, "t5"),
    "qwen3_dynamic_within_t4_spelling": (
        "qwen3",
        96,
        {"rope_type": "dynamic", "factor": 2.0},
        {"head_dim": 32},
        90,
        "t4",
    ),
}


def build(
    folder: Path,
    family: str,
    max_pos: int,
    rope: dict,
    extra: dict | None = None,
    *,
    spelling: str = "t5",
    seed: int = 0,
):
    """A random HF model with ``rope`` as its rope scaling, saved to ``folder`` (its config.json
    in the transformers-5 ``rope_parameters`` or transformers-4 ``rope_theta`` + ``rope_scaling``
    spelling); returns it (float32, eval)."""
    config = FAMILIES[family](
        **{**BASE, **(extra or {}), "max_position_embeddings": max_pos, "rope_scaling": dict(rope)}
    )
    model = save_random_hf_model(config, folder, seed)
    if spelling == "t4":
        raw = json.loads((folder / "config.json").read_text())
        params = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = params.pop("rope_theta")
        params["type"] = params.pop("rope_type")
        raw["rope_scaling"] = params
        (folder / "config.json").write_text(json.dumps(raw))
    return model


def fresh_rope(hf) -> None:
    """Reset transformers' rotary state (dynamic / longrope keep the last sequence's frequencies)."""
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    fresh_rope(hf)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(hf, prompt: list[int], n: int):
    """transformers' greedy continuation (KV-cached generate) and its per-step logits."""
    fresh_rope(hf)
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: else generate masks every token equal to pad_token_id
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits)[:, 0].float().numpy()


def runner(model, context: int = 512) -> ModelRunner:
    return ModelRunner(
        model,
        RunnerConfig(
            page_size=16, num_device_pages=64, max_batch_tokens=256, max_batch_size=2, max_context_tokens=context
        ),
    )


def engine_greedy(folder: Path, prompts: list[list[int]], n: int):
    engine = Engine(
        EngineConfig(
            model=str(folder),
            warmup=False,
            show_progress=False,
            page_size=16,
            device_tokens=2048,
            max_batch_tokens=64,
            max_batch_size=2,
            tiers="L1",
        )
    )
    try:
        return engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- config


def _hf_rope(family: str, max_pos: int, rope: dict, extra: dict | None = None, seq_len: int | None = None):
    config = FAMILIES[family](
        **{**BASE, **(extra or {}), "max_position_embeddings": max_pos, "rope_scaling": dict(rope)}
    )
    inv_freq, attention = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)
    return config, inv_freq.numpy(), attention


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_match_transformers(name):
    family, max_pos, rope, extra, _, _ = CASES[name]
    seq_len = max_pos if rope["rope_type"] == "longrope" else None  # longrope: the set transformers uses at our length
    config, ref, attention = _hf_rope(family, max_pos, rope, extra, seq_len=seq_len)
    ours = ModelConfig.from_hf_dict(config.to_dict())
    got = inverse_frequencies(ours)
    assert got.dtype == np.float32 and got.shape == ref.shape
    # float64 power rounded once: bit-equal to torch's float32 computation except where torch's own
    # pow is off by an ulp
    np.testing.assert_allclose(got, ref, rtol=2.5e-7, atol=0)
    assert (got != ref).sum() <= 1
    assert rope_application(ours).attention_factor == pytest.approx(attention, rel=1e-12)


def test_yarn_attention_factor_rules():
    def factor(**rope):
        config = ModelConfig.from_hf_dict(
            dict(
                model_type="llama",
                vocab_size=8,
                hidden_size=64,
                intermediate_size=8,
                num_hidden_layers=1,
                num_attention_heads=4,
                max_position_embeddings=4096,
                rope_scaling={"rope_type": "yarn", **rope},
            )
        )
        return config.rope_scaling.attention_factor

    assert factor(factor=4.0, original_max_position_embeddings=1024) == pytest.approx(0.1 * math.log(4) + 1)
    assert (
        factor(factor=4.0, original_max_position_embeddings=1024, attention_factor=0.9) == 0.9
    )  # replaces, no product
    assert factor(factor=4.0, original_max_position_embeddings=1024, mscale=0.7) == pytest.approx(0.1 * math.log(4) + 1)
    ratio = (0.1 * 0.8 * math.log(4) + 1) / (0.1 * 0.5 * math.log(4) + 1)
    assert factor(factor=4.0, original_max_position_embeddings=1024, mscale=0.8, mscale_all_dim=0.5) == pytest.approx(
        ratio
    )
    # no factor: max_position_embeddings / original (DeepSeek), so 4096 / 512 = 8
    assert factor(factor=None, original_max_position_embeddings=512) == pytest.approx(0.1 * math.log(8) + 1)
    assert factor(factor=1.0, original_max_position_embeddings=4096) == 1.0


QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=36,
    bos_token_id=151643,
    eos_token_id=151645,
    hidden_act="silu",
    attention_bias=False,
)
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_qwen3_yarn_config_loads_and_context_follows_max_position_embeddings():
    config = ModelConfig.from_hf_dict(dict(QWEN3_8B, rope_scaling=QWEN3_YARN))
    s = config.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow, s.truncate) == (
        "yarn",
        4.0,
        32768,
        32.0,
        1.0,
        True,
    )
    assert s.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    assert (
        config.max_context_tokens == 131072
    )  # original 32768 x factor 4, as vLLM derives it (max_position_embeddings says 40960)
    assert (
        ModelConfig.from_hf_dict(
            dict(QWEN3_8B, max_position_embeddings=131072, rope_scaling=QWEN3_YARN)
        ).max_context_tokens
        == 131072
    )
    # the transformers-5 spelling reads the same
    t5 = dict(QWEN3_8B, max_position_embeddings=131072, rope_parameters={**QWEN3_YARN, "rope_theta": 1e6})
    t5.pop("rope_theta")
    assert ModelConfig.from_hf_dict(t5) == ModelConfig.from_hf_dict(
        dict(QWEN3_8B, max_position_embeddings=131072, rope_scaling=QWEN3_YARN)
    )
    # "type" (transformers 4's older key) and a top-level original_max_position_embeddings (Phi-3 style)
    # win as in transformers
    old = ModelConfig.from_hf_dict(
        dict(QWEN3_8B, original_max_position_embeddings=16384, rope_scaling={"type": "yarn", "factor": 4.0})
    )
    assert old.rope_scaling.rope_type == "yarn" and old.rope_scaling.original_max_position_embeddings == 16384


def test_qwen3_yarn_tiny_model_matches_transformers(tmp_path):
    """The published Qwen3 yarn block (factor 4 over 32768) on a tiny random Qwen3."""
    hf = build(tmp_path, "qwen3", 131072, QWEN3_YARN, {"head_dim": 32, "rope_theta": 1e6})
    loaded = load_model(str(tmp_path))
    assert loaded.config.max_context_tokens == 131072
    ids = np.random.default_rng(7).integers(0, 96, size=64).tolist()
    ours = runner(loaded.model).step([SeqInput(ids, 0, list(range(4)))], all_logits=True).logits
    ref = hf_logits(hf, ids)
    assert np.abs(ours - ref).max() <= 1e-4


def test_dynamic_and_longrope_config_fields():
    base = dict(
        model_type="llama",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    dyn = ModelConfig.from_hf_dict(
        dict(base, max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    )
    assert dyn.max_context_tokens == 8192  # factor x the unscaled length the NTK base grows from
    assert rope_application(dyn) == RopeApplication(1.0, (10000.0, 2.0, 4096, 16))
    phi = dict(
        base,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    )
    cfg = ModelConfig.from_hf_dict(phi)
    assert cfg.max_context_tokens == 131072 and cfg.rope_scaling.factor == 32.0  # 131072 / 4096
    assert cfg.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_checkpoint_config_round_trip_keeps_rope_fields(tmp_path):
    config = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=8,
            hidden_size=64,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=128,
            rope_scaling={
                "rope_type": "longrope",
                "original_max_position_embeddings": 32,
                "short_factor": SHORT,
                "long_factor": LONG,
            },
        )
    )
    (tmp_path / CONFIG_FILE).write_text(json.dumps(asdict(config)))
    back = read_checkpoint_config(tmp_path)
    assert back == config and hash(back) == hash(config)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}},
            "short_factor has 7 entries",
        ),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, "long_factor=None"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": -2.0}}, "factor=-2.0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}}, "truncate='no'"),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "dynamic' needs a factor"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5",
        ),
        ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "rope_type='su' is not supported"),
    ],
)
def test_rope_configs_refused(raw, match):
    base = dict(
        model_type="llama",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict({**base, **raw})


def test_gemma3_global_layers_refuse_yarn():
    raw = dict(
        model_type="gemma3_text",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        rope_scaling={"rope_type": "yarn", "factor": 8.0},
    )
    with pytest.raises(ModelConfigError, match="rope_type='yarn' on gemma3_text"):
        ModelConfig.from_hf_dict(raw)


# ----------------------------------------------------------------------------- models vs transformers


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    family, max_pos, rope, extra, length, spelling = CASES[name]
    hf = build(tmp_path, family, max_pos, rope, extra, spelling=spelling)
    loaded = load_model(str(tmp_path))
    assert loaded.config.rope_scaling.rope_type == rope["rope_type"]
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 96, size=length).tolist()
    ours = runner(loaded.model).step([SeqInput(ids, 0, list(range(8)))], all_logits=True).logits
    ref = hf_logits(hf, ids)
    assert np.abs(ours - ref).max() <= 1e-4, name
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), name
    # greedy through the engine; every sequence stays where transformers agrees (see CASES)
    n = 16
    start = 40 if rope["rope_type"] == "longrope" and max_pos > rope["original_max_position_embeddings"] else 8
    prompts = [rng.integers(0, 96, size=start).tolist(), rng.integers(0, 96, size=min(length, max_pos) - n).tolist()]
    outs = engine_greedy(tmp_path, prompts, n)
    for prompt, out in zip(prompts, outs):
        tokens, logits = hf_greedy(hf, prompt, n)
        assert out.token_ids == tokens, name
        ref_lp = torch.log_softmax(torch.from_numpy(logits), -1).numpy()[np.arange(n), tokens]
        assert np.abs(np.asarray([lp.logprob for lp in out.logprobs]) - ref_lp).max() <= 1e-4, name


def test_dynamic_past_the_original_length_matches_transformers_cached_generation(tmp_path):
    """Past max_position_embeddings a token is rotated with the NTK base transformers uses for a
    sequence ending at it: exactly what transformers' KV-cached generate does token by token
    after a prompt within the original length (each step recomputes the base for seq_len =
    position + 1; earlier keys keep theirs)."""
    hf = build(tmp_path, "llama", 64, {"rope_type": "dynamic", "factor": 4.0})
    loaded = load_model(str(tmp_path))
    assert loaded.config.max_context_tokens == 256
    prompt = np.random.default_rng(3).integers(0, 96, size=50).tolist()
    n = 70  # to position 119, far past 64
    tokens, ref_logits = hf_greedy(hf, prompt, n)
    r = runner(loaded.model)
    pages = list(range(8))
    got = [r.step([SeqInput(prompt, 0, pages)], all_logits=True).logits[-1]]
    ids = prompt + [int(got[-1].argmax())]
    for _ in range(n - 1):
        got.append(r.step([SeqInput(ids[-1:], len(ids) - 1, pages)], all_logits=True).logits[-1])
        ids.append(int(got[-1].argmax()))
    assert ids[len(prompt) :] == tokens
    assert np.abs(np.stack(got) - ref_logits).max() <= 1e-4
    # the engine's greedy tokens too (prefill in chunks, then decodes)
    assert engine_greedy(tmp_path, [prompt], n)[0].token_ids == tokens


def test_dynamic_kv_depends_on_position_only(tmp_path):
    """A sequence past the original length gives the same logits whether it is prefilled at
    once, in chunks or token by token (what keeps cached prefixes valid on every tier)."""
    build(tmp_path, "qwen3", 32, {"rope_type": "dynamic", "factor": 3.0}, {"head_dim": 32})
    loaded = load_model(str(tmp_path))
    ids = np.random.default_rng(4).integers(0, 96, size=90).tolist()
    whole = runner(loaded.model).step([SeqInput(ids, 0, list(range(8)))], all_logits=True).logits
    r = runner(loaded.model)
    parts = [
        r.step([SeqInput(ids[a:b], a, list(range(8)))], all_logits=True).logits
        for a, b in ((0, 20), (20, 57), (57, 90))
    ]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5, rtol=0)


def _numpy_dynamic_rope(x: np.ndarray, positions: np.ndarray, theta: float, factor: float, original: int) -> np.ndarray:
    """The chosen dynamic-NTK formula in float64: position p rotates with base
    theta * (factor * max(p + 1, L) / L - (factor - 1)) ** (d / (d - 2))."""
    dim = x.shape[-1]
    seq = np.maximum(positions + 1, original).astype(np.float64)
    base = theta * (factor * seq / original - (factor - 1)) ** (dim / (dim - 2))
    inv = base[:, None] ** (-np.arange(0, dim, 2, dtype=np.float64)[None, :] / dim)
    ang = positions[:, None].astype(np.float64) * inv
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_dynamic_rotation_matches_numpy_formula():
    config = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=8,
            hidden_size=128,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=1024,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "dynamic", "factor": 8.0},
        )
    )
    positions = np.array([0, 5, 1022, 1023, 1024, 1500, 3000, 5000, 8191], np.int32)
    x = np.random.default_rng(5).standard_normal((positions.size, 2, 64)).astype(np.float32)
    got = np.asarray(
        apply_rope(
            jnp.asarray(x), jnp.asarray(positions), jnp.asarray(inverse_frequencies(config)), rope_application(config)
        )
    )
    ref = _numpy_dynamic_rope(x.astype(np.float64), positions, 10000.0, 8.0, 1024)
    # float32 angles of up to ~8000 rad: ~1e-3 absolute phase error at the highest frequency
    np.testing.assert_allclose(got, ref, atol=3e-3, rtol=0)
    # within the original length: exactly the unscaled rope
    plain = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(inverse_frequencies(config))))
    assert (got[:4] == plain[:4]).all()
    unscaled = _numpy_dynamic_rope(x.astype(np.float64), positions, 10000.0, 8.0, 10**9)  # L past every position
    assert np.abs(unscaled[5:] - ref[5:]).max() > 0.1  # past it the base really moved


def test_longrope_uses_long_factors_at_every_position(tmp_path):
    """max_position_embeddings > original: long factors even for a short sequence (where
    transformers would take the short ones) -- the same as transformers with short := long."""
    rope = {
        "rope_type": "longrope",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "short_factor": SHORT,
        "long_factor": LONG,
    }
    extra = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    build(tmp_path / "ours", "llama", 128, rope, extra)
    as_long = build(tmp_path / "ref", "llama", 128, {**rope, "short_factor": LONG}, extra)
    loaded = load_model(str(tmp_path / "ours"))
    ids = np.random.default_rng(6).integers(0, 96, size=20).tolist()  # within the original 32
    ours = runner(loaded.model).step([SeqInput(ids, 0, list(range(4)))], all_logits=True).logits
    assert np.abs(ours - hf_logits(as_long, ids)).max() <= 1e-4


# ----------------------------------------------------------------------------- a long prompt

LONG_PROMPT = 12288


def test_yarn_12k_prompt_greedy_matches_transformers(tmp_path):
    """A yarn-scaled (factor 4 over 4096) tiny Llama on a 12,288-token prompt: the engine's
    greedy tokens and their logprobs equal transformers' (3x past the original length)."""
    t0 = time.perf_counter()
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    extra = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    hf = build(tmp_path, "llama", 16384, rope, extra)
    prompt = np.random.default_rng(0).integers(0, 96, size=LONG_PROMPT).tolist()
    n = 8
    tokens, logits = hf_greedy(hf, prompt, n)
    engine = Engine(
        EngineConfig(
            model=str(tmp_path),
            warmup=False,
            show_progress=False,
            page_size=16,
            device_tokens=16384,
            max_batch_tokens=2048,
            max_batch_size=2,
            max_context_tokens=LONG_PROMPT + 16,
            tiers="L1",
        )
    )
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0))[0]
    finally:
        engine.shutdown()
    assert out.token_ids == tokens
    ref_lp = torch.log_softmax(torch.from_numpy(logits), -1).numpy()[np.arange(n), tokens]
    assert np.abs(np.asarray([lp.logprob for lp in out.logprobs]) - ref_lp).max() <= 1e-4
    print(f"12K yarn prompt: {time.perf_counter() - t0:.1f} s")
