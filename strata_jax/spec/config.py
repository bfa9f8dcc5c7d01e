"""``--speculative-config``: vLLM's JSON object and field names, checked once.

Accepted (vLLM's names): ``method`` ("ngram"), ``num_speculative_tokens`` (k, 1-16),
``prompt_lookup_min`` and ``prompt_lookup_max`` (the n-gram lengths tried; as vLLM, one given
alone sets the other, neither given means both 5).  A field this engine does not know, a
method it does not implement (a draft ``model``, "eagle", "mtp") or a value out of range is
an ``InvalidRequestError`` naming it, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from strata_jax.api import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
KNOWN_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup: propose up to ``num_speculative_tokens`` after
    an n-gram match of length ``prompt_lookup_min`` .. ``prompt_lookup_max``."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    method: str = "ngram"


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
    if "model" in fields or fields.get("method") not in (None, "ngram"):
        what = fields.get("method") or f"a draft model ({fields.get('model')!r})"
        raise InvalidRequestError(
            f'speculative config: method {what!r} is not implemented; only prompt lookup ("ngram") is'
        )
    if unknown:
        raise InvalidRequestError(
            f"speculative config: unknown field(s) {', '.join(unknown)}; known: {', '.join(KNOWN_FIELDS)}"
        )
    k = _positive_int(fields, "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise InvalidRequestError("speculative config: num_speculative_tokens is required")
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
