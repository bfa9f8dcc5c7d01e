"""A GGUF file as a servable model (``--model FILE.gguf``) or as a Hugging Face folder (``convert``)."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from strata_jax.models.config import ModelConfig
from strata_jax.models.generation_config import GenerationDefaults
from strata_jax.models.gguf_file import GGUFError, GGUFFile
from strata_jax.models.gguf_tokenizer import has_tokenizer, write_tokenizer_files
from strata_jax.models.weights import CausalLM, load_named_tensors
from strata_jax.tokenizer import HFTokenizer

_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}


def model_config(gguf: GGUFFile) -> ModelConfig:
    try:
        return ModelConfig.from_hf_dict(gguf.hf_config())
    except GGUFError:
        raise
    except ValueError as exc:  # ModelConfigError from the HF-config checks
        raise GGUFError(f"{gguf.path}: {exc}") from exc


def load_gguf(
    path: str | Path, *, dtype: jnp.dtype = jnp.float32, show_progress: bool = True
) -> tuple[ModelConfig, CausalLM, HFTokenizer | None, GenerationDefaults]:
    """Config, weights (dequantized to ``dtype``, one tensor at a time), tokenizer (None when the file
    carries none: the model then takes token ids only) and generation defaults of a GGUF file."""
    gguf = GGUFFile(path)
    config = model_config(gguf)
    generation = GenerationDefaults.from_dict(generation_config(gguf.hf_config()), source=str(gguf.path))
    tensors = gguf.named_tensors(np.dtype(dtype), config.num_heads, config.num_kv_heads)
    tokenizer = None
    if has_tokenizer(gguf):
        with tempfile.TemporaryDirectory(prefix="strata-gguf-tokenizer-") as folder:
            write_tokenizer_files(gguf, Path(folder))
            tokenizer = HFTokenizer(folder)
        tokenizer.folder = gguf.path  # what errors name: the file, not the temporary folder
    model = load_named_tensors(tensors, config, dtype=dtype, show_progress=show_progress, source=str(gguf.path))
    return config, model, tokenizer, generation


def generation_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {"_from_model_config": True, **{k: hf_config[k] for k in keys if k in hf_config}}


def convert_gguf(path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder equivalent to a GGUF file: config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise GGUFError(f"output folder {out} exists and is not empty")
    np_dtype = np.dtype(jnp.dtype(dtype))
    gguf = GGUFFile(path)
    config = model_config(gguf)  # validates everything before anything is written
    hf_config = dict(gguf.hf_config(), torch_dtype=dtype)
    tensors = gguf.named_tensors(np_dtype, config.num_heads, config.num_kv_heads)
    out.mkdir(parents=True, exist_ok=True)
    if has_tokenizer(gguf):
        write_tokenizer_files(gguf, out)
    shapes = {t.name: t.info.hf_shape for t in gguf.hf_tensors(config.num_heads, config.num_kv_heads)}
    _write_safetensors(out / "model.safetensors", tensors, shapes, np_dtype, gguf)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config(hf_config), indent=2))
    return out


def _write_safetensors(
    file: Path, tensors, shapes: dict[str, tuple[int, ...]], dtype: np.dtype, gguf: GGUFFile
) -> None:
    """Stream tensors into one safetensors file (header first, then each tensor as it is dequantized)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": gguf.path.name}}
    offset = 0
    for tensor in tensors:
        shape = shapes[tensor.name]
        header[tensor.name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with file.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for tensor in tensors:
            array = np.ascontiguousarray(tensor.get(), dtype=dtype)
            if array.nbytes != tensor.nbytes:
                raise GGUFError(
                    f"{gguf.path}: tensor {tensor.name!r} dequantized to {array.nbytes} bytes, expected {tensor.nbytes}"
                )
            fh.write(array.tobytes())
