"""What a request's output must match, and the llguidance grammar for it (no jax).

``StructuredOutput(kind, value)`` names one constraint, by the names vLLM's
``structured_outputs`` request field uses:

    json          a JSON schema (text or dict): the output is a JSON value matching it
    json_object   any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)
    regex         a regular expression (Rust ``regex`` syntax) the whole output matches
    choice        one of a list of strings, exactly
    grammar       a Lark grammar (llguidance's dialect; GBNF is converted), or EBNF/GBNF

``grammar()`` compiles it to llguidance's grammar text and validates it; the result is
cached per constraint (an agent sends the same schema on every turn), so a repeated
schema costs a dictionary lookup.  Invalid input raises ``InvalidRequestError`` naming
what is wrong.  Why llguidance: it needs no torch (masks are numpy int32 bitmasks, one
bit per token, filled in place), compiles JSON schemas lazily in Rust (microseconds to
start, the mask computed as tokens arrive), covers JSON schema, regex, choice and Lark
grammars with one API, and is one of vLLM's structured-output backends (``guidance``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strata_jax.api import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHE_SIZE = 512


@dataclass(frozen=True)
class StructuredOutput:
    """One output constraint: ``kind`` in ``KINDS``; ``value`` the schema text, regex, Lark
    grammar, or (for ``choice``) a tuple of strings; ``field`` names the request field it
    came from, for error messages."""

    kind: str
    value: str | tuple[str, ...] = ""
    field: str = "structured_outputs"
    json_like: bool | None = None  # its output is JSON (closed before max_tokens runs out); None: json kinds

    @property
    def closes_json(self) -> bool:
        return self.json_like if self.json_like is not None else self.kind in ("json", "json_object")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.field}: unknown constraint {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == "choice":
            if (
                not isinstance(self.value, tuple)
                or not self.value
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                raise InvalidRequestError(f"{self.field}.choice must be a non-empty list of non-empty strings")
        elif self.kind != "json_object" and (not isinstance(self.value, str) or not self.value.strip()):
            raise InvalidRequestError(f"{self.field}.{self.kind} must be a non-empty string")

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | str, field: str = "response_format.json_schema.schema"
    ) -> StructuredOutput:
        if isinstance(schema, dict):
            text = json.dumps(schema, sort_keys=True)
        elif isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"{field} is not valid JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError(f"{field} must be a JSON object")
            text = json.dumps(parsed, sort_keys=True)
        else:
            raise InvalidRequestError(f"{field} must be a JSON object")
        return cls("json", text, field)

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (validated; cached)."""
        return _compiled(self)


_Key = tuple[str, str | tuple[str, ...]]  # (kind, value) of a StructuredOutput


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[_Key, str] = OrderedDict()
        self._lock = threading.Lock()  # caller threads compile at submit

    def get(self, key: _Key) -> str | None:
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data.move_to_end(key)
            return hit

    def put(self, key: _Key, value: str) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)


_GRAMMARS = _LRU(_CACHE_SIZE)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Compact JSON: no whitespace between tokens (a model cannot pad with newlines until max_tokens
# runs out, as a small one otherwise does); a schema's own "x-guidance" options still apply.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


def _compiled(spec: StructuredOutput) -> str:
    key = (spec.kind, spec.value)
    hit = _GRAMMARS.get(key)
    if hit is not None:
        return hit
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.kind == "json_object":
            text = LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, defaults=JSON_OPTIONS)
        elif spec.kind == "choice":
            text = grammar_from("choice", json.dumps(list(spec.value)))
        else:
            source = spec.value
            assert isinstance(source, str)  # __post_init__: every kind but choice holds a string
            if spec.kind == "json":
                text = LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                text = LLMatcher.grammar_from_regex(source)
            else:
                text = grammar_from("grammar", source)  # Lark, or GBNF converted to it
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{spec.field}: {exc}") from None
    error = LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"{spec.field}: {_first_line(error)}")
    _GRAMMARS.put(key, text)
    return text


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


def describe(spec: StructuredOutput | None) -> dict[str, Any] | None:
    """The constraint as the request named it (for logs and echoes)."""
    if spec is None:
        return None
    return {"kind": spec.kind, "value": list(spec.value) if isinstance(spec.value, tuple) else spec.value}
