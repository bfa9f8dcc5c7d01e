"""Expert parallelism: the MoE experts split over the ``tp`` axis (4 host CPU devices,
tests/conftest.py).  ``docs/models.md``, "Mixture of experts".

The layout: every device routes every token (replicated activations), runs only the rows
routed to its ``E / tp`` experts (``ragged_dot`` over its experts' groups), its share of
the shared expert (dense MLP columns / rows), and one ``psum`` adds the partial outputs.
Checked: logits within 1e-4 of transformers at tp 1, 2 and 4 for qwen2_moe (shared
expert), mixtral and qwen3_moe (4-32 experts, top 1-4) over per-layer weights under the
layer scan, stacked weights and unrolled layers; the parameter shardings split the expert
axis; the per-device program multiplies only its own experts; the Engine's greedy tokens at
tp 2 equal transformers' cold and from L1, L2 and L3; indivisible counts are refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from hf_reference import save_random_hf_model
from jax.extend import core as jax_core
from jax.sharding import PartitionSpec as P
from test_moe import (
    BASE,
    _hf_greedy,
    _hf_logits,
    _moe_config,
    _runner,
    assert_greedy_from_every_tier,
    brute_force_moe,
    lazy_models,
    saved_random_case,
    tier_engine,
)

from pallas_kernels.sharded import use_head_sharding
from strata_jax.api import InvalidRequestError
from strata_jax.engine import Engine, EngineConfig
from strata_jax.models import grouped_mlp
from strata_jax.models.loader import load_model
from strata_jax.models.moe import MoEBlock, local_groups
from strata_jax.runtime import sharding
from strata_jax.runtime.model_runner import SeqInput

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (XLA_FLAGS host device count)")

# 4 KV heads, so tp 4 is allowed (test_moe's models have 2); experts 4-32, top-k 1-4
EP_BASE = dict(BASE, num_attention_heads=4, num_key_value_heads=4)
EP_CASES: dict[str, tuple[type, dict]] = {
    "qwen2_moe_shared": (
        transformers.Qwen2MoeConfig,
        dict(
            EP_BASE,
            intermediate_size=112,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            shared_expert_intermediate_size=48,
        ),
    ),
    "mixtral_top1_of_4": (  # one expert per device at tp 4
        transformers.MixtralConfig,
        dict(EP_BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=1),
    ),
    "qwen3_moe_top4_of_32": (
        transformers.Qwen3MoeConfig,
        dict(
            EP_BASE,
            head_dim=16,
            intermediate_size=112,
            moe_intermediate_size=16,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
    ),
}
PROMPT = np.random.default_rng(11).integers(0, 96, size=40).tolist()
LAYOUTS = {  # how the runner holds the layer weights
    "per_layer": dict(layer_weights="per_layer"),  # the scan over per-layer weights: LayerKernels + switch
    "stacked": dict(layer_weights="stacked"),  # the scan over stacked [L, ...] weights
    "unrolled": dict(scan_layers=False),  # static layer indices
}
# the default run (~60 s budget): every family split, every layout at tp > 1; the rest `-m heavy`
# (tp 1 is the unsharded block, checked against transformers for the three families in test_moe.py;
# qwen2_moe at tp 2 runs below through the Engine, and stacked in test_moe.py)
DEFAULT = {
    ("mixtral_top1_of_4", 2, "stacked"),
    ("qwen2_moe_shared", 4, "stacked"),
    ("mixtral_top1_of_4", 4, "unrolled"),
    ("qwen3_moe_top4_of_32", 4, "per_layer"),
}
LOGIT_CASES = [
    pytest.param(case, tp, layout, marks=[] if (case, tp, layout) in DEFAULT else [pytest.mark.heavy])
    for case in EP_CASES
    for tp in (1, 2, 4)
    for layout in LAYOUTS
]


@pytest.fixture(scope="module")
def ep_models(tmp_path_factory):
    """Saved random HF models by case, built on first use: (folder, model)."""
    return lazy_models(tmp_path_factory, saved_random_case(EP_CASES, seed=5))


def _experts(state) -> dict:
    """The MoE parameters of a runner's state (stacked) or of its first layer (per layer)."""
    if isinstance(state, tuple):
        return state[1][0]["mlp"]
    return state["model"]["layers"]["mlp"]


