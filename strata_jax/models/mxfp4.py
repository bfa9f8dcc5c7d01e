"""GPT-OSS's MXFP4 expert weights, dequantized at load (held in the engine's dtype).

OpenAI's checkpoints store each expert projection as two tensors: ``<name>_blocks``
(uint8 ``[E, out, in / 32, 16]``: 32 four-bit E2M1 codes per block, two per byte, the low
nibble first) and ``<name>_scales`` (uint8 ``[E, out, in / 32]``: one power-of-two exponent
per block, biased by 127).  A weight is ``FP4_VALUES[code] * 2 ** (scale - 127)``; the
dequantized tensor is laid out ``[E, in, out]`` as transformers' ``GptOssExperts`` holds it
(``gate_up_proj [E, D, 2F]``, ``down_proj [E, F, D]``).

``merge_mxfp4_pairs`` turns each pair of named tensors into one tensor named ``<name>``
that dequantizes when read, so the loader sees the unquantized checkpoint's names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from strata_jax.models.weights import NamedTensor, WeightLoadError

# The 16 E2M1 values, indexed by the 4-bit code (sign bit 3)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
_PAIRED = re.compile(r"^(.*)_(blocks|scales)$")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., in, out]`` from MXFP4 ``blocks [..., out, G, 16]`` and ``scales [..., out, G]``.

    One leading index (an expert) at a time into the output: the temporaries are one expert's,
    not the whole tensor's (gpt-oss-120b's ``gate_up_proj`` is 2.1e9 weights, 8.5 GB in float32)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise WeightLoadError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16 or scales.ndim < 2:
        raise WeightLoadError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} (+ 16 bytes per block)")
    *lead, rows, groups = scales.shape
    out = np.empty((*lead, groups * 32, rows), np.float32)
    for index in np.ndindex(*lead):
        block, scale = blocks[index], scales[index]
        values = np.empty((rows, groups, 16, 2), np.float32)  # [out, G, 16 bytes, low/high nibble]
        values[..., 0] = FP4_VALUES[block & 0x0F]
        values[..., 1] = FP4_VALUES[block >> 4]
        exponents = (scale.astype(np.int32) - 127)[..., None, None]
        with np.errstate(over="ignore"):  # exponents past float32's range give inf, as transformers' ldexp does
            np.ldexp(values, exponents, out=values)
        out[index] = values.reshape(rows, groups * 32).T
    return out


def merge_mxfp4_pairs(tensors: Sequence[NamedTensor]) -> list[NamedTensor]:
    """``tensors`` with every ``<name>_blocks`` / ``<name>_scales`` pair replaced by one
    ``<name>`` tensor that dequantizes when read; a lone half is an error naming it."""
    halves: dict[str, dict[str, NamedTensor]] = {}
    out: list[NamedTensor] = []
    for tensor in tensors:
        match = _PAIRED.match(tensor.name)
        if match is None:
            out.append(tensor)
            continue
        halves.setdefault(match.group(1), {})[match.group(2)] = tensor
    for name, pair in halves.items():
        if set(pair) != {"blocks", "scales"}:
            present = next(iter(pair.values()))
            lacking = f"{name}_{'scales' if 'blocks' in pair else 'blocks'}"
            raise WeightLoadError(
                f"tensor {present.name!r} in {present.origin} has no {lacking} (MXFP4 weights are blocks/scales pairs)"
            )
        blocks, scales = pair["blocks"], pair["scales"]

        def get(blocks: NamedTensor = blocks, scales: NamedTensor = scales) -> np.ndarray:
            return dequantize(blocks.get(), scales.get())

        out.append(replace(blocks, name=name, nbytes=blocks.nbytes + scales.nbytes, get=get))
    return out
