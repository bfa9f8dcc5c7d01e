"""Layers under jax.lax.scan over stacked parameters: same numbers as the unrolled loop,
HF names map one to one onto rows of the stacked parameters."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import hf_name_to_param, random_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

CONFIG = ModelConfig(
    model_type="qwen3",
    vocab_size=80,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
)


def _logits(scan_layers: bool, layer_weights: str = "stacked") -> tuple[np.ndarray, np.ndarray]:
    runner = _runner(scan_layers, layer_weights=layer_weights)
    prefill = runner.step([SeqInput(list(range(1, 12)), 0, [0, 1, 2])], all_logits=True).logits
    decode = runner.step([SeqInput([5], 11, [0, 1, 2])], all_logits=True).logits  # reads the layers' KV written above
    return prefill, decode


def test_scan_and_unrolled_loop_agree():
    scanned, unrolled = _logits(True), _logits(False)
    for a, b in zip(scanned, unrolled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_scan_over_per_layer_weights_gives_the_stacked_scans_numbers():
    """layer_weights="per_layer" under the scan: each matmul picks its layer's kernel by a
    switch (llama.LayerKernels); the same products in the same order, so equal bits."""
    stacked, per_layer = _logits(True, "stacked"), _logits(True, "per_layer")
    for a, b in zip(stacked, per_layer):
        np.testing.assert_array_equal(a, b)


def _kernel_slices(layer_weights: str) -> list[str]:
    """Dynamic slices in the compiled decode program whose result has a linear kernel's
    shape (a layer's weight copied out of a stacked array)."""
    import jax

    runner = _runner(True, layer_weights=layer_weights)
    shapes = {  # with or without the unit layer axis
        f"f32[{prefix}{a.shape[1]},{a.shape[2]}]"
        for a in jax.tree.leaves(_runner(True).state["model"]["layers"])
        if a.ndim == 3
        for prefix in ("", "1,")
    }
    text = runner.lower_step(1, 1, decode=True).compile().as_text()
    return [line for line in text.splitlines() if "dynamic-slice(" in line and any(f"= {s}" in line for s in shapes)]


def test_per_layer_weights_are_not_copied_out_of_a_stacked_array():
    """The point of "per_layer": XLA:CPU copies a slice of a stacked kernel before its
    matmul (a dynamic slice per kernel per layer per step); per-layer arrays have none."""
    assert _kernel_slices("stacked"), "the stacked scan should slice its kernels (else this test checks nothing)"
    assert _kernel_slices("per_layer") == []


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
        (
            "model.layers.3.post_attention_layernorm.weight",
            ("model", "layers", "post_attention_layernorm", "weight"),
            3,
            False,
        ),
        ("model.layers.1.mlp.down_proj.weight", ("model", "layers", "mlp", "down_proj", "kernel"), 1, True),
        ("model.embed_tokens.weight", ("model", "embed_tokens", "weight"), None, False),
        ("model.norm.weight", ("model", "norm", "weight"), None, False),
        ("lm_head.weight", ("lm_head", "kernel"), None, True),
    ],
)
def test_hf_names_map_to_stacked_rows(name, path, layer, transpose):
    assert hf_name_to_param(name) == (path, layer, transpose)


def _runner(scan_layers: bool, mesh=None, layer_weights: str = "stacked") -> ModelRunner:
    return ModelRunner(
        random_model(CONFIG, seed=3),
        RunnerConfig(
            page_size=4,
            num_device_pages=32,
            max_batch_tokens=32,
            max_batch_size=2,
            max_context_tokens=64,
            scan_layers=scan_layers,
            layer_weights=layer_weights,
        ),
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


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
def test_per_layer_weights_under_tensor_parallelism_agree_with_the_stacked_scan(scan_layers):
    """tp=2: each layer's arrays keep the stacked weights' split (minus the layer axis),
    unrolled and under the scan (where the switch picks among sharded kernels)."""
    from strata_jax.runtime import sharding

    def logits(scan_layers: bool, layer_weights: str):
        runner = _runner(scan_layers, mesh=sharding.make_mesh(2), layer_weights=layer_weights)
        if layer_weights == "per_layer":
            q = runner.state[1][0]["self_attn"]["q_proj"]["kernel"][...]
            assert q.ndim == 2 and len(q.sharding.device_set) == 2 and q.sharding.spec[-1] == "tp"
        prefill = runner.step([SeqInput(list(range(1, 12)), 0, [0, 1, 2])], all_logits=True).logits
        decode = runner.step([SeqInput([5], 11, [0, 1, 2])], all_logits=True).logits
        return prefill, decode

    for a, b in zip(logits(True, "stacked"), logits(scan_layers, "per_layer")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
