"""Public request/response types of the engine (the contract the faces build on).

Everything a user passes in is validated here and rejected with
``InvalidRequestError`` (a ``ValueError``) carrying a readable message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class StrataError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(StrataError, ValueError):
    """The request itself is wrong (maps to HTTP 400 / gRPC INVALID_ARGUMENT)."""


class OverloadedError(StrataError):
    """The waiting queue is full (maps to HTTP 429 / gRPC RESOURCE_EXHAUSTED)."""


class EngineUnavailableError(StrataError):
    """The engine is warming up or shutting down (HTTP 503 / gRPC UNAVAILABLE)."""


class RequestAbortedError(StrataError):
    """The request was aborted before it finished."""


MAX_STOP_STRINGS = 16
MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy.  top_k 0 and top_p 1.0 disable those filters.
    ``seed`` makes sampling reproducible per request.  Generation stops at
    ``max_tokens``, on the model's EOS (unless ``ignore_eos``), on any of
    ``stop_token_ids``, or when the text ends with one of ``stop`` (the stop string
    is not included in the returned text).
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