# ----------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize(("case", "tp", "layout"), LOGIT_CASES)
def test_logits_match_transformers_at_every_ep_size(ep_models, case, tp, layout):
    folder, hf = ep_models(case)
    model = load_model(str(folder), show_progress=False).model
    runner = _runner(model, mesh=sharding.make_mesh(tp) if tp > 1 else None, **LAYOUTS[layout])
    ours = runner.step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    ref = _hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4, (case, tp, layout)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    if tp > 1:  # the expert axis really is split: each device holds E / tp experts
        e = EP_CASES[case][1].get("num_experts", EP_CASES[case][1].get("num_local_experts"))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            kernel = _experts(runner.state)["experts"][proj]["kernel"].get_value()
            axis = kernel.ndim - 3  # [L, E, in, out] stacked, [E, in, out] per layer
            assert kernel.sharding.spec[axis] == "tp" and len(kernel.sharding.device_set) == tp
            assert {s.data.shape[axis] for s in kernel.addressable_shards} == {e // tp}


def test_parameter_shardings_split_the_experts_and_the_shared_expert(ep_models):
    """Rules by path, and the runner's actual placement (stacked and per layer): expert kernels
    on the expert axis, the shared expert as a dense MLP (gate/up columns, down rows), the
    routers replicated."""
    spec = sharding.param_spec
    assert spec("model.layers.mlp.experts.gate_proj.kernel", 4) == P(None, "tp", None, None)
    assert spec("model.layers.mlp.experts.down_proj.kernel", 4) == P(None, "tp", None, None)
    assert spec("model.layers.mlp.shared_expert.up_proj.kernel", 3) == P(None, None, "tp")
    assert spec("model.layers.mlp.shared_expert.down_proj.kernel", 3) == P(None, "tp", None)
    assert spec("model.layers.mlp.gate.kernel", 3) == P()
    assert spec("model.layers.mlp.shared_expert_gate.kernel", 3) == P()

    folder, _ = ep_models("qwen2_moe_shared")
    model = load_model(str(folder), show_progress=False).model
    mesh = sharding.make_mesh(4)
    stacked = _experts(sharding.state_shardings(nnx.split(model)[1], mesh))
    assert stacked["experts"]["gate_proj"]["kernel"].get_value().spec == P(None, "tp", None, None)
    runner = _runner(model, mesh=mesh, layer_weights="per_layer")  # no step: placement only
    layer = _experts(runner.state)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        kernel = layer["experts"][proj]["kernel"].get_value()
        assert kernel.shape == (8, 64, 32) if proj != "down_proj" else (8, 32, 64)
        assert kernel.sharding.spec == P("tp", None, None)
        assert [s.data.shape[0] for s in kernel.addressable_shards] == [2, 2, 2, 2]
    assert layer["shared_expert"]["gate_proj"]["kernel"].get_value().sharding.spec == P(None, "tp")
    assert layer["shared_expert"]["down_proj"]["kernel"].get_value().sharding.spec == P("tp", None)
    assert layer["gate"]["kernel"].get_value().sharding.spec == P()
    assert layer["shared_expert_gate"]["kernel"].get_value().sharding.spec == P()


# ----------------------------------------------------------------------------- the block


def test_local_groups_are_a_devices_contiguous_run_of_sorted_rows():
    sizes = jnp.asarray([3, 0, 2, 5, 1, 0, 4, 1], jnp.int32)  # 16 rows sorted by expert
    for device, (want_sizes, want_offset) in enumerate([([3, 0], 0), ([2, 5], 3), ([1, 0], 10), ([4, 1], 11)]):
        got_sizes, offset = jax.jit(local_groups, static_argnums=2)(sizes, device * 2, 2)
        assert got_sizes.tolist() == want_sizes and int(offset) == want_offset


def _ragged_dots(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ragged_dot_general":
            found.append(eqn)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            found += _ragged_dots(sub)
    return found


@pytest.mark.parametrize(
    ("experts", "top_k", "shared", "tp"),
    [
        (4, 1, 0, 4),
        (6, 2, 0, 2),
        (8, 3, 24, 2),
        pytest.param(32, 4, 24, 4, marks=pytest.mark.heavy),  # as a model: the qwen3_moe logits test
        pytest.param(8, 2, 0, 4, marks=pytest.mark.heavy),
    ],
)
def test_expert_parallel_block_equals_the_brute_force_reference(experts, top_k, shared, tp):
    """Under the tp scope the block runs per device on ``E / tp`` experts (the per-device
    ``ragged_dot``s see ``E / tp`` kernels and groups) and equals every expert on every
    token, padding-like rows (zeros, huge) included."""
    config = _moe_config(
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=top_k > 2,
        shared_expert_intermediate_size=shared,
    )
    block = MoEBlock(config, jnp.float32, nnx.Rngs(params=experts), std=0.3)
    x = np.random.default_rng(top_k).normal(size=(29, config.hidden_size)).astype(np.float32)
    x[20:] = 0.0
    x[25] = 1e4
    mesh = sharding.make_mesh(tp)

    def sharded_block(x):
        with use_head_sharding(mesh):
            return block(x)

    got = np.asarray(jax.jit(sharded_block)(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:20], brute_force_moe(block, x[:20]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[20:], brute_force_moe(block, x[20:]), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got, np.asarray(jax.jit(lambda x: block(x))(x)), rtol=1e-4, atol=1e-4)

    def ragged_block(x):  # the GPU's way (the CPU's row tiles computed ``got``); a new function: jit caches by it
        with grouped_mlp.use_method("ragged_dot"):
            return sharded_block(x)

    np.testing.assert_allclose(np.asarray(jax.jit(ragged_block)(x)), got, rtol=1e-4, atol=1e-4)
    dots = _ragged_dots(jax.make_jaxpr(ragged_block)(x).jaxpr)
    assert len(dots) == 3  # gate, up, down: only this device's experts and their group sizes
    for eqn in dots:
        lhs, rhs, group_sizes = (v.aval.shape for v in eqn.invars)
        assert rhs[0] == experts // tp and group_sizes == (experts // tp,) and lhs[0] == 29 * top_k


@pytest.mark.parametrize("platform", ["cuda", pytest.param("rocm", marks=pytest.mark.heavy)])
def test_expert_parallel_step_lowers_for_gpu(platform, monkeypatch):
    """The tp 2 step of a qwen2_moe model lowers for the GPUs from this CPU: inside the
    per-device (manual) computation the three ``chlo.ragged_dot``s (XLA's grouped GEMM) take
    that device's 4 of the 8 expert kernels and 4 group sizes, and one all-reduce sums them."""
    from pallas_kernels.aot import gpu_lowering_target
    from strata_jax.models.config import ModelConfig, MoEConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig

    monkeypatch.setenv("STRATA_KERNEL_BACKEND", "pallas")
    config = ModelConfig(
        model_type="qwen2_moe",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        moe=MoEConfig(8, 2, 32, norm_topk_prob=False, shared_expert_intermediate_size=48),
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
    assert len(dots) == 3, dots  # gate, up, down in the scanned layer body
    assert all("tensor<4x" in line and "tensor<4xi32>" in line and "tensor<8x" not in line for line in dots)
    assert "manual_computation" in text and text.count("all_reduce") == 1


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize(
    "case",
    [
        "qwen2_moe_shared",
        pytest.param("mixtral_top1_of_4", marks=pytest.mark.heavy),
        pytest.param("qwen3_moe_top4_of_32", marks=pytest.mark.heavy),
    ],
)
def test_engine_greedy_tokens_at_tp2_match_transformers_from_every_tier(ep_models, tmp_path, case):
    folder, hf = ep_models(case)
    prompt = PROMPT[:37]
    engine = tier_engine(folder, str(tmp_path / "kv"), tp=2)
    try:
        kernel = engine.runner.state[1][0]["mlp"]["experts"]["down_proj"]["kernel"].get_value()  # CPU: per layer
        assert kernel.sharding.spec == P("tp", None, None)
        assert_greedy_from_every_tier(engine, prompt, _hf_greedy(hf, prompt, 8))
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- refusals


def test_indivisible_expert_counts_are_refused_naming_num_experts_and_tp(tmp_path):
    def config_of(**moe):  # 4 KV heads: tp 4 passes the attention checks
        return dataclasses.replace(_moe_config(norm_topk_prob=False, **moe), num_kv_heads=4, head_dim=12)

    config = config_of(num_experts=6)
    with pytest.raises(InvalidRequestError, match=r"tp=4 does not divide the model's num_experts=6") as info:
        sharding.check_model(config, 4)
    assert "not replicated" in str(info.value) and "(2, 3, 6)" in str(info.value)
    sharding.check_model(config, 2)  # 3 experts per device
    shared = config_of(num_experts=8, shared_expert_intermediate_size=6)
    with pytest.raises(InvalidRequestError, match="tp=4 does not divide the model's 6 shared_expert_intermediate_size"):
        sharding.check_model(shared, 4)
    # the dense width, which an all-sparse layer stack never uses, need not divide
    sharding.check_model(dataclasses.replace(config_of(num_experts=8), intermediate_size=30), 4)
    # the engine refuses it after reading the config, before building anything
    save_random_hf_model(
        transformers.MixtralConfig(**EP_BASE, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2),
        tmp_path / "six",
    )
    with pytest.raises(InvalidRequestError, match=r"tp=4 does not divide the model's num_experts=6"):
        Engine(EngineConfig(model=str(tmp_path / "six"), tp=4, warmup=False, show_progress=False), start=False)
