"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe, Mixtral as llama with experts) against transformers.

The files are written by ``gguf_reference.write_gguf`` from tiny random transformers models (the
``tests/test_moe.py`` configs), restating llama.cpp's converter: a layer's experts stacked into one
3-D tensor per projection, the routers F32.  ``docs/models.md``, "Mixture of experts from GGUF".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hf_reference import save_random_hf_model
from test_moe import CASES, PROMPT, assert_engine_greedy_matches

from strata_jax.models import gguf_file
from strata_jax.models.config import ModelConfig
from strata_jax.models.gguf_file import GGUFError, GGUFFile
from strata_jax.models.gguf_model import convert_gguf
from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

gguf = pytest.importorskip("gguf", reason="needs the gguf extra: pip install -e '.[gguf]'")

from gguf_reference import write_gguf  # noqa: E402 - imports gguf: only after the importorskip above

Q = gguf.GGMLQuantizationType
# qwen3moe: the norm_topk_prob=true case, what llama.cpp's qwen3moe graph assumes (the converter writes no flag)
FAMILIES = {"qwen3_moe": "qwen3_moe_norm_topk", "qwen2_moe": "qwen2_moe_shared", "mixtral": "mixtral"}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    built: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in built:
            config_cls, kwargs = CASES[FAMILIES[family]]
            built[family] = save_random_hf_model(config_cls(**kwargs), tmp_path_factory.mktemp(family), seed=3)
        return built[family]

    return get


def _logits(model, ids: list[int]) -> np.ndarray:
    runner = ModelRunner(
        model,
        RunnerConfig(page_size=16, num_device_pages=32, max_batch_tokens=64, max_batch_size=1, max_context_tokens=256),
    )
    return runner.step([SeqInput(ids, 0, list(range(-(-len(ids) // 16))))], all_logits=True).logits


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def test_architecture_names_are_the_gguf_packages():
    names = gguf.MODEL_ARCH_NAMES
    assert gguf_file.GGUF_ARCHITECTURES[names[gguf.MODEL_ARCH.QWEN3MOE]] == "qwen3_moe"
    assert gguf_file.GGUF_ARCHITECTURES[names[gguf.MODEL_ARCH.QWEN2MOE]] == "qwen2_moe"
    assert gguf_file.MIXTRAL_ARCH == names[gguf.MODEL_ARCH.LLAMA]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_gguf_logits_match_transformers(hf_models, tmp_path, family):
    hf = hf_models(family)
    path = write_gguf(hf, tmp_path / f"{family}.gguf")
    file = GGUFFile(path)
    gate = file.tensors["blk.1.ffn_gate_exps.weight"]
    moe = ModelConfig.from_hf_dict(hf.config.to_dict()).moe
    assert moe is not None
    assert gate.hf_shape == (moe.num_experts, moe.expert_intermediate_size, hf.config.hidden_size)  # [E, out, in]
    loaded = load_model(str(path), show_progress=False)
    assert loaded.config.model_type == family
    assert loaded.config.moe == moe  # norm_topk_prob, the shared expert's width, mixtral's float32 combine
    ours, ref = _logits(loaded.model, PROMPT), _hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() <= 1e-4, family
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), family


def test_quantized_experts_dequantize_per_expert(hf_models, tmp_path):
    """Q8_0 3-D expert tensors (and a 1-D shared-expert gate, as older converters wrote it)."""
    hf = hf_models("qwen2_moe")
    path = write_gguf(hf, tmp_path / "q8.gguf", tensor_type=Q.Q8_0, squeeze_shared_gate=True)
    file = GGUFFile(path)
    assert file.tensors["blk.0.ffn_up_exps.weight"].type_name == "Q8_0"
    assert file.tensors["blk.0.ffn_gate_inp.weight"].type_name == "F32"  # llama.cpp keeps the routers F32
    assert file.tensors["blk.0.ffn_gate_inp_shexp.weight"].hf_shape == (64,)
    tensors = {t.name: t for t in file.named_tensors(np.dtype(np.float32), 4, 2)}
    fused = dict(hf.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"].detach().numpy()
    f = fused.shape[1] // 2
    for expert in (0, 7):
        ref = fused[expert, f:]  # the up projection of this expert [F, D]
        ours = tensors[f"model.layers.1.mlp.experts.{expert}.up_proj.weight"].get()
        scale = np.abs(ref).reshape(ref.shape[0], -1, 32).max(-1, keepdims=True) / 127
        assert (np.abs(ours - ref).reshape(ref.shape[0], -1, 32) <= scale * 0.6 + 1e-7).all()
        assert np.abs(ours - ref).max() > 0  # it really was quantized
    shared_gate = tensors["model.layers.0.mlp.shared_expert_gate.weight"].get()
    np.testing.assert_array_equal(shared_gate, hf.model.layers[0].mlp.shared_expert_gate.weight.detach().numpy())
    ours = _logits(load_model(str(path), show_progress=False).model, PROMPT)
    assert (ours.argmax(-1) == _hf_logits(hf, PROMPT).argmax(-1)).mean() > 0.9


def test_engine_greedy_tokens_from_a_mixtral_gguf_match_generate(hf_models, tmp_path):
    hf = hf_models("mixtral")
    path = write_gguf(hf, tmp_path / "mixtral.gguf")
    assert_engine_greedy_matches(str(path), hf, 10)


def test_convert_writes_per_expert_tensors_transformers_loads(hf_models, tmp_path):
    hf = hf_models("mixtral")
    out = convert_gguf(write_gguf(hf, tmp_path / "m.gguf"), tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(again).__name__ == "MixtralForCausalLM"
    np.testing.assert_allclose(_hf_logits(again, PROMPT[:20]), _hf_logits(hf, PROMPT[:20]), atol=1e-5)


def test_norm_flag_and_what_is_assumed_without_it(hf_models, tmp_path):
    hf = hf_models("qwen3_moe")
    assert GGUFFile(write_gguf(hf, tmp_path / "a.gguf")).hf_config()["norm_topk_prob"] is True  # llama.cpp's
    flagged = GGUFFile(write_gguf(hf, tmp_path / "b.gguf", expert_weights_norm=False)).hf_config()
    assert flagged["norm_topk_prob"] is False
    assert GGUFFile(write_gguf(hf_models("qwen2_moe"), tmp_path / "c.gguf")).hf_config()["norm_topk_prob"] is False


def test_missing_expert_tensor_and_wrong_expert_count_are_named(hf_models, tmp_path):
    hf = hf_models("qwen3_moe")
    missing = write_gguf(hf, tmp_path / "missing.gguf", drop=("blk.1.ffn_down_exps.weight",))
    with pytest.raises(GGUFError, match=r"missing.gguf lacks the tensor 'blk.1.ffn_down_exps.weight'.*ffn_gate_inp"):
        load_model(str(missing), show_progress=False)
    wrong = write_gguf(hf, tmp_path / "wrong.gguf", expert_count=6)
    with pytest.raises(
        GGUFError,
        match=r"wrong.gguf: tensor 'blk.0.ffn_gate_inp.weight' has shape \(8, 64\).*qwen3moe.expert_count is 6",
    ):
        load_model(str(wrong), show_progress=False)
    router_gone = write_gguf(hf_models("mixtral"), tmp_path / "router.gguf", drop=("blk.0.ffn_gate_inp.weight",))
    with pytest.raises(GGUFError, match="lacks the tensor 'blk.0.ffn_gate_inp.weight'.*llama mixture of experts"):
        load_model(str(router_gone), show_progress=False)
