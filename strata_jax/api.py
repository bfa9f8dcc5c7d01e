"""Public request/response types of the engine (the contract the faces build on).

Everything a user passes in is validated here and rejected with
``InvalidRequestError`` (a ``ValueError``) carrying a readable message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class StrataError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(StrataError, ValueError):
    """The request itself is wrong (maps to HTTP 400 / gRPC INVALID_ARGUMENT)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus ``max_tokens`` do not fit in the context (HTTP 400, counted as ``too_long``)."""


class OverloadedError(StrataError):
    """The waiting queue is full (maps to HTTP 429 / gRPC RESOURCE_EXHAUSTED)."""


class EngineUnavailableError(StrataError):
    """The engine is warming up or shutting down (HTTP 503 / gRPC UNAVAILABLE)."""


class RequestAbortedError(StrataError):
    """The request was aborted before it finished."""


class StepFailedError(StrataError):
    """An engine step that carried this request failed (HTTP 500 / gRPC INTERNAL, naming the cause).

    Only the requests of that step fail; the engine checks its state and serves on.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"an engine step serving this request failed ({type(cause).__name__}: {cause}); retry")
        self.__cause__ = cause


class EngineFailedError(EngineUnavailableError):
    """The engine met an error it cannot recover from and stopped (HTTP 503 / gRPC UNAVAILABLE)."""


MAX_STOP_STRINGS = 16
MAX_TOKENS_LIMIT = 1 << 20
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's limit)
MAX_N = 16  # choices per request (n / best_of); documented in docs/serving.md
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy.  top_k 0 and top_p 1.0 disable those filters.
    ``seed`` makes sampling reproducible per request.  Generation stops at
    ``max_tokens``, on the model's EOS (unless ``ignore_eos``), on any of
    ``stop_token_ids``, or when the text ends with one of ``stop`` (the stop string
    is not included in the returned text).  ``max_tokens`` 0 generates nothing (only
    useful with ``prompt_logprobs``: scoring a prompt).

    Logprobs (log-softmax of the model's raw logits, before penalties/bias/temperature):
    ``logprobs`` N returns, per generated token, its logprob and the N most likely
    alternatives (0: the token's own only); ``prompt_logprobs`` N the same for every
    prompt token after the first.  Both are None (off) by default, at most 20.

    Penalties and biases (applied on the device, in this order, before temperature):
    ``logit_bias`` {token id: value in [-100, 100]} added to the logits; ``min_tokens``
    masks EOS and ``stop_token_ids`` until that many tokens were generated;
    ``repetition_penalty`` (HF's: every token seen in prompt or output has a positive
    logit divided by it, a negative one multiplied; 1 is off); ``frequency_penalty`` and
    ``presence_penalty`` in [-2, 2] (OpenAI's: logit - count * frequency -
    (count > 0) * presence, over generated tokens).

    ``structured`` (a ``strata_jax.structured.StructuredOutput``): the output must match a
    JSON schema, any JSON object, a regex, one of several strings or a grammar; tokens
    that cannot continue a match are masked on the device, and the grammar's end ends
    the request (finish reason ``stop``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    structured: Any = None  # strata_jax.structured.StructuredOutput (not imported here: no llguidance needed)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 0, MAX_TOKENS_LIMIT)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("min_tokens", self.min_tokens, 0, MAX_TOKENS_LIMIT)
        if self.structured is not None and not callable(getattr(self.structured, "grammar", None)):
            raise InvalidRequestError("structured must be a strata_jax.structured.StructuredOutput")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self._check_logit_bias()
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, 0, 1 << 31)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, (1 << 63) - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, 0, 1 << 31)

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(
                f"logit_bias must be a map of token id to bias, got {type(self.logit_bias).__name__}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"
            )
        checked: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _token_key(key)
            _check_float(f"logit_bias[{token}]", value, -100.0, 100.0)
            checked[token] = float(value)
        object.__setattr__(self, "logit_bias", checked)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the params name must exist in the model's vocabulary."""
        for token in self.logit_bias:
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias names token id {token}, outside the vocabulary [0, {vocab_size})"
                )
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids names token id {token}, outside the vocabulary [0, {vocab_size})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """Params of choice ``index`` of an n > 1 request.  Choice 0 is the request as
        sent (so n=1 and choice 0 agree); a seeded request gives every other choice a
        distinct seed derived from it (reproducible); unseeded choices differ anyway
        (their request ids key their randomness)."""
        if index == 0 or self.seed is None:
            return self
        digest = hashlib.sha256(f"{self.seed}:choice:{index}".encode()).digest()
        return dataclasses.replace(self, seed=int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))

    @property
    def needs_sampling_state(self) -> bool:
        """Whether a device-side state row (penalties, bias, min_tokens) is needed."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.min_tokens
        )


def _token_key(key: object) -> int:
    """logit_bias keys: ints, or decimal strings (JSON object keys are strings)."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def empty_tier_counts() -> dict[str, int]:
    return {"device": 0, "host": 0, "storage": 0}


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob: the token there and, best first, the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """The finished result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    cached_tokens: dict[str, int] = field(default_factory=empty_tier_counts)  # per tier
    ttft_s: float = 0.0  # time to first token, seconds from submission
    latency_s: float = 0.0
    logprobs: list[TokenLogprob] | None = None  # one per generated token when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())


@dataclass
class StreamChunk:
    """One streamed increment: new token ids and the text they completed.

    The last chunk of a request has ``finished=True`` and a ``finish_reason``;
    ``cached_tokens`` is filled from the first chunk on.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=empty_tier_counts)
    logprobs: list[TokenLogprob] | None = None  # for this chunk's token_ids, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first chunk, when asked
    # on the last chunk: seconds from submission to the first token and to the last
    ttft_s: float | None = None
    latency_s: float | None = None


