"""What the HTTP routers share: the per-app context, error mapping, API-key checks,
body reading, client-disconnect watching and the SSE response.

Bodies are read by hand (size-capped, UTF-8 checked, JSON parsed, then validated
strictly) so every malformed request gets a 4xx in OpenAI's error envelope.
Bodies deeper than ``MAX_JSON_DEPTH`` are refused (400) before anything recurses
over them, and a body that does not arrive whole within ``--body-timeout-s`` gets
408.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from serving import auth
from serving import openai_protocol as oai
from serving.config import ServerConfig
from serving.frontend import EngineLike, Frontend, aclose
from strata_jax.api import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RequestAbortedError,
    StepFailedError,
)
from strata_jax.cache.storage import StorageError
from strata_jax.lora.registry import AdapterInUseError, AdapterNotFoundError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25
# Deepest JSON nesting a body may have.  Far beyond any real request (tool schemas nest a
# few levels) and far below Python's recursion limit, so nothing that walks a body
# recursively (json.dumps, Jinja's tojson, schema compilers) can hit a RecursionError.
MAX_JSON_DEPTH = 100

# How a refused request is counted (strata_requests_rejected_total{reason}), by HTTP status.
_REJECTION_BY_STATUS = {
    400: "invalid_request",
    401: "unauthorized",
    403: "unauthorized",
    404: "not_found",
    408: "invalid_request",  # the body never arrived whole
    413: "body_too_large",
    422: "invalid_request",
    429: "overloaded",
    503: "unavailable",
}
# The routes whose requests are counted in strata_requests_total.
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


# ---- errors ------------------------------------------------------------------
class HTTPError(Exception):
    """An error that becomes an OpenAI-style JSON error response."""

    def __init__(
        self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    @property
    def rejection_reason(self) -> str | None:
        if self.code == "context_length_exceeded":
            return "too_long"
        return _REJECTION_BY_STATUS.get(self.status)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        if self.status in (408, 413):  # the body was not read to its end: the connection cannot carry another request
            headers = {"Connection": "close"}
        return JSONResponse(
            oai.error_body(self.message, self.type, self.code, self.param), self.status, headers=headers
        )


def map_error(exc: BaseException) -> HTTPError:
    """HTTP status for an error raised while serving a request."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, AdapterInUseError):
        return HTTPError(409, str(exc), "invalid_request_error", "adapter_in_use")
    if isinstance(exc, AdapterNotFoundError):
        return HTTPError(404, str(exc), "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, PromptTooLongError):
        return HTTPError(400, str(exc), "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return HTTPError(400, str(exc), "invalid_request_error")
    if isinstance(exc, LookupError):
        return HTTPError(404, str(exc).strip("'\""), "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, OverloadedError):
        return HTTPError(429, str(exc) or "the server is overloaded; retry later", "rate_limit_error", "overloaded")
    if isinstance(exc, EngineUnavailableError):
        return HTTPError(503, str(exc), "service_unavailable", "unavailable")
    if isinstance(exc, RequestAbortedError):
        return HTTPError(503, str(exc) or "the request was aborted", "service_unavailable", "aborted")
    if isinstance(exc, StepFailedError):  # the engine serves on; the message names the cause
        return HTTPError(500, str(exc), "internal_error", "step_failed")
    if isinstance(exc, StorageError):  # L3 unreachable for an admin call (a flush): the store, not the server
        return HTTPError(503, f"the L3 storage is unavailable: {exc}", "service_unavailable", "storage_unavailable")
    log.error("request failed", exc_info=exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}", "internal_error")


# ---- the app's context ---------------------------------------------------------
@dataclass(frozen=True)
class HttpContext:
    """What every route of one app serves from (``app.state.http``)."""

    frontend: Frontend
    config: ServerConfig
    instance_id: str

    def refuse(self, request: Request, exc: BaseException) -> JSONResponse:
        """The response for a request refused before it reached the frontend; a generation
        request is counted here (the frontend counts the ones it sees)."""
        err = map_error(exc)
        if request.method == "POST" and request.url.path in GENERATION_ROUTES:
            if err.status == 499:  # gone while sending its body: the client ended it, as a cancel
                self.frontend.metrics.requests.labels("http", "cancelled").inc()
            else:
                self.frontend.count_rejected("http", err)
        return err.response()

    def engine_for(self, model_name: str) -> EngineLike:
        """The engine serving ``model_name`` (503 while not ready, 404 for another model)."""
        try:
            engine = self.frontend.engine()
            self.frontend.check_model(model_name)
        except Exception as exc:  # noqa: BLE001 - every cause becomes its HTTP error
            raise map_error(exc) from None
        return engine

    def model_defaults(self, engine: Any) -> Any:
        """The engine's generation_config.json defaults, unless --generation-config none."""
        return getattr(engine, "generation_defaults", None) if self.config.generation_config == "auto" else None

    async def read_body(self, request: Request, model: type[M], *, allow_empty: bool = False) -> M:
        """The request's JSON body as ``model``, within this server's size and time limits."""
        return await read_body(
            request, model, self.config.max_body_bytes, allow_empty=allow_empty, timeout_s=self.config.body_timeout_s
        )


def http_context(request: Request) -> HttpContext:
    """The context of the app serving ``request``."""
    context: HttpContext = request.app.state.http
    return context


# ---- API keys ------------------------------------------------------------------
def _auth_error(refusal: auth.Refusal) -> HTTPError:
    if refusal.forbidden:
        return HTTPError(403, refusal.message, "permission_error", "insufficient_permissions")
    return HTTPError(401, refusal.message, "authentication_error", "invalid_api_key")


def _key_check(scope: auth.Scope) -> Callable[[Request], Awaitable[None]]:
    async def require(request: Request) -> None:
        refusal = auth.check(http_context(request).config, scope, request.headers.get("authorization"))
        if refusal is not None:
            raise _auth_error(refusal)

    return require


# Route dependencies: the key of each scope (``serving/auth.py``).
INFERENCE_AUTH = [Depends(_key_check(auth.Scope.INFERENCE))]
ADMIN_AUTH = [Depends(_key_check(auth.Scope.ADMIN))]


# ---- bodies --------------------------------------------------------------------
def _check_json(data: Any) -> None:
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` and strings that cannot be encoded as
    UTF-8 (lone surrogates from ``\\ud800`` escapes), naming where.  Iterative: the walk
    itself cannot overflow the stack."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            field = _path_text(path[:1])
            raise HTTPError(
                400, f"{field}: JSON nested deeper than {MAX_JSON_DEPTH} levels", "invalid_request_error", param=field
            )
        if isinstance(value, str):
            _check_utf8(value, path)
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_utf8(k, path)
                stack.append((v, (*path, k)))


def _path_text(path: tuple[str, ...]) -> str:
    return ".".join(path) or "body"


def _check_utf8(text: str, path: tuple[str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # the path of a bad key is its parent's; the key itself cannot be printed safely
        field = _path_text(tuple(p.encode("utf-8", "backslashreplace").decode() for p in path))
        raise HTTPError(
            400, f"{field}: invalid UTF-8 in a string: {exc.reason}", "invalid_request_error", param=field
        ) from None


async def _read_raw(request: Request, limit: int, timeout_s: float) -> bytearray:
    """The body, at most ``limit`` bytes (413), arriving whole within ``timeout_s`` (408).

    The deadline covers the whole body, not the gap between bytes: a client that sends a
    byte a second never trips a gap timeout yet holds a connection and a task forever."""
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise HTTPError(400, f"invalid Content-Length {length[:32]!r}", "invalid_request_error")
    if length is not None and int(length) > limit:
        raise HTTPError(413, f"request body exceeds {limit} bytes", "invalid_request_error", "body_too_large")
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                raw += part
                if len(raw) > limit:
                    raise HTTPError(
                        413, f"request body exceeds {limit} bytes", "invalid_request_error", "body_too_large"
                    )
    except TimeoutError:
        raise HTTPError(
            408, f"request body not received within {timeout_s:g} s", "invalid_request_error", "body_timeout"
        ) from None
    except ClientDisconnect:
        raise HTTPError(499, "client disconnected while sending the body", "client_closed_request") from None
    return raw


def _parse_json(raw: bytearray) -> dict[str, Any]:
    """The body as a JSON object (400 naming the problem otherwise)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPError(
            400, f"request body is not valid UTF-8 (byte {exc.start})", "invalid_request_error", param="body"
        ) from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise HTTPError(
            400, f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels", "invalid_request_error", param="body"
        ) from None
    except ValueError as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}", "invalid_request_error", param="body") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "request body must be a JSON object", "invalid_request_error", param="body")
    _check_json(data)
    return data


async def read_body(
    request: Request, model: type[M], limit: int, *, allow_empty: bool = False, timeout_s: float = 60.0
) -> M:
    """Read, decode and validate a JSON body into ``model`` (4xx ``HTTPError`` on any problem)."""
    raw = await _read_raw(request, limit, timeout_s)
    if not raw.strip() and allow_empty:
        raw = bytearray(b"{}")
    data = _parse_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise HTTPError(
            400, oai.describe_validation_error(exc), "invalid_request_error", param=oai.validation_error_param(exc)
        ) from None


# ---- streaming -----------------------------------------------------------------
async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise HTTPError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class AbortingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always closes its generator (so an early disconnect aborts the request)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await aclose(self.body_iterator)


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
