"""``generation_config.json``: the model's extra end-of-sequence ids and its recommended sampling defaults.

What is read (everything else in the file is ignored):

* ``eos_token_id`` (an id or a list): generation stops on any of them, on top of
  ``config.json``'s and the tokenizer's EOS (Llama 3 instruct models end turns with
  ``<|eot_id|>``, which only this file lists);
* ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``: the defaults of a request
  that leaves them unset (the model creator's recommendation).  A value equal to the
  transformers ``GenerationConfig`` default (1.0, 1.0, 50, 1.0) is not a recommendation and is
  ignored, as vLLM does (``top_k: 50`` is what transformers writes for everyone);
* ``max_new_tokens``: the default ``max_tokens`` of chat requests that leave it unset.

``do_sample`` is not read (as in vLLM and SGLang): a request's ``temperature`` alone decides
greedy (0) or sampling.  Precedence, per field: the request's value, then this file's, then
the server's default (see docs/serving.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata_jax.models.config import ModelConfigError

GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' GenerationConfig defaults: a file repeating them recommends nothing.
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults from ``generation_config.json`` (all ``None``/empty when the folder has none)."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    source: str | None = None  # the file read, for messages

    def sampling_defaults(self) -> dict[str, float | int]:
        """``{SamplingParams field: value}`` for the sampling fields this file recommends."""
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
        }
        return {k: v for k, v in fields.items() if v is not None}

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationDefaults:
        """Read ``folder/generation_config.json``; no file: no defaults.  A bad file raises
        ``ModelConfigError`` naming it and the field."""
        path = Path(folder) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path}: must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = GENERATION_CONFIG_FILE) -> GenerationDefaults:
        values: dict[str, Any] = {"eos_token_ids": _eos_ids(raw.get("eos_token_id"), source), "source": source}
        for name, low, high, open_low in (
            ("temperature", 0.0, 100.0, False),
            ("top_p", 0.0, 1.0, True),
            ("repetition_penalty", 0.0, 100.0, True),
        ):
            value = raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ModelConfigError(f"{source}: {name} must be a number, got {value!r}")
            if (value <= low if open_low else value < low) or value > high:
                raise ModelConfigError(f"{source}: {name}={value} is outside {'(' if open_low else '['}{low}, {high}]")
            if float(value) != _TRANSFORMERS_DEFAULTS[name]:
                values[name] = float(value)
        for name in ("top_k", "max_new_tokens"):
            value = raw.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ModelConfigError(f"{source}: {name} must be a non-negative integer, got {value!r}")
            if name == "top_k" and value != _TRANSFORMERS_DEFAULTS["top_k"]:
                values[name] = value
            elif name == "max_new_tokens" and value > 0:
                values[name] = value
        return cls(**values)


def _eos_ids(value: object, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ModelConfigError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(dict.fromkeys(ids))
