"""GGUF files as --model: weights equal the HF model they came from, errors are clear, convert round-trips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import hf_logits, make_hf_model

from strata_jax.models import gguf_file
from strata_jax.models.config import RopeScaling
from strata_jax.models.gguf_file import GGUFError, GGUFFile
from strata_jax.models.gguf_model import convert_gguf
from strata_jax.models.loader import load_model
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

gguf = pytest.importorskip("gguf", reason="needs the gguf extra: pip install -e '.[gguf]'")

from gguf_reference import write_gguf  # noqa: E402 - imports gguf: only after the importorskip above

REPO = Path(__file__).resolve().parents[1]
Q = gguf.GGMLQuantizationType


def _logits(model, ids: list[int]) -> np.ndarray:
    runner = ModelRunner(
        model,
        RunnerConfig(page_size=16, num_device_pages=32, max_batch_tokens=128, max_batch_size=1, max_context_tokens=256),
    )
    return runner.step([SeqInput(ids, 0, list(range(-(-len(ids) // 16))))], all_logits=True).logits


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    built: dict[str, torch.nn.Module] = {}

    def get(kind: str) -> torch.nn.Module:
        if kind not in built:
            built[kind] = make_hf_model(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return get


# llama_tied / mistral / llama3_scaled are written as arch "llama" (q/k permuted by the converter;
# llama3 rope scaling only as the rope_freqs tensor); qwen2 has qkv biases, qwen3 q/k norms and a
# head_dim that is not hidden/heads.
@pytest.mark.parametrize("kind", ["llama_tied", "mistral", "llama3_scaled", "qwen2", "qwen3"])
def test_gguf_logits_match_the_hf_model_it_came_from(hf_models, tmp_path, kind):
    hf = hf_models(kind)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf")
    loaded = load_model(str(path))
    assert loaded.name == kind and loaded.tokenizer is None  # no tokenizer in the file: token ids only
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    if kind == "llama3_scaled":  # recovered from rope_freqs alone
        assert loaded.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=100).tolist()  # > llama3_scaled's 32
    ours, ref = _logits(loaded.model, ids), hf_logits(hf, ids).numpy()
    assert np.abs(ours - ref).max() <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_without_the_qk_unpermutation_a_llama_gguf_would_be_wrong(hf_models, tmp_path, monkeypatch):
    """Guards the test above: the permutation matters, so a loader that skipped it would fail."""
    hf = hf_models("llama_tied")
    path = write_gguf(hf, tmp_path / "llama.gguf")
    monkeypatch.setattr(gguf_file, "PERMUTED_QK_ARCHS", ())
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=40).tolist()
    assert np.abs(_logits(load_model(str(path)).model, ids) - hf_logits(hf, ids).numpy()).max() > 1e-3  # vs 1e-4 above


# One 2-D tensor per GGUF type, dequantized by our loader (in row chunks) and by an independent
# reference: transformers' own torch implementation of the formats, or a plain restatement of the
# ones it lacks. Row width 256 = one K-block.
_F16_FIELDS = {  # byte offsets of the float16 scales in each block (kept finite in the random data)
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def _reference_dequantize(raw: np.ndarray, qtype, rows: int, width: int) -> np.ndarray:
    """transformers' torch dequantizers; plain restatements of the formats it lacks."""
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(rows, width)
    if qtype == Q.BF16:  # bfloat16 is the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, width)
    if qtype in (Q.Q5_0, Q.Q5_1):  # d (f16)[, m (f16)], qh: 32 high bits, qs: 16 bytes of nibbles
        has_min = qtype == Q.Q5_1
        blocks = raw.reshape(-1, 24 if has_min else 22)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if has_min else -16 * d
        start = 4 if has_min else 2
        qh = blocks[:, start : start + 4].copy().view("<u4")
        qs = blocks[:, start + 4 :]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.uint32)
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1
        return ((low | (high << 4)) * d + m).reshape(rows, width)
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    return (
        hf_dequantize(torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), int(qtype)).reshape(rows, width).numpy()
    )


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, *_F16_FIELDS], ids=lambda q: q.name)
def test_every_supported_tensor_type_dequantizes_like_a_reference(tmp_path, monkeypatch, qtype):
    rows, width = 24, 256
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.F16, Q.BF16):
        values = rng.standard_normal((rows, width)).astype(np.float32)
        raw = gguf.quants.quantize(values, qtype)
    else:
        raw = rng.integers(0, 256, size=(rows, width // block, type_size), dtype=np.uint8)
        for offset in _F16_FIELDS[qtype]:  # a small positive/negative float16 scale
            raw[..., offset : offset + 2] = np.frombuffer(
                rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16).tobytes(), np.uint8
            ).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(rows, -1)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(gguf_file, "DEQUANT_CHUNK_BYTES", 5 * width * 4)  # several chunks per tensor
    file = GGUFFile(tmp_path / "t.gguf")
    info = file.tensors["blk.0.ffn_up.weight"]
    assert info.hf_shape == (rows, width) and info.type_name == qtype.name
    ours = file.dequantize(info, np.dtype(np.float32))
    ref = _reference_dequantize(raw, qtype, rows, width)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def test_quantized_gguf_loads_within_quantization_error(hf_models, tmp_path):
    hf = hf_models("qwen3")
    path = write_gguf(hf, tmp_path / "q8.gguf", tensor_type=Q.Q8_0)
    file = GGUFFile(path)
    assert file.tensors["blk.0.ffn_up.weight"].type_name == "Q8_0"
    tensors = {t.name: t for t in file.named_tensors(np.dtype(np.float32), 4, 2)}
    ref = dict(hf.named_parameters())["model.layers.0.mlp.up_proj.weight"].detach().numpy()
    ours = tensors["model.layers.0.mlp.up_proj.weight"].get()
    scale = np.abs(ref).reshape(ref.shape[0], -1, 32).max(-1, keepdims=True) / 127  # Q8_0: 32-wide blocks
    # half a step of rounding, plus the float16 rounding of the stored scale (127 * 2**-11 steps)
    assert (np.abs(ours - ref).reshape(ref.shape[0], -1, 32) <= scale * 0.6 + 1e-7).all()
    assert np.abs(ours - ref).max() > 0  # it really was quantized
    ids = list(range(20))
    assert (_logits(load_model(str(path)).model, ids).argmax(-1) == hf_logits(hf, ids).numpy().argmax(-1)).mean() > 0.9


def test_convert_writes_a_folder_transformers_and_the_engine_load(hf_models, tmp_path):
    import transformers

    hf = hf_models("llama_tied")
    path = write_gguf(hf, tmp_path / "m.gguf")
    out = convert_gguf(path, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in out.iterdir()}
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, size=30).tolist()
    np.testing.assert_allclose(hf_logits(again, ids).numpy(), hf_logits(hf, ids).numpy(), atol=1e-5)
    np.testing.assert_allclose(_logits(load_model(str(out)).model, ids), hf_logits(hf, ids).numpy(), atol=1e-4)
    with pytest.raises(GGUFError, match="not empty"):
        convert_gguf(path, out)


