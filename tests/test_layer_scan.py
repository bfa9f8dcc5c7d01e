"""Layers under jax.lax.scan over stacked parameters: same numbers as the unrolled loop,
HF names map one to one onto rows of the stacked parameters."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import hf_name_to_param, random_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

CONFIG = ModelConfig(
    model_type="qwen3", vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=16, qk_norm=True,
)  # fmt: skip


def _logits(scan_layers: bool) -> tuple[np.ndarray, np.ndarray]:
    runner = ModelRunner(
        random_model(CONFIG, seed=3),
        RunnerConfig(page_size=4, num_device_pages=32, max_batch_tokens=32, max_batch_size=2, max_context_tokens=64, scan_layers=scan_layers),
    )
    prefill = runner.step([SeqInput(list(range(1, 12)), 0, [0, 1, 2])], all_logits=True).logits
    decode = runner.step([SeqInput([5], 11, [0, 1, 2])], all_logits=True).logits  # reads the layers' KV written above
    return prefill, decode


def test_scan_and_unrolled_loop_agree():
    scanned, unrolled = _logits(True), _logits(False)
    for a, b in zip(scanned, unrolled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_parameters_are_stacked_per_layer():
    model = random_model(CONFIG)
    assert model.model.layers.self_attn.q_proj.kernel.shape == (3, 32, 64)
    assert model.model.layers.input_layernorm.weight.shape == (3, 32)
    layer_weights = np.asarray(model.model.layers.mlp.up_proj.kernel[...])
    assert not np.allclose(layer_weights[0], layer_weights[1])  # each layer its own draw


@pytest.mark.parametrize(
    "name,path,layer,transpose",
    [
        ("model.layers.7.self_attn.q_proj.weight", ("model", "layers", "self_attn", "q_proj", "kernel"), 7, True),
        ("model.layers.0.self_attn.q_proj.bias", ("model", "layers", "self_attn", "q_proj", "bias"), 0, False),
        ("model.layers.12.self_attn.k_norm.weight", ("model", "layers", "self_attn", "k_norm", "weight"), 12, False),
        ("model.layers.3.post_attention_layernorm.weight", ("model", "layers", "post_attention_layernorm", "weight"), 3, False),
        ("model.layers.1.mlp.down_proj.weight", ("model", "layers", "mlp", "down_proj", "kernel"), 1, True),
        ("model.embed_tokens.weight", ("model", "embed_tokens", "weight"), None, False),
        ("model.norm.weight", ("model", "norm", "weight"), None, False),
        ("lm_head.weight", ("lm_head", "kernel"), None, True),
    ],
)
def test_hf_names_map_to_stacked_rows(name, path, layer, transpose):
    assert hf_name_to_param(name) == (path, layer, transpose)


def _runner(scan_layers: bool, mesh=None) -> ModelRunner:  # noqa: ANN001
    return ModelRunner(
        random_model(CONFIG, seed=3),
        RunnerConfig(page_size=4, num_device_pages=32, max_batch_tokens=32, max_batch_size=2, max_context_tokens=64, scan_layers=scan_layers),
        mesh=mesh,
    )


def test_unrolled_runner_holds_each_layers_weights_in_arrays_of_their_own():
    """scan_layers=False: the runner splits the stacked weights into per-layer arrays (no
    slice of a stacked weight inside the step, see run_stacked_layers) and drops the stacked
    copies; stacked_state() gives the stacked arrays back."""
    import jax

    stacked = _runner(True).state["model"]["layers"]
    runner = _runner(False)
    base, per_layer = runner.state
    assert len(per_layer) == CONFIG.num_layers
    assert all(a.shape == () for a in jax.tree.leaves(base["model"]["layers"]))  # placeholders only
    for i, layer in enumerate(per_layer):
        for got, want in zip(jax.tree.leaves(layer), jax.tree.leaves(stacked)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[i])
    back = runner.stacked_state()["model"]["layers"]
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unrolled_per_layer_weights_under_tensor_parallelism_agree_with_scan():
    """tp=2: each layer's arrays keep the stacked weights' split (minus the layer axis)."""
    from strata_jax.runtime import sharding

    def logits(scan_layers: bool):  # noqa: ANN202
        runner = _runner(scan_layers, mesh=sharding.make_mesh(2))
        if not scan_layers:
            q = runner.state[1][0]["self_attn"]["q_proj"]["kernel"][...]
            assert q.ndim == 2 and len(q.sharding.device_set) == 2 and q.sharding.spec[-1] == "tp"
        prefill = runner.step([SeqInput(list(range(1, 12)), 0, [0, 1, 2])], all_logits=True).logits
        decode = runner.step([SeqInput([5], 11, [0, 1, 2])], all_logits=True).logits
        return prefill, decode

    for a, b in zip(logits(True), logits(False)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
