"""OpenAI API request shapes (validated strictly) and response builders.

Requests are parsed with pydantic in strict mode, so wrong JSON types (a string
for ``max_tokens``, a number for ``prompt``) are rejected with a message naming
the field.  Fields of the OpenAI API that this server does not implement are
accepted only with their neutral value (e.g. ``suffix``) and rejected
otherwise, so nothing is silently ignored.  Implemented sampling fields: ``n``,
``best_of`` (completions), ``logprobs``/``top_logprobs``, ``echo`` (completions),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``, and
``stream_options`` (``include_usage``, ``continuous_usage_stats``).
Tools (chat): ``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant ``tool_calls``
and ``tool`` messages (``serving/tool_calls.py``).  Structured outputs (both endpoints):
OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
(exactly one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and its older
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; one constraint per
request.
Extensions: ``top_k``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``cache_salt``,
``stop_token_ids``, ``request_id``; for chat also vLLM's ``chat_template`` (the name of one
of the model's templates), ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message`` and ``add_special_tokens``.

Sampling fields a request leaves unset take, in order: the model's
``generation_config.json`` recommendation, then the server default (OpenAI's:
``temperature`` 1.0, ``top_p`` 1.0, no ``top_k``, ``repetition_penalty`` 1.0).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.frontend import TIERS
from strata_jax.api import MAX_LOGPROBS, MAX_N, InvalidRequestError, SamplingParams

TokenIds = list[int]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _CommonRequest(_Strict):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    # prefill/decode disaggregation: what sglang-router --pd-disaggregation adds (lists for n > 1 or a
    # list of prompts); a room marks a request whose prompt the prefill replica computes
    # (serving/disaggregation.py); the host and port are not used: the KV moves through L3
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_unsupported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def sampling_params(self, max_tokens: int, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """``SamplingParams`` for this request (raises ``InvalidRequestError``).

        Per field: the request's value, else ``model_defaults`` (from generation_config.json),
        else OpenAI's default (temperature 1.0; the rest off)."""
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 1.0}  # OpenAI's default temperature
        kwargs.update(model_defaults or {})
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "min_tokens",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            kwargs["logit_bias"] = dict(self.logit_bias)
        if self.stop is not None:
            kwargs["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        kwargs["ignore_eos"] = bool(self.ignore_eos)
        kwargs["structured"] = self.structured_output()
        return SamplingParams(**kwargs)

    def structured_output(self) -> Any:
        """The request's output constraint (a ``StructuredOutput``), or None; at most one may be sent."""
        found = []
        rf = self.response_format
        if rf is not None:
            if not isinstance(rf.get("type"), str):
                raise InvalidRequestError("response_format.type must be a string")
            if rf["type"] != "text":
                found.append(_from_response_format(rf))
        if self.structured_outputs:
            found.append(_from_structured_outputs(self.structured_outputs))
        legacy = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for name, kind in legacy.items():
            value = getattr(self, name)
            if value is not None:
                found.append(_constraint(kind, value, name))
        if len(found) > 1:
            raise InvalidRequestError(
                "send one output constraint: response_format, structured_outputs or one guided_* field"
            )
        return found[0] if found else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list (a single string or id list becomes a list of one)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty")
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.best_of is not None:
            if not self.num_choices <= self.best_of <= MAX_N:
                raise InvalidRequestError(f"best_of must be in [n, {MAX_N}] (n={self.num_choices}), got {self.best_of}")
            if self.stream and self.best_of > self.num_choices:
                raise InvalidRequestError("best_of > n cannot be streamed (the best choices are known only at the end)")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")

    @property
    def num_candidates(self) -> int:
        """Choices to generate: best_of (the best n are returned), else n."""
        return max(self.best_of or 1, self.num_choices)

    def sampling_params(self, max_tokens: int, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, model_defaults)
        logprobs = self.logprobs
        if logprobs is None and self.num_candidates > self.num_choices:
            logprobs = 0  # best_of ranks candidates by their logprobs
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return dataclasses.replace(params, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates see it (``developer`` is a ``system`` message to them)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool | None = None  # default: true, unless continue_final_message
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # the template writes the special tokens itself
    chat_template: str | None = None  # the name of one of the model's chat templates
    chat_template_kwargs: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise InvalidRequestError("messages must not be empty")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs: true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        out = self.max_output_tokens()  # the two spellings must agree
        if out is not None and out < 1:
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"  # as sent
            raise InvalidRequestError(f"{name} must be at least 1 for chat completions, got {out}")

    @property
    def wants_generation_prompt(self) -> bool:
        """``add_generation_prompt``; unset it is true, except when continuing the final message."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (current OpenAI clients) or ``max_tokens`` (older ones); ``None`` if neither."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise InvalidRequestError(f"max_completion_tokens ({a}) and max_tokens ({b}) disagree; send one of them")
        return a if a is not None else b

    def sampling_params(self, max_tokens: int, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, model_defaults)
        return dataclasses.replace(params, logprobs=(self.top_logprobs or 0) if self.logprobs else None)


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)


class AdminFlushRequest(_Strict):
    tier: Literal["all", "device", "host", "storage"] = "all"
    lora_name: str | None = None  # only that adapter's L1 and L2 pages (tier "all")


class AdminProfileRequest(_Strict):
    log_dir: str | None = None


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _constraint(kind: str, value: Any, field: str) -> Any:
    from strata_jax.structured import StructuredOutput

    if kind == "json":
        return StructuredOutput.json_schema(value, field)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{field} must be true")
        return StructuredOutput("json_object", "", field)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{field} must be a list of strings")
        return StructuredOutput("choice", tuple(value), field)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string")
    return StructuredOutput(kind, value, field)


def _from_response_format(rf: dict[str, Any]) -> Any:
    kind = rf["type"]
    if kind == "json_object":
        return _constraint("json_object", True, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a schema")
        if "schema" not in spec:
            raise InvalidRequestError("response_format.json_schema.schema is missing")
        return _constraint("json", spec["schema"], "response_format.json_schema.schema")
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def _from_structured_outputs(so: dict[str, Any]) -> Any:
    named = [k for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
    unknown = sorted(
        set(so)
        - set(STRUCTURED_KINDS)
        - {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    )
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs: unknown field(s) {', '.join(unknown)}; use one of {', '.join(STRUCTURED_KINDS)}"
        )
    if len(named) != 1:
        raise InvalidRequestError(f"structured_outputs must name exactly one of {', '.join(STRUCTURED_KINDS)}")
    kind = named[0]
    return _constraint(kind, so[kind], f"structured_outputs.{kind}")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_type_tag(part: int | str) -> bool:
    """pydantic's name for a union member in an error's ``loc`` (``str``, ``list[int]``,
    ``function-after[...]``, ``TextPart``), as opposed to a field name (``stream``)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper())


def _error_field(error: Mapping[str, Any]) -> str:
    """The dotted path of one pydantic error, union-member tags left out (``messages.0.content``)."""
    loc = ".".join(str(x) for x in error.get("loc", ()) if not _is_type_tag(x))
    return loc or "body"


def describe_validation_error(err: ValidationError) -> str:
    """One readable line per problem: ``field.path: message``."""
    parts = []
    for e in err.errors()[:5]:
        parts.append(f"{_error_field(e)}: {e.get('msg', 'invalid')}")
    extra = len(err.errors()) - len(parts)
    return "; ".join(parts) + (f" (and {extra} more)" if extra > 0 else "")


def validation_error_param(err: ValidationError) -> str:
    """OpenAI's ``error.param``: the first offending field (``messages.0.role``)."""
    errors = err.errors()
    return _error_field(errors[0]) if errors else "body"


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached: dict[str, int]) -> dict:
    """``usage`` with OpenAI's ``prompt_tokens_details.cached_tokens`` and per-tier counts."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(int(cached.get(t, 0)) for t in TIERS)},
        "cached_tokens_per_tier": {t: int(cached.get(t, 0)) for t in TIERS},
    }


def completion_response(rid: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None, created: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }


def chat_response(rid: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None, created: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def usage_chunk(rid: str, model: str, object_: str, created: int, usage_: dict) -> dict:
    return {"id": rid, "object": object_, "created": created, "model": model, "choices": [], "usage": usage_}