# ---- clear errors ------------------------------------------------------------------------------


def _tiny_gguf(hf_models, tmp_path) -> Path:
    return write_gguf(hf_models("qwen2"), tmp_path / "good.gguf")


def test_truncated_and_corrupt_files_name_the_file(hf_models, tmp_path):
    data = _tiny_gguf(hf_models, tmp_path).read_bytes()
    cases = {
        "truncated.gguf": (data[: len(data) - 1000], "truncated"),
        "header-cut.gguf": (data[:200], "truncated or corrupt"),
        "not-gguf.gguf": (b"PK\x03\x04" + data[4:], "not a GGUF file"),
        "bad-count.gguf": (data[:8] + (2**62).to_bytes(8, "little") + data[16:], "corrupt"),
    }
    for name, (blob, message) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(GGUFError, match=message) as info:
            load_model(str(tmp_path / name))
        assert name in str(info.value)


def test_unsupported_architecture_and_tensor_type_are_named(hf_models, tmp_path):
    hf = hf_models("qwen2")
    with pytest.raises(GGUFError, match=r"architecture 'phi3' is not supported.*llama") as info:
        load_model(str(write_gguf(hf, tmp_path / "phi.gguf", arch="phi3")))
    assert "phi.gguf" in str(info.value)
    with pytest.raises(GGUFError, match=r"'token_embd.weight' has type IQ4_NL.*supported: F32"):
        load_model(str(write_gguf(hf, tmp_path / "iq.gguf", tensor_type=Q.IQ4_NL)))


