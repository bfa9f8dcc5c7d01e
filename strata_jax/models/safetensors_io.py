"""Minimal reader for the safetensors format, memory-mapped, bfloat16-aware.

Reading the 8-byte header length + JSON header ourselves keeps loading free of
torch and handles every dtype Hugging Face checkpoints use.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from strata_jax.models.config import ModelConfigError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ModelConfigError):
    """A safetensors file that cannot be read (a model that cannot be loaded, like a bad
    config: the CLI reports it in one line)."""


class SafetensorsFile:
    """Tensors of one file, by name, as read-only memory-mapped numpy arrays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise SafetensorsError(f"{self.path}: truncated (no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsError(f"{self.path}: header length {header_len} is invalid for a {size}-byte file")
            try:
                header = json.loads(fh.read(header_len))
            except json.JSONDecodeError as exc:
                raise SafetensorsError(f"{self.path}: corrupt header: {exc}") from exc
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = _DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise SafetensorsError(f"{self.path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if (
                end - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                or self._data_start + end > size
            ):
                raise SafetensorsError(f"{self.path}: tensor {name} has inconsistent offsets (file truncated?)")
            self._entries[name] = (np.dtype(dtype), shape, start, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def nbytes(self, name: str) -> int:
        _, _, start, end = self._entries[name]
        return end - start

    def get(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self._entries[name]
        if end == start:
            return np.zeros(shape, dtype)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + start, shape=(end - start,))
        return mm.view(dtype).reshape(shape)


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a HF checkpoint folder (sharded via the index, or single)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise SafetensorsError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SafetensorsError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(f"no *.safetensors weights in {folder}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, SafetensorsFile]]:
    for path in files:
        st = SafetensorsFile(path)
        for name in st.keys():
            yield name, st
