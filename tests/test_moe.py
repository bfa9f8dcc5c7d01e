"""Mixture-of-experts models (qwen3_moe, qwen2_moe, mixtral) against transformers.

Random tiny HF models are saved by transformers (per-expert tensors, as the hub's
checkpoints hold them) and, rewritten, in transformers 5's fused layout; strata-jax loads
both.  Compared: full-prompt logits (float32, within 1e-4) through ``ModelRunner``, greedy
tokens through the real ``Engine`` against ``generate``, and the ``jax.lax.ragged_dot``
block against a brute-force reference (every expert on every token, masked by the
routing) written here, padding rows included.  ``docs/models.md``, "Mixture of experts".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_reference import save_random_hf_model
from safetensors.numpy import load_file
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

import pallas_kernels
from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig
from strata_jax.models import grouped_mlp
from strata_jax.models.checkpoint import read_checkpoint_config, restore_checkpoint, save_checkpoint
from strata_jax.models.config import ModelConfig, ModelConfigError, MoEConfig
from strata_jax.models.loader import load_model
from strata_jax.models.moe import MoEBlock
from strata_jax.models.weights import WeightLoadError, load_hf_weights, random_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

# initializer_range 0.1 (HF's 0.02 would leave the router near uniform): routing decides the
# logits, so a wrong pick moves them far past the 1e-4 tolerance
BASE = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)
QWEN_MOE = dict(BASE, intermediate_size=112, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
CASES: dict[str, tuple[type, dict]] = {
    "qwen3_moe_norm_topk": (transformers.Qwen3MoeConfig, dict(QWEN_MOE, head_dim=32, norm_topk_prob=True)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(QWEN_MOE, head_dim=32, norm_topk_prob=False, num_experts=4)),
    "mixtral": (
        transformers.MixtralConfig,
        dict(BASE, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
    "mixtral_window": (
        transformers.MixtralConfig,
        dict(BASE, intermediate_size=32, num_local_experts=6, num_experts_per_tok=3, sliding_window=16),
    ),
    "qwen2_moe_shared": (
        transformers.Qwen2MoeConfig,
        dict(QWEN_MOE, shared_expert_intermediate_size=48, num_experts_per_tok=3),
    ),
}
PROMPT = np.random.default_rng(1).integers(0, 96, size=48).tolist()  # 3 windows of mixtral_window's 16


def lazy_models(
    tmp_path_factory, build: Callable[[str, Path], torch.nn.Module]
) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``get(case) -> (folder, model)``: ``build(case, folder)`` saves the case's model in a fresh
    folder on its first use; later calls return the same pair (a module fixture's cache)."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(case: str) -> tuple[Path, torch.nn.Module]:
        if case not in built:
            folder = tmp_path_factory.mktemp(case)
            built[case] = (folder, build(case, folder))
        return built[case]

    return get


def saved_random_case(cases: dict[str, tuple[type, dict]], seed: int) -> Callable[[str, Path], torch.nn.Module]:
    """A ``lazy_models`` builder: the random HF model of ``cases[case]`` (config class, fields)."""
    return lambda case, folder: save_random_hf_model(cases[case][0](**cases[case][1]), folder, seed=seed)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Saved random HF models by case, built on first use: (folder, model)."""
    return lazy_models(tmp_path_factory, saved_random_case(CASES, seed=3))


def _runner(model, mesh=None, **overrides) -> ModelRunner:
    config = dict(page_size=16, num_device_pages=32, max_batch_tokens=64, max_batch_size=2, max_context_tokens=256)
    return ModelRunner(model, RunnerConfig(**{**config, **overrides}), mesh=mesh)


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: else generate masks every token equal to pad_token_id
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- config


