"""Loading: clear errors for bad checkpoints, orbax round trip, sharded safetensors, tokenizers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hf_reference import make_hf_model
from strata_jax.api import InvalidRequestError
from strata_jax.models.config import ModelConfig, ModelConfigError
from strata_jax.models.loader import load_model, tiny_config
from strata_jax.models.safetensors_io import SafetensorsError
from strata_jax.models.weights import WeightLoadError, restore_checkpoint, save_checkpoint
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_hf_model("llama_tied", folder)
    return folder


def _logits(model, ids):
    runner = ModelRunner(model, RunnerConfig(page_size=8, num_device_pages=16, max_batch_tokens=64, max_batch_size=2, max_context_tokens=128))
    return runner.step([SeqInput(ids, 0, list(range(-(-len(ids) // 8))))], all_logits=True).logits


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_orbax_round_trip_gives_identical_logits(hf_folder, tmp_path):
    loaded = load_model(str(hf_folder))
    ids = list(range(3, 40))
    save_checkpoint(loaded.model, tmp_path / "ckpt")
    restored = restore_checkpoint(tmp_path / "ckpt")
    assert restored.config == loaded.config
    np.testing.assert_array_equal(_logits(restored, ids), _logits(loaded.model, ids))
    # and load_model recognises the checkpoint folder
    assert load_model(str(tmp_path / "ckpt")).config == loaded.config
    with pytest.raises(FileExistsError):
        save_checkpoint(loaded.model, tmp_path / "ckpt")


def test_sharded_checkpoint_loads_like_single_file(hf_folder, tmp_path):
    from safetensors.numpy import save_file

    from strata_jax.models.safetensors_io import SafetensorsFile

    folder = _copy(hf_folder, tmp_path / "sharded")
    single = SafetensorsFile(folder / "model.safetensors")
    names = single.keys()
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: np.array(single.get(n)) for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = list(range(5, 30))
    np.testing.assert_array_equal(_logits(load_model(str(folder)).model, ids), _logits(load_model(str(hf_folder)).model, ids))


def test_missing_weights_file_is_a_clear_error(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(SafetensorsError, match="no \\*.safetensors"):
        load_model(str(folder))


def test_missing_config_and_bad_path(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelConfigError, match="neither 'tiny' nor an existing directory"):
        load_model(str(tmp_path / "nope"))


def test_shape_mismatch_names_the_tensor(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "s")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="mlp.*has shape"):
        load_model(str(folder))


def test_truncated_weights_are_a_clear_error(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "t")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SafetensorsError, match="truncated|inconsistent"):
        load_model(str(folder))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("model_type", "gpt2", "model_type='gpt2' is not supported"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type='yarn'"),
        ("num_key_value_heads", 3, "not a multiple"),
        ("vocab_size", "many", "vocab_size='many'"),
    ],
)
def test_unsupported_config_fields_are_named(hf_folder, tmp_path, field, value, message):
    folder = _copy(hf_folder, tmp_path / "c")
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=message):
        load_model(str(folder))


def test_config_reads_transformers4_spelling_and_caps_sliding_window():
    raw = {
        "model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0
    assert cfg.max_context_tokens == 4096  # within the window, sliding == full attention
    qwen = ModelConfig.from_hf_dict({**raw, "model_type": "qwen2", "use_sliding_window": False})
    assert qwen.max_context_tokens == 32768 and qwen.attention_bias


def test_tiny_default_is_in_the_documented_size_range():
    assert 5e6 <= tiny_config().num_parameters <= 20e6
    loaded = load_model("tiny")
    counted = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(__import__("flax").nnx.state(loaded.model)))
    assert counted == tiny_config().num_parameters
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo ✓")) == "héllo ✓"


def test_hf_tokenizer_and_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from strata_jax.tokenizer import HFTokenizer, IncrementalDetokenizer

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "user": 5, "!": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    t = HFTokenizer(tmp_path)
    assert t.encode("hello world !") == [3, 4, 6]
    assert t.eos_token_ids == (1,) and t.bos_token_id == 0
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi\n[assistant]"
    with pytest.raises(InvalidRequestError):
        t.apply_chat_template([{"role": "user"}])
    detok = IncrementalDetokenizer(load_model("tiny").tokenizer)
    pieces = [detok.push([b]) for b in "é✓".encode()]
    assert "".join(pieces) == "é✓" and pieces[0] == ""  # incomplete characters are held back
