"""GPT-OSS (``model_type`` ``gpt_oss``) against transformers' ``GptOssForCausalLM``.

Random tiny HF models (float32, eager attention) are saved by transformers, with their sinks,
biases and norms randomised so every GPT-OSS part moves the logits: learned attention
sinks, alternating sliding (window 8 here, 128 in the real models) and full layers, q/k/v/o
biases, the router's bias, the experts' biases and clamped SwiGLU (a small
``swiglu_limit`` in one case so the clamps bite), YaRN rope.  Compared: full-prompt logits
(within 1e-4) through ``ModelRunner`` on the CPU's default kernels and on the pure-JAX
reference, the MoE block against a float64 brute force written here, the engine's greedy
tokens against ``generate`` cold and from L1, L2 and L3 at tp 1 and 2, and MXFP4 expert
checkpoints against transformers' own dequantization.  ``docs/models.md``, "GPT-OSS".
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import save_random_hf_model
from safetensors.numpy import load_file, save_file
from test_moe import _hf_greedy, _hf_logits, _runner, assert_greedy_from_every_tier, lazy_models, tier_engine

import pallas_kernels
from strata_jax.models import grouped_mlp
from strata_jax.models.config import ModelConfig, ModelConfigError
from strata_jax.models.loader import load_model
from strata_jax.models.moe import MoEBlock
from strata_jax.models.mxfp4 import dequantize
from strata_jax.models.weights import WeightLoadError, random_model
from strata_jax.runtime.model_runner import SeqInput

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    sliding_window=8,
    initializer_range=0.1,
)
CASES = {
    "clamped_4_experts_top2": dict(BASE, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.3),
    "32_experts_top4": dict(BASE, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=3),
    "8_experts_top1_mqa": dict(BASE, num_local_experts=8, num_experts_per_tok=1, num_key_value_heads=1),
}
PROMPT = np.random.default_rng(1).integers(0, 96, size=40).tolist()  # 5 windows of 8


def save_gpt_oss(folder: Path, seed: int = 3, **fields) -> torch.nn.Module:
    """A random GPT-OSS saved to ``folder``; sinks drawn with std 2 (the init's 0.1 would barely
    move the softmax), biases and norms randomised by ``save_random_hf_model``."""
    config = transformers.GptOssConfig(**fields)
    config._attn_implementation = "eager"  # the reference's sinks are in its eager attention
    hf = save_random_hf_model(config, folder, seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * 2)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lazy_models(tmp_path_factory, lambda case, folder: save_gpt_oss(folder, **CASES[case]))


# ----------------------------------------------------------------------------- config


def test_config_reads_what_transformers_builds(models):
    folder, hf = models("clamped_4_experts_top2")
    config = ModelConfig.from_pretrained(folder)
    assert config.layer_windows == (8, 0)  # even layers sliding, odd full
    assert config.attention_sinks and config.attention_bias and config.attention_out_bias
    moe = config.moe
    assert moe is not None
    assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_intermediate_size) == (4, 2, 32)
    assert moe.router_bias and moe.expert_bias and moe.norm_topk_prob
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 0.3)
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.factor == 32.0
    assert config.max_context_tokens == 4096 * 32
    assert config.num_parameters == sum(p.numel() for p in hf.parameters())


def test_a_config_json_without_rope_or_layer_types_takes_transformers_defaults():
    raw = {"model_type": "gpt_oss", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 32}
    raw.update(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = ModelConfig.from_hf_dict(raw)
    reference = transformers.GptOssConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert config.layer_windows == tuple(128 if t == "sliding_attention" else 0 for t in reference.layer_types)
    assert config.rope_theta == reference.rope_parameters["rope_theta"] == 150000.0
    assert config.rope_scaling.rope_type == "yarn"
    assert config.rope_scaling.original_max_position_embeddings == 4096
    assert config.moe is not None and (config.moe.num_experts, config.moe.num_experts_per_tok) == (128, 4)


@pytest.mark.parametrize(
    "fields, match",
    [({"swiglu_limit": 0}, "swiglu_limit"), ({"swiglu_alpha": "x"}, "swiglu_alpha"), ({"hidden_act": "gelu"}, "gelu")],
)
def test_bad_fields_are_refused(fields, match):
    raw = {"model_type": "gpt_oss", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 32}
    raw.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **fields)
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict(raw)


# ----------------------------------------------------------------------------- the MoE block


def brute_force_gpt_oss_moe(block: MoEBlock, x: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """transformers' GptOssMLP in float64 numpy: top-k of the router's logits (with its bias),
    softmax over those k, every picked expert's clamped SwiGLU with biases, weighted and summed."""
    x = x.astype(np.float64)
    logits = x @ np.asarray(block.gate.kernel[...], np.float64) + np.asarray(block.gate.bias[...], np.float64)
    picked = np.argsort(-logits, axis=-1, kind="stable")[:, : block.top_k]
    top = np.take_along_axis(logits, picked, -1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    e = block.experts
    gate, up, down = (np.asarray(p.kernel[...], np.float64) for p in (e.gate_proj, e.up_proj, e.down_proj))
    bg, bu, bd = (np.asarray(p.bias[...], np.float64) for p in (e.gate_proj, e.up_proj, e.down_proj))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for pick, expert in enumerate(picked[t]):
            g = np.minimum(x[t] @ gate[expert] + bg[expert], limit)
            u = np.clip(x[t] @ up[expert] + bu[expert], -limit, limit)
            hidden = (u + 1) * g / (1 + np.exp(-alpha * g))
            y[t] += weights[t, pick] * (hidden @ down[expert] + bd[expert])
    return y


@pytest.mark.parametrize("method", ["ragged_dot", "tiles"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_block_equals_the_brute_force_reference(method, tokens):
    config = ModelConfig.from_hf_dict(
        {"model_type": "gpt_oss", **BASE, "num_local_experts": 8, "num_experts_per_tok": 3, "swiglu_limit": 0.5}
    )
    model = random_model(config, seed=5)
    block = model.model.layers.mlp
    rng = np.random.default_rng(tokens)
    for proj in (block.gate, block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj):
        proj.bias[...] = jnp.asarray(rng.normal(size=proj.bias[...].shape) * 0.3, jnp.float32)
    layer0 = jax_first_layer(block)
    x = rng.normal(size=(tokens, 64)).astype(np.float32)
    with grouped_mlp.use_method(method):
        got = np.asarray(layer0(jnp.asarray(x)))
    expected = brute_force_gpt_oss_moe(layer0, x, 1.702, 0.5)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)


def jax_first_layer(stacked: MoEBlock) -> MoEBlock:
    """Layer 0 of a stacked block, as a block of its own."""
    from flax import nnx

    graphdef, state = nnx.split(stacked)
    return nnx.merge(graphdef, jax_tree_first(state))


def jax_tree_first(state):
    import jax

    return jax.tree.map(lambda a: a[0], state)


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(models, case):
    folder, hf = models(case)
    model = load_model(str(folder), show_progress=False).model
    ours = _runner(model).step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    ref = _hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4, case
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), case


@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_every_cpu_attention_path_gives_the_logits(models, backend):
    """Extend and decode through the chosen kernels (the xla backend: native kernels over a
    float32 pool, else the blocked attention); without the sinks the logits move far."""
    folder, hf = models("clamped_4_experts_top2")
    model = load_model(str(folder), show_progress=False).model
    with pallas_kernels.use_backend(backend):
        runner = _runner(model)
        prefill = runner.step([SeqInput(PROMPT[:30], 0, [0, 1])], all_logits=True).logits
        decode = runner.step([SeqInput(PROMPT[30:31], 30, [0, 1])], all_logits=True).logits
    ref = _hf_logits(hf, PROMPT[:31])
    assert np.abs(prefill - ref[:30]).max() <= 1e-4
    assert np.abs(decode[-1] - ref[30]).max() <= 1e-4
    model.model.layers.self_attn.sinks[...] = jnp.full_like(model.model.layers.self_attn.sinks[...], -1e9)
    without = _runner(model).step([SeqInput(PROMPT[:30], 0, [0, 1])], all_logits=True).logits
    assert np.abs(without - ref[:30]).max() > 1e-2


@pytest.mark.parametrize(
    "case, tp, groups",
    [
        ("clamped_4_experts_top2", 1, False),
        ("clamped_4_experts_top2", 2, True),
        pytest.param("32_experts_top4", 2, False, marks=pytest.mark.heavy),
        pytest.param("8_experts_top1_mqa", 1, True, marks=pytest.mark.heavy),
    ],
)
def test_engine_greedy_tokens_match_transformers_from_every_tier(models, tmp_path, case, tp, groups):
    """Cold, then the prompt's pages from L1, L2 and L3: tokens equal ``generate``'s.  With
    layer groups (``kv_layer_groups``) the sliding layers hold a smaller pool, their KV
    outside the running windows is trimmed and the tiers move only the windows a reuse needs."""
    folder, hf = models(case)
    prompt = PROMPT[:37]
    engine = tier_engine(
        folder, str(tmp_path / "kv"), tp, kv_layer_groups=groups, kv_local_ratio=0.3 if groups else 1.0
    )
    try:
        assert engine.model_config.layer_windows[:2] == (8, 0)
        assert engine.ctl.windows.moves == groups
        assert (engine.ctl.device_pool.grouped is not None) == groups
        assert_greedy_from_every_tier(engine, prompt, _hf_greedy(hf, prompt, 8))
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- MXFP4 checkpoints


def _random_mxfp4(rng, experts: int, rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = rng.integers(0, 256, size=(experts, rows, columns // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 7, 127 - 3, size=(experts, rows, columns // 32), dtype=np.uint8)
    return blocks, scales


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks, scales = _random_mxfp4(rng, 3, 10, 64)
    scales[0, 0, 0] = 0  # the smallest and largest exponents
    scales[1, 2, 1] = 254
    expected = _convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(dequantize(blocks, scales), expected.numpy())


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_weights(models, tmp_path):
    """The experts stored as blocks/scales pairs (as OpenAI's checkpoints hold them): the model
    loaded from them gives the logits of the HF model holding transformers' dequantization."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    source, _ = models("clamped_4_experts_top2")
    folder = tmp_path / "mxfp4"
    hf = save_gpt_oss(folder, **CASES["clamped_4_experts_top2"])
    tensors = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(7)
    e, f, d = 4, 32, 64
    with torch.no_grad():
        for layer, hf_layer in enumerate(hf.model.layers):
            for name, rows, columns in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
                blocks, scales = _random_mxfp4(rng, e, rows, columns)
                prefix = f"model.layers.{layer}.mlp.experts.{name}"
                del tensors[prefix]
                tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
                value = _convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
                )
                getattr(hf_layer.mlp.experts, name).copy_(value)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_model(str(folder), show_progress=False).model
    ours = _runner(model).step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    assert np.abs(ours - _hf_logits(hf, PROMPT)).max() <= 1e-4

    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="down_proj_blocks.*no model.layers.1.mlp.experts.down_proj_scales"):
        load_model(str(folder), show_progress=False)


def test_misshapen_expert_tensors_are_named(models, tmp_path):
    source, _ = models("clamped_4_experts_top2")
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj_bias"] = np.zeros((4, 63), np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"gate_up_proj_bias.*\(4, 63\).*\(4, 64\)"):
        load_model(str(folder), show_progress=False)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt_oss"


@pytest.mark.parametrize("platform", ["cuda", pytest.param("rocm", marks=pytest.mark.heavy)])
def test_tp2_step_lowers_for_gpu(platform, monkeypatch):
    """The tp 2 prefill step of a GPT-OSS model lowers for the GPUs from this CPU: the Pallas
    attention takes the sinks (its Triton call has one more operand than without), and the
    experts run as three ``chlo.ragged_dot``s over each device's 4 of the 8 experts."""
    from pallas_kernels.aot import gpu_lowering_target
    from strata_jax.runtime import sharding
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig

    monkeypatch.setenv("STRATA_KERNEL_BACKEND", "pallas")
    config = ModelConfig.from_hf_dict(
        {"model_type": "gpt_oss", **BASE, "num_local_experts": 8, "num_experts_per_tok": 2}
    )
    runner = ModelRunner(
        random_model(config),
        RunnerConfig(
            page_size=16,
            num_device_pages=97,
            max_batch_tokens=32,
            max_batch_size=2,
            max_context_tokens=128,
            kv_dtype="bfloat16",
            layer_weights="stacked",
        ),
        mesh=sharding.make_mesh(2),
    )
    with gpu_lowering_target(platform, mesh_axes={"tp": 2}):
        text = runner.lower_step(5, 1, decode=False, platforms=(platform,)).as_text()
    dots = [line for line in text.splitlines() if '"chlo.ragged_dot"(' in line]
    assert len(dots) == 3, dots
    assert all("tensor<4x" in line and "tensor<4xi32>" in line for line in dots)
    assert "manual_computation" in text and "triton" in text.lower()


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_the_published_gpt_oss_20b_config_reads_with_its_parameter_count():
    config = ModelConfig.from_hf_dict(GPT_OSS_20B)
    assert round(config.num_parameters / 1e9, 2) == 20.91  # OpenAI's model card: 20.9B total
    assert config.layer_windows == (128, 0) * 12 and config.max_context_tokens == 131072
    assert config.moe is not None and (config.moe.num_experts, config.moe.num_experts_per_tok) == (32, 4)


@pytest.mark.parametrize("method", ["fp8", "awq", None])
def test_other_quantized_checkpoints_are_refused_naming_the_method(method):
    raw = {**GPT_OSS_20B, "quantization_config": {"quant_method": method}}
    with pytest.raises(ModelConfigError, match=f"quant_method={method!r} is not supported"):
        ModelConfig.from_hf_dict(raw)
    llama = {k: GPT_OSS_20B[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")}
    llama.update(model_type="llama", num_hidden_layers=2, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ModelConfigError, match="quant_method='mxfp4' is not supported"):
        ModelConfig.from_hf_dict(llama)


def test_head_dim_and_kv_heads_default_as_gpt_oss_config_does():
    raw = {"model_type": "gpt_oss", "vocab_size": 32, "hidden_size": 96, "intermediate_size": 32}
    raw.update(num_hidden_layers=2, num_attention_heads=16)
    config = ModelConfig.from_hf_dict(raw)
    reference = transformers.GptOssConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert (config.head_dim, config.num_kv_heads) == (reference.head_dim, reference.num_key_value_heads) == (64, 8)


def test_bfloat16_is_as_close_to_the_float32_reference_as_transformers_bfloat16(models):
    """The GPU default dtype: strata-jax in bf16 (weights and KV) is within twice transformers'
    own bf16 error of the float32 logits (RMSNorm scales in float32, as GptOssRMSNorm does)."""
    folder, hf = models("clamped_4_experts_top2")
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    hf16.config._attn_implementation = "eager"
    ref = _hf_logits(hf, PROMPT)
    their_error = np.abs(_hf_logits(hf16.eval(), PROMPT) - ref).max()
    model = load_model(str(folder), dtype=jnp.bfloat16, show_progress=False).model
    ours = _runner(model, kv_dtype="bfloat16").step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    assert np.abs(ours - ref).max() <= 2 * their_error + 1e-2


@pytest.mark.parametrize("method", ["ragged_dot", "tiles"])
def test_tp2_runner_logits_with_each_grouped_method(models, method):
    """tp 2 over per-layer weights (the CPU default: kernels and expert biases picked per layer
    by a switch), the experts and their biases split over the devices, with the GPU's grouped
    matmul (``ragged_dot``) and the CPU's row tiles: logits as transformers'."""
    from strata_jax.runtime import sharding

    folder, hf = models("clamped_4_experts_top2")
    model = load_model(str(folder), show_progress=False).model
    with grouped_mlp.use_method(method):  # read while the step is traced
        runner = _runner(model, mesh=sharding.make_mesh(2))
        ours = runner.step([SeqInput(PROMPT[:20], 0, [0, 1])], all_logits=True).logits
    assert np.abs(ours - _hf_logits(hf, PROMPT[:20])).max() <= 1e-4