# ---------------------------------------------------------------------- request validation
class Encoder(Protocol):
    """What validation needs of a tokenizer: text to token ids."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class RequestLimits:
    """What an engine accepts: one set of limits, checked by ``validate_request``.

    ``vocab_size``: token ids lie in ``[0, vocab_size)``.  ``max_context_tokens``: the
    prompt plus ``max_tokens`` must fit in it.  ``kv_pages`` (with ``page_size``): the
    device pool's pages, which one request's KV must fit in (None: not checked).
    """

    vocab_size: int
    max_context_tokens: int
    kv_pages: int | None = None
    page_size: int = 1


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed ``validate_request``: token ids, its id (None: the engine
    names it), its cache namespace (``cache_salt``, "" for none), its params and the LoRA
    adapter it names (None: the base model; the engine resolves the name)."""

    prompt_ids: list[int]
    request_id: str | None
    namespace: str
    params: SamplingParams
    lora_name: str | None = None


def validate_request(
    prompt: object,
    params: object,
    limits: RequestLimits,
    *,
    request_id: object = None,
    cache_salt: object = None,
    tokenizer: Encoder | None = None,
    lora_name: object = None,
) -> ValidRequest:
    """Check everything a user sends with a request; ``InvalidRequestError`` naming the first fault.

    ``prompt``: text (encoded with ``tokenizer``; refused without one) or token ids.
    ``params``: a ``SamplingParams`` (None: the defaults).  ``request_id``: None, or a
    non-empty printable string of at most ``MAX_REQUEST_ID_CHARS``.  ``cache_salt``:
    None, or a string of at most ``MAX_CACHE_SALT_CHARS``.  ``lora_name``: None or a
    non-empty string (whether it is loaded is the engine's check).  The prompt plus
    ``max_tokens`` must fit in the context (``PromptTooLongError``) and the device pool.
    """
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    rid = check_request_id(request_id) if request_id is not None else None
    namespace = check_cache_salt(cache_salt)
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise InvalidRequestError(f"lora_name must be a non-empty string, got {lora_name!r}")
    checked = check_prompt(prompt, limits.vocab_size)
    if isinstance(checked, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token ids")
        checked = list(tokenizer.encode(checked))
        if not checked:
            raise InvalidRequestError("prompt is empty (it encodes to no tokens)")
    check_fits(len(checked), params.max_tokens, limits)
    params.check_vocab(limits.vocab_size)
    return ValidRequest(checked, rid, namespace, params, lora_name)


def check_prompt(prompt: object, vocab_size: int) -> str | list[int]:
    """A non-empty text, or non-empty token ids (ints, not bools) in ``[0, vocab_size)``."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        return prompt
    if isinstance(prompt, Sequence):
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty (no token ids)")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"prompt token {i} is not an integer: {t!r}")
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"prompt token {i} = {t} is outside the vocabulary [0, {vocab_size})")
        return ids
    raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_request_id(request_id: object) -> str:
    """A caller's request id: a non-empty printable string of at most ``MAX_REQUEST_ID_CHARS``."""
    if (
        not isinstance(request_id, str)
        or not request_id
        or len(request_id) > MAX_REQUEST_ID_CHARS
        or not request_id.isprintable()
    ):
        raise InvalidRequestError(
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} printable characters"
        )
    return request_id


def check_cache_salt(cache_salt: object) -> str:
    """The tenant namespace of a ``cache_salt`` (None: the shared one, "")."""
    if cache_salt is None:
        return ""
    if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
    if "\x1f" in cache_salt:  # it separates a salt from a LoRA adapter's identity (lora.peft_adapter)
        raise InvalidRequestError("cache_salt must not contain the control character U+001F")
    return cache_salt


def check_fits(prompt_tokens: int, max_tokens: int, limits: RequestLimits) -> None:
    """``PromptTooLongError`` unless ``prompt_tokens + max_tokens`` fit in the context and the device pool."""
    total = prompt_tokens + max_tokens
    if total > limits.max_context_tokens:
        raise PromptTooLongError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds the context limit of {limits.max_context_tokens} tokens"
        )
    if limits.kv_pages is not None:
        pages = -(-total // limits.page_size)
        if pages > limits.kv_pages:
            raise PromptTooLongError(f"request needs {pages} KV pages; the device pool has {limits.kv_pages}")


# ---------------------------------------------------------------------- n > 1: the choices
@dataclass(frozen=True)
class Choice:
    """One choice of an n > 1 request, as every face and ``Engine.generate_choices`` submit it.

    ``follows``: the request id of choice 0, whose prefill this choice waits for so it
    decodes over the prompt's pages in the tree instead of recomputing them."""

    index: int
    params: SamplingParams
    request_id: str | None
    follows: str | None


def fan_out(params: SamplingParams, n: object, request_id: str | None = None) -> list[Choice]:
    """OpenAI's ``n``: the requests that make its choices.  Choice 0 is the request as
    sent and runs the prefill; choice i > 0 follows it with a seed of its own
    (``SamplingParams.for_choice``) and without prompt logprobs (choice 0's hold for all).
    With n > 1 choice i has the id ``<request_id>-i`` (a fresh base id when none is given)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    if n == 1:
        return [Choice(0, params, request_id, None)]
    base = request_id or f"choice-{uuid.uuid4().hex}"
    choices = []
    for i in range(n):
        p = params.for_choice(i)
        if i > 0 and p.prompt_logprobs is not None:
            p = dataclasses.replace(p, prompt_logprobs=None)
        choices.append(Choice(i, p, f"{base}-{i}", f"{base}-0" if i > 0 else None))
    return choices