def test_configs_read_as_transformers_builds_them(hf_models):
    expected = {
        "qwen3_moe_norm_topk": MoEConfig(8, 2, 32, norm_topk_prob=True),
        "qwen3_moe": MoEConfig(4, 2, 32, norm_topk_prob=False),
        "mixtral": MoEConfig(8, 2, 32, norm_topk_prob=True, float32_combine=True),
        "mixtral_window": MoEConfig(6, 3, 32, norm_topk_prob=True, float32_combine=True),
        "qwen2_moe_shared": MoEConfig(8, 3, 32, norm_topk_prob=False, shared_expert_intermediate_size=48),
    }
    for case, moe in expected.items():
        config_cls, kwargs = CASES[case]
        config = ModelConfig.from_hf_dict(config_cls(**kwargs).to_dict())
        assert config.moe == moe, case
        assert config.layer_windows == ((16, 16) if case == "mixtral_window" else ()), case
    qwen3 = ModelConfig.from_hf_dict(transformers.Qwen3MoeConfig(**CASES["qwen3_moe"][1]).to_dict())
    assert qwen3.qk_norm and not qwen3.attention_bias
    qwen2 = ModelConfig.from_hf_dict(transformers.Qwen2MoeConfig(**CASES["qwen2_moe_shared"][1]).to_dict())
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert not ModelConfig.from_hf_dict(
        transformers.Qwen2MoeConfig(**QWEN_MOE, qkv_bias=False).to_dict()
    ).attention_bias
    mixtral = ModelConfig.from_hf_dict(transformers.MixtralConfig(**CASES["mixtral"][1]).to_dict())
    assert mixtral.rope_theta == 1e6 and not mixtral.attention_bias  # Mixtral's own rope default
    # the fields as a hand-written config.json spells them, missing ones at transformers' defaults
    raw = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2) | dict(
        num_attention_heads=4
    )
    minimal = ModelConfig.from_hf_dict(raw)
    assert minimal.moe == MoEConfig(128, 8, 768, norm_topk_prob=False)  # Qwen3MoeConfig's defaults
    assert minimal.max_position_embeddings == 32768
    # the families' sliding windows: qwen3_moe every layer, qwen2_moe the even layers below max_window_layers
    windowed = ModelConfig.from_hf_dict(raw | dict(use_sliding_window=True, sliding_window=8))
    assert windowed.layer_windows == (8, 8)
    qwen2_raw = raw | dict(model_type="qwen2_moe", num_hidden_layers=4, use_sliding_window=True, sliding_window=8)
    assert ModelConfig.from_hf_dict(qwen2_raw | dict(max_window_layers=3)).layer_windows == (8, 0, 8, 0)
    assert ModelConfig.from_hf_dict(qwen2_raw | dict(max_window_layers=1)).layer_windows == (8, 0, 0, 0)
    hf_types = transformers.Qwen2MoeConfig(**{**QWEN_MOE, **qwen2_raw, "max_window_layers": 3}).layer_types
    assert [t == "sliding_attention" for t in hf_types] == [True, False, True, False]
    # num_experts 0: transformers builds every layer as the dense MLP, and so does this
    assert ModelConfig.from_hf_dict(raw | dict(num_experts=0)).moe is None


@pytest.mark.parametrize(
    ("fields", "dense"),
    [
        (dict(mlp_only_layers=[1]), [1]),
        (dict(decoder_sparse_step=2), [0]),
        (dict(decoder_sparse_step=2, num_hidden_layers=4, mlp_only_layers=[3]), [0, 2, 3]),
    ],
)
@pytest.mark.parametrize("family", [transformers.Qwen3MoeConfig, transformers.Qwen2MoeConfig])
def test_mixed_dense_and_moe_layers_are_the_ones_transformers_builds(family, fields, dense):
    """``mlp_only_layers`` / ``decoder_sparse_step``: the dense layers are those whose MLP
    transformers builds dense, and the parameter count is its model's (tests/test_moe_mixed.py
    runs them)."""
    hf_config = family(**{**QWEN_MOE, **fields})
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert [i for i, sparse in enumerate(config.layer_is_sparse) if not sparse] == dense
    assert config.mixed_mlp_layers
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")] == dense
    assert config.num_parameters == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds num_experts=8"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
        (dict(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
        (dict(attention_bias=True), "attention_bias=True is not supported for qwen3_moe"),
    ],
)
def test_bad_moe_fields_are_refused(fields, match):
    raw = dict(QWEN_MOE, model_type="qwen3_moe", **fields)
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict(raw)


def test_orbax_checkpoint_round_trip_keeps_the_moe_fields_and_experts(tmp_path):
    config = ModelConfig.from_hf_dict(transformers.Qwen2MoeConfig(**CASES["qwen2_moe_shared"][1]).to_dict())
    model = random_model(config)
    save_checkpoint(model, tmp_path / "ckpt")
    back = read_checkpoint_config(tmp_path / "ckpt")
    assert back == config and hash(back) == hash(config)
    saved, restored = (
        {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(m))}
        for m in (model, restore_checkpoint(tmp_path / "ckpt"))
    )
    assert saved.keys() == restored.keys()
    for path in saved:
        np.testing.assert_array_equal(restored[path], saved[path], err_msg=str(path))
    experts = saved["model", "layers", "mlp", "experts", "gate_proj", "kernel"]
    assert experts.shape == (2, 8, 64, 32) and not np.allclose(experts[0], experts[1])  # each layer its own draw


