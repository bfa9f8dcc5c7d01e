"""Mixture-of-experts stacks with dense layers (qwen's ``mlp_only_layers`` and
``decoder_sparse_step``) against transformers.

Each MLP kind is stacked over its own layers (``DecoderModel.dense_layers`` /
``moe_layers``) and a layer runs its own kind (``llama.mixed_mlp``: a ``jax.lax.cond`` under
the layer scan, a static pick unrolled).  Compared: logits within 1e-4 over per-layer weights
(the CPU default), stacked weights (the GPU default), unrolled layers and tp 2 (the experts
split over the devices, the dense layers' MLP by columns/rows); the engine's greedy tokens
cold and from L1, L2 and L3 at tp 2; a missing dense-layer tensor named by its HF name.
``docs/models.md``, "Mixture of experts".
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import transformers
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from test_moe import (
    BASE,
    _hf_greedy,
    _hf_logits,
    _runner,
    assert_greedy_from_every_tier,
    lazy_models,
    saved_random_case,
    tier_engine,
)

from strata_jax.models.loader import load_model
from strata_jax.models.weights import WeightLoadError
from strata_jax.runtime import sharding
from strata_jax.runtime.model_runner import SeqInput

STACK = dict(BASE, num_hidden_layers=4, intermediate_size=112, moe_intermediate_size=32, num_experts=8)
CASES = {
    # the first layer dense (mlp_only_layers), the rest sparse
    "qwen3_moe_first_dense": (
        transformers.Qwen3MoeConfig,
        dict(STACK, head_dim=32, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]),
    ),
    # every other layer sparse, plus a shared expert
    "qwen2_moe_every_second": (
        transformers.Qwen2MoeConfig,
        dict(STACK, num_experts_per_tok=3, shared_expert_intermediate_size=48, decoder_sparse_step=2),
    ),
}
PROMPT = np.random.default_rng(1).integers(0, 96, size=40).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lazy_models(tmp_path_factory, saved_random_case(CASES, seed=3))


@pytest.mark.parametrize("layout", ["per_layer", "stacked", "unrolled"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(models, case, layout):
    folder, hf = models(case)
    model = load_model(str(folder), show_progress=False).model
    assert model.config.mixed_mlp_layers
    options = {"stacked": dict(layer_weights="stacked"), "unrolled": dict(scan_layers=False)}.get(layout, {})
    ours = _runner(model, **options).step([SeqInput(PROMPT, 0, [0, 1, 2])], all_logits=True).logits
    ref = _hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_tensor_parallel_splits_both_kinds(models):
    """tp 2: the sparse layers' experts split on their expert axis, the dense layers' MLP by
    columns (gate/up) as a dense model's; logits as transformers'."""
    folder, hf = models("qwen2_moe_every_second")
    model = load_model(str(folder), show_progress=False).model
    runner = _runner(model, mesh=sharding.make_mesh(2), layer_weights="stacked")
    state = runner.state["model"]
    experts = state["moe_layers"]["mlp"]["experts"]["up_proj"]["kernel"].get_value()
    dense_up = state["dense_layers"]["mlp"]["up_proj"]["kernel"].get_value()
    assert experts.sharding.spec == P(None, "tp", None, None)
    assert dense_up.sharding.spec == P(None, None, "tp")
    ours = runner.step([SeqInput(PROMPT[:20], 0, [0, 1])], all_logits=True).logits
    assert np.abs(ours - _hf_logits(hf, PROMPT[:20])).max() <= 1e-4


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS host device count)")
def test_engine_greedy_tokens_at_tp2_match_transformers_from_every_tier(models, tmp_path):
    folder, hf = models("qwen3_moe_first_dense")
    prompt = PROMPT[:37]
    engine = tier_engine(folder, str(tmp_path / "kv"), tp=2)
    try:
        assert_greedy_from_every_tier(engine, prompt, _hf_greedy(hf, prompt, 8))
    finally:
        engine.shutdown()


def test_a_missing_dense_layer_tensor_is_named(models, tmp_path):
    source, _ = models("qwen2_moe_every_second")
    folder = tmp_path / "missing"
    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]  # layer 2: dense (decoder_sparse_step 2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"lacks tensors: model\.layers\.2\.mlp\.down_proj\.kernel"):
        load_model(str(folder), show_progress=False)


def test_tp_must_divide_the_dense_layers_width():
    """A mixed stack's dense layers split their MLP by columns: an intermediate size tp does not
    divide is refused naming it, before any weights move."""
    from strata_jax.models.config import ModelConfig

    config_cls, fields = CASES["qwen3_moe_first_dense"]
    config = ModelConfig.from_hf_dict(config_cls(**{**fields, "intermediate_size": 113}).to_dict())
    with pytest.raises(sharding.TensorParallelError, match="113 intermediate size"):
        sharding.check_model(config, 2)