def test_missing_gguf_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match=r"pip install 'strata-jax\[gguf\]'"):
        load_model(str(tmp_path / "m.gguf"))


def test_cli_reports_a_bad_gguf_in_one_line_without_traceback(hf_models, tmp_path):
    good = _tiny_gguf(hf_models, tmp_path)
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(good.read_bytes()[:5000])
    unsupported = write_gguf(hf_models("qwen2"), tmp_path / "gpt2arch.gguf", arch="gpt2")
    code = (
        "import sys; from serving.cli import main; "
        "sys.exit(max(main(['generate', '--model', sys.argv[1], '--prompt-ids', '1,2']), "
        "main(['convert', sys.argv[2], sys.argv[3]])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(bad), str(unsupported), str(tmp_path / "out")],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert any("broken.gguf is truncated" in line for line in lines), done.stderr
    assert any("gpt2arch.gguf: architecture 'gpt2' is not supported" in line for line in lines), done.stderr
    assert not (tmp_path / "out").exists()  # nothing written for a file that cannot be converted


def test_config_json_of_convert_matches_transformers_reading_of_the_gguf(hf_models, tmp_path):
    """transformers' own GGUF config parser is the reference for our metadata mapping."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf = hf_models("qwen3")
    path = write_gguf(hf, tmp_path / "q3.gguf")
    ours = json.loads((convert_gguf(path, tmp_path / "out") / "config.json").read_text())
    ref = load_gguf_checkpoint(str(path))["config"]
    keys = (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "vocab_size",
        "tie_word_embeddings",
    )
    for key in keys:
        assert ours[key] == pytest.approx(ref[key]), key
    assert ours["head_dim"] == hf.config.head_dim == 32  # not hidden/heads: read from attention.key_length
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)


# ---- tokenizers rebuilt from metadata, against transformers' own GGUF tokenizer conversion ----------

_TEXTS = ["the cat sat on the mat", " the dog", "cats and dogs!  ü 2024", "hello\nworld\n\n  x", "</s>the cat<s>"]


def _compare_with_transformers(path: Path) -> None:
    import transformers

    from strata_jax.models.gguf_tokenizer import build_tokenizer

    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours, _ = build_tokenizer(GGUFFile(path))
    for text in _TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_tokenizer_matches_transformers(hf_models, tmp_path):
    pieces = [
        "▁the",
        "▁a",
        "▁cat",
        "▁sat",
        "th",
        "he",
        "at",
        "▁t",
        "▁c",
        "▁s",
        "ca",
        "sa",
        "▁",
        "t",
        "h",
        "e",
        "a",
        "c",
        "s",
        "o",
        "n",
        "▁on",
        "▁mat",
        "ma",
        "▁m",
        "m",
        "r",
        "i",
        "d",
        "▁d",
        "og",
        "▁dog",
        "g",
    ]
    tokenizer = {
        "model": "llama",  # Llama 2 / Mistral: SentencePiece BPE, byte fallback, merges recovered from scores
        "tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces,
        "types": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "scores": [0.0] * 259 + [-float(i) - (10 if len(p) == 1 else 0) for i, p in enumerate(pieces)],
        "bos": 1,
        "eos": 2,
    }
    _compare_with_transformers(write_gguf(hf_models("llama_tied"), tmp_path / "spm.gguf", tokenizer=tokenizer))


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_tokenizer_matches_transformers(hf_models, tmp_path, pre):
    from strata_jax.models.gguf_tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    bytes_ = [alphabet[b] for b in range(256)]
    merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "a t",
        "c at",
        "Ġ c",
        "Ġc at",
        "Ġ s",
        "Ġs at",
        "o n",
        "Ġ on",
        "Ġ d",
        "o g",
        "Ġd og",
        "2 0",
        "20 2",
    ]
    tokens = bytes_ + [m.replace(" ", "") for m in merges] + ["<s>", "</s>"]
    tokenizer = {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": [1] * (len(tokens) - 2) + [3, 3],
        "merges": merges,
        "bos": len(tokens) - 2,
        "eos": len(tokens) - 1,
    }
    _compare_with_transformers(write_gguf(hf_models("qwen2"), tmp_path / f"{pre}.gguf", tokenizer=tokenizer))