# ----------------------------------------------------------------------------- the block


def _moe_config(**moe) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe",
        vocab_size=32,
        hidden_size=48,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        moe=MoEConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "expert_intermediate_size": 40, **moe}),
    )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(x / 2))  # no overflow for large |x|


def brute_force_moe(block: MoEBlock, x: np.ndarray) -> np.ndarray:
    """Every expert on every token, each output weighted by the token's routing weight for that
    expert (0 when not picked); float64 numpy, independent of moe.py's sort/ragged_dot path."""
    x = x.astype(np.float64)
    logits = x @ np.asarray(block.gate.kernel[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    picked = np.argsort(-probs, axis=-1, kind="stable")[:, : block.top_k]
    weights = np.zeros_like(probs)
    np.put_along_axis(weights, picked, np.take_along_axis(probs, picked, -1), -1)
    if block.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    gate, up, down = (
        np.asarray(proj.kernel[...], np.float64)
        for proj in (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj)
    )
    y = np.zeros_like(x)
    for e in range(gate.shape[0]):
        g = x @ gate[e]
        y += weights[:, e : e + 1] * ((g * _sigmoid(g) * (x @ up[e])) @ down[e])
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        s = block.shared_expert
        g = x @ np.asarray(s.gate_proj.kernel[...], np.float64)
        shared = ((g * _sigmoid(g)) * (x @ np.asarray(s.up_proj.kernel[...], np.float64))) @ np.asarray(
            s.down_proj.kernel[...], np.float64
        )
        y += shared * _sigmoid(x @ np.asarray(block.shared_expert_gate.kernel[...], np.float64))
    return y


BLOCKS = {
    "qwen3_moe_top2": dict(),
    "qwen3_moe_norm_top3": dict(norm_topk_prob=True, num_experts_per_tok=3),
    "mixtral": dict(norm_topk_prob=True, float32_combine=True),
    "qwen2_moe_shared": dict(shared_expert_intermediate_size=24, num_experts_per_tok=4),
    "top1_of_2": dict(num_experts=2, num_experts_per_tok=1),
}


@pytest.mark.parametrize("method", ["ragged_dot", "tiles"])
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("case", sorted(BLOCKS))
def test_block_equals_the_brute_force_reference(case, tokens, method):
    """Both ways of computing the grouped experts (grouped_mlp: ragged_dot, the GPU's; row
    tiles, the CPU's)."""
    config = _moe_config(**{"norm_topk_prob": False, **BLOCKS[case]})
    block = MoEBlock(config, jnp.float32, nnx.Rngs(params=tokens), std=0.3)
    x = np.random.default_rng(tokens).normal(size=(tokens, config.hidden_size)).astype(np.float32)
    with grouped_mlp.use_method(method):
        got = np.asarray(jax.jit(lambda x: block(x))(x))
    np.testing.assert_allclose(got, brute_force_moe(block, x), rtol=2e-5, atol=2e-5)


def test_the_cpu_computes_the_experts_in_row_tiles_and_a_gpu_with_ragged_dot():
    assert jax.default_backend() == "cpu"
    assert grouped_mlp.resolve_method() == "tiles"
    with pallas_kernels.use_backend("pallas"):  # lowering for a GPU from this CPU host
        assert grouped_mlp.resolve_method() == "ragged_dot"
    with pytest.raises(ValueError, match="unknown grouped MLP method"):
        with grouped_mlp.use_method("dense"):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("rows", [1, 5, 64, 700])
@pytest.mark.parametrize("seed", [0, 1])
def test_row_tiles_equal_each_group_times_its_experts_kernels(rows, seed):
    """``grouped_mlp.tiles`` against a per-group numpy loop: empty groups, one group holding
    everything, rows past the groups' sum (zeros: expert parallelism's other devices' rows),
    and tile sizes from 1 to 128 rows."""
    rng = np.random.default_rng(seed)
    e, d, f = 6, 16, 12
    gate, up = (rng.normal(size=(e, d, f)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.normal(size=(e, f, d)).astype(np.float32) * 0.3
    x = rng.normal(size=(rows, d)).astype(np.float32)
    for sizes in (
        np.bincount(rng.integers(0, e, size=rows), minlength=e),  # every row in some group
        np.bincount(rng.integers(1, e - 1, size=rows // 2), minlength=e),  # empty first/last groups, a tail
        np.eye(e, dtype=np.int64)[e // 2] * rows,  # one expert takes everything
    ):
        want = np.zeros((rows, d), np.float64)
        start = 0
        for expert, n in enumerate(sizes):
            g = x[start : start + n].astype(np.float64) @ gate[expert]
            want[start : start + n] = (g * _sigmoid(g) * (x[start : start + n] @ up[expert])) @ down[expert]
            start += n
        got = jax.jit(grouped_mlp.tiles, static_argnums=0)(
            grouped_mlp.silu_gated(jax.nn.silu), gate, up, down, x, jnp.asarray(sizes)
        )
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert [grouped_mlp.tile_rows(n, 4) for n in (1, 8, 16, 1024, 4096)] == [1, 1, 2, 128, 128]


@pytest.mark.parametrize("case", sorted(BLOCKS))
def test_padding_rows_change_nothing_and_stay_finite(case):
    """The engine pads a step's tokens to a bucket: zero rows (every expert tied), huge and
    tiny rows route anywhere; the real rows' outputs are those of the unpadded batch."""
    config = _moe_config(**{"norm_topk_prob": False, **BLOCKS[case]})
    block = MoEBlock(config, jnp.float32, nnx.Rngs(params=7), std=0.3)
    real = np.random.default_rng(0).normal(size=(13, config.hidden_size)).astype(np.float32)
    pad = np.zeros((19, config.hidden_size), np.float32)
    pad[5] = 1e4
    pad[6] = -1e-30
    step = jax.jit(lambda x: block(x))
    alone, padded = np.asarray(step(real)), np.asarray(step(np.concatenate([real, pad])))
    assert np.isfinite(padded).all()
    # a row's picks depend on the row only (the matmuls' blocking may differ with the row count)
    np.testing.assert_allclose(padded[:13], alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(padded[13:], brute_force_moe(block, pad), rtol=1e-4, atol=1e-3)


def test_bfloat16_block_is_close_to_the_float32_reference():
    config = _moe_config(norm_topk_prob=True, float32_combine=True)
    block = MoEBlock(config, jnp.bfloat16, nnx.Rngs(params=1), std=0.3)
    x = np.random.default_rng(2).normal(size=(32, config.hidden_size)).astype(np.float32)
    got = np.asarray(block(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    ref = brute_force_moe(block, np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)))
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(hf_models, case):
    folder, hf = hf_models(case)
    loaded = load_model(str(folder), show_progress=False)
    assert loaded.config.moe is not None
    ours = _runner(loaded.model).step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    ref = _hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4, case
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), case


def test_unrolled_layers_give_the_same_logits(hf_models):
    """``scan_layers=False``: static layer indices, the experts' kernels sliced per layer.
    (The scan over per-layer weights, the CPU default, runs in the tests above; the scan
    over stacked weights, the GPU default, in the tp test below.)"""
    folder, hf = hf_models("qwen2_moe_shared")
    model = load_model(str(folder), show_progress=False).model
    ours = _runner(model, scan_layers=False).step([SeqInput(PROMPT[:20], 0, [0, 1])], all_logits=True).logits
    assert np.abs(ours - _hf_logits(hf, PROMPT[:20])).max() <= 1e-4


def test_tensor_parallel_runner_splits_the_experts(hf_models):
    """tp 2 (host devices), stacked layer weights: attention split by heads as for dense
    models, the experts split on their expert axis (expert parallel, 4 of the 8 per device;
    tests/test_moe_ep.py has the rest); logits as transformers'."""
    from jax.sharding import PartitionSpec

    from strata_jax.runtime import sharding

    folder, hf = hf_models("qwen2_moe_shared")
    model = load_model(str(folder), show_progress=False).model
    runner = _runner(model, mesh=sharding.make_mesh(2), layer_weights="stacked")
    assert isinstance(runner.state, nnx.State)
    experts = runner.state["model"]["layers"]["mlp"]["experts"]["up_proj"]["kernel"].get_value()
    assert experts.sharding.spec == PartitionSpec(None, "tp", None, None)
    assert {shard.data.shape for shard in experts.addressable_shards} == {(2, 4, 64, 32)}
    ours = runner.step([SeqInput(PROMPT[:20], 0, [0, 1])], all_logits=True).logits
    assert np.abs(ours - _hf_logits(hf, PROMPT[:20])).max() <= 1e-4


# the engine path of qwen3_moe (without renormalization) and of window-less mixtral is their
# siblings'; their logits are checked above
ENGINE_CASES = [
    pytest.param(case, marks=[pytest.mark.heavy] if case in ("qwen3_moe", "mixtral") else []) for case in sorted(CASES)
]


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_greedy_tokens_match_transformers_generate(hf_models, case):
    folder, hf = hf_models(case)
    assert_engine_greedy_matches(str(folder), hf, 12)


def assert_engine_greedy_matches(model: str, hf, n: int) -> None:
    """Two prompts through an L1-only ``Engine`` on ``model`` (a folder or a GGUF file): greedy
    tokens equal ``hf``'s KV-cached generate."""
    prompts = [PROMPT[:21], PROMPT[5:14]]
    engine = Engine(
        EngineConfig(
            model=model,
            warmup=False,
            show_progress=False,
            page_size=4,
            device_tokens=512,
            max_batch_tokens=32,
            max_batch_size=2,
            tiers="L1",
        )
    )
    try:
        results = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        engine.shutdown()
    for prompt, result in zip(prompts, results):
        assert list(result.token_ids) == _hf_greedy(hf, prompt, n), model


def tier_engine(model: Path, storage_dir: str, tp: int, **overrides) -> Engine:
    """An ``Engine`` with every tier (L3 under ``storage_dir``), 4-token pages and a prefetch that
    waits for its pages, on ``tp`` devices; ``overrides`` replace ``EngineConfig`` fields."""
    fields = dict(
        model=str(model),
        tp=tp,
        warmup=False,
        show_progress=False,
        tiers="L1+L2+L3",
        page_size=4,
        device_tokens=512,
        max_batch_tokens=32,
        max_batch_size=2,
        prefetch_policy="wait_complete",
        prefetch_min_tokens=0,
        storage_dir=storage_dir,
    )
    return Engine(EngineConfig(**{**fields, **overrides}))


def assert_greedy_from_every_tier(engine: Engine, prompt: list[int], expected: list[int]) -> None:
    """``prompt`` greedy through ``engine`` (``tier_engine``) cold, then with its whole pages
    (its last token recomputed) from L1, L2 and L3: every run's tokens are ``expected``."""
    greedy = SamplingParams(max_tokens=len(expected), ignore_eos=True)
    cached = (len(prompt) - 1) // 4 * 4
    cold = engine.generate([prompt], greedy)[0]
    assert cold.cached_tokens["device"] == cold.cached_tokens["storage"] == 0
    assert list(cold.token_ids) == expected, "cold"
    l1 = engine.generate([prompt], greedy)[0]
    assert l1.cached_tokens["device"] == cached
    assert list(l1.token_ids) == expected, "L1"
    engine.flush_cache("device")
    l2 = engine.generate([prompt], greedy)[0]
    assert l2.cached_tokens["host"] == cached and l2.cached_tokens["device"] == 0
    assert list(l2.token_ids) == expected, "L2"
    engine.flush_cache("device")
    engine.flush_cache("host")
    l3 = engine.generate([prompt], greedy)[0]
    assert l3.cached_tokens["storage"] == cached
    assert list(l3.token_ids) == expected, "L3"


# ----------------------------------------------------------------------------- checkpoint layouts


def _fused_checkpoint(hf: torch.nn.Module, folder: Path, source: Path) -> None:
    """``folder``: ``source``'s config with the weights as transformers 5 holds them in memory
    (``mlp.experts.gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``, mixtral's router as
    ``mlp.gate``), which ``save_pretrained`` turns back into per-expert tensors."""
    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())
    state = {name: tensor.detach().contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe_shared"])
def test_per_expert_and_fused_layouts_load_the_same_weights(hf_models, tmp_path, case):
    folder, hf = hf_models(case)
    saved = load_file(str(folder / "model.safetensors"))
    per_expert = "block_sparse_moe.experts.0.w1.weight" if case == "mixtral" else "mlp.experts.0.gate_proj.weight"
    assert f"model.layers.0.{per_expert}" in saved  # what save_pretrained writes (the hub's layout)
    assert not any("gate_up_proj" in name for name in saved)
    _fused_checkpoint(hf, tmp_path / "fused", folder)
    config = ModelConfig.from_pretrained(folder)
    states = {}
    for layout, source in (("per_expert", folder), ("fused", tmp_path / "fused")):
        for staging in ("host", "device"):
            model = load_hf_weights(source, config, show_progress=False, staging=staging)
            states[layout, staging] = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    reference = states["per_expert", "host"]
    for key, state in states.items():
        assert state.keys() == reference.keys(), key
        for path in reference:
            np.testing.assert_array_equal(state[path], reference[path], err_msg=f"{key} {path}")
    experts = reference["model", "layers", "mlp", "experts", "up_proj", "kernel"]
    e = config.moe.num_experts if config.moe else 0
    assert experts.shape == (2, e, 64, 32)
    name = "w3" if case == "mixtral" else "up_proj"
    prefix = "block_sparse_moe" if case == "mixtral" else "mlp"
    np.testing.assert_array_equal(experts[1, e - 1], saved[f"model.layers.1.{prefix}.experts.{e - 1}.{name}.weight"].T)
    fused_model = load_model(str(tmp_path / "fused"), show_progress=False).model
    logits = _runner(fused_model).step([SeqInput(PROMPT[:20], 0, [0, 1])], all_logits=True).logits
    assert np.abs(logits - _hf_logits(hf, PROMPT[:20])).max() <= 1e-4


def test_missing_and_misshapen_expert_tensors_are_named(hf_models, tmp_path):
    folder, hf = hf_models("qwen3_moe")
    config = ModelConfig.from_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    broken = tmp_path / "missing"
    broken.mkdir()
    gone = "model.layers.1.mlp.experts.2.down_proj.weight"
    save_numpy({k: v for k, v in tensors.items() if k != gone}, str(broken / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=f"lacks tensors: {gone.replace('weight', 'kernel')}$"):
        load_hf_weights(broken, config, show_progress=False)
    _fused_checkpoint(hf, tmp_path / "fused", folder)
    fused = load_file(str(tmp_path / "fused" / "model.safetensors"))
    fused["model.layers.0.mlp.experts.gate_up_proj"] = fused["model.layers.0.mlp.experts.gate_up_proj"][:, :40]
    save_numpy(fused, str(tmp_path / "fused" / "model.safetensors"))
    with pytest.raises(
        WeightLoadError, match=r"gate_up_proj' .* has shape \(4, 40, 64\), the config implies \(4, 64, 64\)"
    ):
        load_hf_weights(tmp_path / "fused", config, show_progress=False)


# ----------------------------------------------------------------------------- timing


@pytest.mark.heavy
@pytest.mark.parametrize("tokens", [8, 512, 2048])
def test_block_against_a_dense_masked_block_timing(tokens):
    """The engine's block (on the CPU its row tiles, docs/models.md) against every expert
    on every token masked by the routing (8 experts, top-2, hidden 576, expert width 256,
    float32), medians of 30 alternating runs.  Prints the times; checks the two agree.
    ``python -m pytest -q -m heavy tests/test_moe.py -k timing -s``"""
    import time

    from strata_jax.models.moe import route

    e, k, d, f = 8, 2, 576, 256
    config = ModelConfig(
        model_type="qwen3_moe",
        vocab_size=32,
        hidden_size=d,
        intermediate_size=f,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        moe=MoEConfig(e, k, f, norm_topk_prob=True),
    )
    graphdef, state = nnx.split(MoEBlock(config, jnp.float32, nnx.Rngs(params=0), std=0.05))

    def whole(state, x):
        return nnx.merge(graphdef, state)(x)

    def dense(state, x):
        block = nnx.merge(graphdef, state)
        weights, picked = route(block.gate(x), k, True)
        mask = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], picked].set(weights)
        gate = jnp.einsum("td,edf->etf", x, block.experts.gate_proj.kernel[...])
        up = jnp.einsum("td,edf->etf", x, block.experts.up_proj.kernel[...])
        out = jnp.einsum("etf,efd->etd", jax.nn.silu(gate) * up, block.experts.down_proj.kernel[...])
        return jnp.einsum("etd,te->td", out, mask)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(tokens, d)), jnp.float32)
    steps = {"block": jax.jit(whole), "dense_masked": jax.jit(dense)}
    np.testing.assert_allclose(steps["block"](state, x), steps["dense_masked"](state, x), rtol=1e-4, atol=1e-5)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(3):
            step(state, x).block_until_ready()
    for _ in range(30):  # alternating, so the machine's load falls on both alike
        for name, step in steps.items():
            start = time.perf_counter()
            step(state, x).block_until_ready()
            times[name].append(time.perf_counter() - start)
    block_ms, dense_ms = (float(np.median(times[name])) * 1e3 for name in ("block", "dense_masked"))
    print(
        f"\n{tokens} tokens on {jax.devices()[0].platform}: block {block_ms:.2f} ms, "
        f"dense masked {dense_ms:.2f} ms, dense / block {dense_ms / block_ms:.2f}"
    )
