"""``--speculative-config``: vLLM's JSON object and field names, checked once.

Accepted (vLLM's names): ``method`` ("ngram", or "draft_model": the default when ``model``
is given), ``num_speculative_tokens`` (k, 1-16), ``prompt_lookup_min`` and
``prompt_lookup_max`` (ngram: the n-gram lengths tried; as vLLM, one given alone sets the
other, neither given means both 5), ``model`` (draft_model: the draft, any model this engine
loads, with the target's vocabulary); and this engine's ``draft_kv_tokens`` (the draft's KV
pool, in tokens; default four contexts).  A field this engine does not know, a method it does
not implement ("eagle", "mtp"), a field of the other method or a value out of range is an
``InvalidRequestError`` naming it, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from strata_jax.api import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
DRAFT_FIELDS = ("model", "draft_kv_tokens")
KNOWN_FIELDS = ("method", "num_speculative_tokens", *NGRAM_FIELDS, *DRAFT_FIELDS)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose up to ``num_speculative_tokens`` after an n-gram match of
    length ``prompt_lookup_min`` .. ``prompt_lookup_max`` (method "ngram"), or a draft
    ``model``'s greedy continuation (method "draft_model"; its KV pool holds
    ``draft_kv_tokens``, 0: four of the target's contexts)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    method: str = "ngram"
    model: str | None = None
    draft_kv_tokens: int = 0


def _positive_int(fields: dict[str, Any], name: str, upper: int | None = None) -> int | None:
    if name not in fields:
        return None
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        bound = f" and at most {upper}" if upper is not None else ""
        raise InvalidRequestError(f"speculative config: {name} must be an integer of at least 1{bound}, got {value!r}")
    return value


def parse_speculative_config(value: str | dict[str, Any]) -> SpeculativeConfig:
    """A ``SpeculativeConfig`` from the flag's JSON text (or its parsed object): ``method``
    "ngram" (the default), ``num_speculative_tokens`` required, lookup lengths as vLLM
    (module doc)."""
    if isinstance(value, str):
        try:
            fields = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"speculative config: not valid JSON ({exc.msg} at {exc.pos}): {value!r}"
            ) from None
    else:
        fields = value
    if not isinstance(fields, dict):
        raise InvalidRequestError(f"speculative config: expected a JSON object, got {type(fields).__name__}")
    unknown = sorted(set(fields) - set(KNOWN_FIELDS))
    method = fields.get("method") or ("draft_model" if "model" in fields else "ngram")
    if method not in ("ngram", "draft_model"):
        raise InvalidRequestError(
            f'speculative config: method {method!r} is not implemented; "ngram" (prompt lookup) and "draft_model" are'
        )
    if unknown:
        raise InvalidRequestError(
            f"speculative config: unknown field(s) {', '.join(unknown)}; known: {', '.join(KNOWN_FIELDS)}"
        )
    k = _positive_int(fields, "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise InvalidRequestError("speculative config: num_speculative_tokens is required")
    other = [name for name in (DRAFT_FIELDS if method == "ngram" else NGRAM_FIELDS) if name in fields]
    if other:
        raise InvalidRequestError(f"speculative config: {', '.join(other)} does not apply to method {method!r}")
    if method == "draft_model":
        model = fields.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequestError(f"speculative config: method 'draft_model' needs a model path, got {model!r}")
        return SpeculativeConfig(
            num_speculative_tokens=k,
            method=method,
            model=model,
            draft_kv_tokens=_positive_int(fields, "draft_kv_tokens") or 0,
        )
    lo = _positive_int(fields, "prompt_lookup_min")
    hi = _positive_int(fields, "prompt_lookup_max")
    if lo is None and hi is None:
        lo, hi = DEFAULT_LOOKUP, DEFAULT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    assert lo is not None and hi is not None
    if lo > hi:
        raise InvalidRequestError(
            f"speculative config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})"
        )
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
