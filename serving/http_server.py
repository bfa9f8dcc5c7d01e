"""The OpenAI-compatible HTTP face (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, the admin
routes ``GET /admin/cache_stats``, ``GET /admin/check_accounting``, ``POST /admin/flush_cache``,
``POST /admin/profile/start``, ``POST /admin/profile/stop``, and what a router asks
of a worker in SGLang's shapes (``serving/worker_info.py``): ``GET /server_info``,
``GET /model_info`` (and the older ``/get_server_info``, ``/get_model_info``),
``GET /get_load``, ``POST /flush_cache``.  Keys (``serving/auth.py``): the admin routes
and ``POST /flush_cache`` take ``--admin-api-key`` when set, the rest ``--api-key``;
``/health`` and ``/openapi.json`` take none.

Every response carries ``X-Strata-Instance: <id>`` (also in ``/server_info`` as
``instance_id``), so a client behind a router can tell which replica answered.

Bodies are read by hand (size-capped, UTF-8 checked, JSON parsed, then validated
strictly) so every malformed request gets a 4xx in OpenAI's error envelope.
Bodies deeper than ``MAX_JSON_DEPTH`` are refused (400) before anything recurses
over them, and a body that does not arrive whole within ``--body-timeout-s`` gets
408.  Status codes: 400 bad request, 401 wrong API key, 403 a valid key of the
wrong scope (``--admin-api-key``), 404 unknown model, 408 body too slow, 413 body
too large, 429 queue full, 503 warming up / shutting down, 500 bug.  Validation
errors name the offending field in ``error.param`` and in the message.

``GET /openapi.json`` describes every route, request bodies included (the
handlers read raw requests, so the bodies are added from the pydantic models).

A streaming response waits for the engine's first chunk before sending headers,
so admission errors (400/429/503) keep their status codes; after that a client
disconnect closes the SSE generator, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect

from serving import auth, tool_calls, worker_info
from serving import openai_logprobs as olp
from serving import openai_protocol as oai
from serving.config import ServerConfig
from serving.frontend import TIERS, Frontend, PromptTooLongError, check_prompt
from strata_jax.api import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestAbortedError,
    SamplingParams,
    StepFailedError,
    StreamChunk,
)
from strata_jax.cache.storage import StorageError

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
INSTANCE_HEADER = "x-strata-instance"


class InstanceHeader:
    """ASGI middleware: every HTTP response carries ``X-Strata-Instance`` (which replica answered).

    Plain ASGI (it only touches ``http.response.start``), so streaming and disconnect
    detection behave exactly as without it."""

    def __init__(self, app: Any, instance_id: str) -> None:
        self.app = app
        self.header = (INSTANCE_HEADER.encode(), instance_id.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


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


def _auth_error(refusal: auth.Refusal) -> HTTPError:
    if refusal.forbidden:
        return HTTPError(403, refusal.message, "permission_error", "insufficient_permissions")
    return HTTPError(401, refusal.message, "authentication_error", "invalid_api_key")


def map_error(exc: BaseException) -> HTTPError:
    """HTTP status for an error raised while serving a request."""
    if isinstance(exc, HTTPError):
        return exc
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


async def read_body(
    request: Request, model: type[M], limit: int, *, allow_empty: bool = False, timeout_s: float = 60.0
) -> M:
    """Read, decode and validate a JSON body into ``model`` (4xx ``HTTPError`` on any problem)."""
    raw = await _read_raw(request, limit, timeout_s)
    if not raw.strip() and allow_empty:
        raw = bytearray(b"{}")
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
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise HTTPError(
            400, oai.describe_validation_error(exc), "invalid_request_error", param=oai.validation_error_param(exc)
        ) from None


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

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Totals:
    """Accumulates the chunks of one request."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish_reason = "abort"
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached: dict[str, int] = {t: 0 for t in TIERS}
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.text.append(chunk.text)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens = chunk.completion_tokens or self.completion_tokens
        if chunk.cached_tokens:
            self.cached = dict(chunk.cached_tokens)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"

    def usage(self) -> dict:
        return oai.usage(self.prompt_tokens, self.completion_tokens, self.cached)


async def _collect(stream: AsyncIterator[StreamChunk]) -> _Totals:
    totals = _Totals()
    try:
        async for chunk in stream:
            totals.add(chunk)
    finally:
        await stream.aclose()
    return totals


async def _collect_all(streams: list[AsyncIterator[StreamChunk]]) -> list[_Totals]:
    """Run all streams; on the first failure cancel (abort) the rest and re-raise it."""
    tasks = [asyncio.ensure_future(_collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(stream: AsyncIterator[StreamChunk]) -> StreamChunk | None:
    """The first chunk (admission errors surface here); ``None`` if the stream is empty."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await stream.aclose()
        raise


def _choice_streams(
    frontend: Frontend, prompt: Any, params: SamplingParams, n: int, *, cache_salt: str | None, request_id: str | None
) -> list[AsyncIterator[StreamChunk]]:
    """n choices of one prompt: choice 0 runs the prefill, the others follow it (they wait
    for its pages in the tree instead of recomputing the prompt) with distinct seeds.
    Only choice 0 computes prompt logprobs (the same for every choice)."""
    if n == 1:
        return [frontend.stream(prompt, params, api="http", cache_salt=cache_salt, request_id=request_id)]
    base = request_id or oai.new_id("choice")
    streams = []
    for i in range(n):
        p = params.for_choice(i)
        if i > 0 and p.prompt_logprobs is not None:
            p = dataclasses.replace(p, prompt_logprobs=None)
        follows = f"{base}-0" if i > 0 else None
        streams.append(
            frontend.stream(prompt, p, api="http", cache_salt=cache_salt, request_id=f"{base}-{i}", follows=follows)
        )
    return streams


async def _merged(streams: list[AsyncIterator[StreamChunk]]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Chunks of several streams as they come, tagged with the stream's index; closing
    this generator closes (aborts) every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[StreamChunk]) -> None:
        try:
            async for chunk in s:
                await queue.put((i, chunk))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


def _usage_of(totals: dict[int, _Totals]) -> dict:
    """Usage over the choices so far: the prompt once (choice 0's), completions summed."""
    lead = totals.get(0) or next(iter(totals.values()))
    return oai.usage(lead.prompt_tokens, sum(t.completion_tokens for t in totals.values()), lead.cached)


def decode_ids(engine: Any, ids: list[int]) -> str:
    tokenizer = getattr(engine, "tokenizer", None)
    return tokenizer.decode(list(ids)) if tokenizer is not None else ""


def _sampling_defaults(defaults: Any) -> dict[str, Any]:
    """The model's recommended sampling values (generation_config.json), if the engine has any."""
    return defaults.sampling_defaults() if defaults is not None else {}


# The JSON body each route reads by hand, and whether it may be empty: the handlers take a raw
# ``Request`` (so every malformed body gets our 4xx, not FastAPI's 422), which leaves FastAPI's
# schema without request bodies; ``_openapi`` adds them from the same pydantic models.
REQUEST_BODIES: dict[str, tuple[type[BaseModel], bool]] = {
    "/v1/completions": (oai.CompletionRequest, True),
    "/v1/chat/completions": (oai.ChatCompletionRequest, True),
    "/admin/flush_cache": (oai.AdminFlushRequest, False),
    "/admin/profile/start": (oai.AdminProfileRequest, False),
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of ``app`` plus the request bodies of ``REQUEST_BODIES`` (cached)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, defs = models_json_schema(
            [(model, "validation") for model, _required in REQUEST_BODIES.values()],
            ref_template="#/components/schemas/{model}",
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, (model, required) in REQUEST_BODIES.items():
            body = {"required": required, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
            schema["paths"][path]["post"]["requestBody"] = body
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(frontend: Frontend, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``frontend``."""
    app = FastAPI(title="strata-jax", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    limit, body_timeout = config.max_body_bytes, config.body_timeout_s
    app.state.instance_id = instance_id = uuid.uuid4().hex[:16]
    app.add_middleware(InstanceHeader, instance_id=instance_id)

    def model_defaults(engine: Any) -> Any:
        """The engine's generation_config.json defaults, unless --generation-config none."""
        return getattr(engine, "generation_defaults", None) if config.generation_config == "auto" else None

    def key_check(scope: auth.Scope) -> Callable[[Request], Awaitable[None]]:
        async def require(request: Request) -> None:
            refusal = auth.check(config, scope, request.headers.get("authorization"))
            if refusal is not None:
                raise _auth_error(refusal)

        return require

    inference_auth = [Depends(key_check(auth.Scope.INFERENCE))]
    admin_auth = [Depends(key_check(auth.Scope.ADMIN))]

    def refuse(request: Request, exc: BaseException) -> JSONResponse:
        """The response for a generation request refused before it reached the frontend (counted here)."""
        err = map_error(exc)
        if request.method == "POST" and request.url.path in GENERATION_ROUTES:
            if err.status == 499:  # gone while sending its body: the client ended it, as a cancel
                frontend.metrics.requests.labels("http", "cancelled").inc()
            else:
                frontend.count_rejected("http", err)
        return err.response()

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return refuse(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return refuse(request, exc)

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refuse(request, HTTPError(400, str(exc), "invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return refuse(request, HTTPError(exc.status_code, str(exc.detail), "invalid_request_error"))

    def engine_and_model(name: str):
        try:
            engine = frontend.engine()
            frontend.check_model(name)
        except Exception as exc:  # noqa: BLE001
            raise map_error(exc) from None
        return engine

    # ---- OpenAI routes -------------------------------------------------
    def _decoder(engine: Any) -> Callable[[int], str]:
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            return olp.token_text(lambda t: f"<{t}>")
        return olp.token_text(lambda t: tokenizer.decode([t]))

    def _prompt_ids(engine: Any, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            tokenizer = getattr(engine, "tokenizer", None)
            return tokenizer.encode(prompt) if tokenizer is not None else []
        return list(prompt)

    @app.post("/v1/completions", dependencies=inference_auth)
    async def completions(request: Request) -> Response:
        # Phase 1: everything that can refuse the request before the frontend sees it (counted by `refuse`).
        try:
            req = await read_body(request, oai.CompletionRequest, limit, timeout_s=body_timeout)
            engine = engine_and_model(req.model)
            req.check_unsupported()
            prompts = req.prompts()
            if len(prompts) > config.max_batch_prompts:
                raise InvalidRequestError(f"at most {config.max_batch_prompts} prompts per request, got {len(prompts)}")
            if req.stream and len(prompts) != 1:
                raise InvalidRequestError("streaming supports exactly one prompt")
            params = req.sampling_params(
                16 if req.max_tokens is None else req.max_tokens,
                _sampling_defaults(model_defaults(engine)),
            )
            params.check_vocab(engine.vocab_size)
            for p in prompts:  # all prompts are checked before any runs: one bad prompt refuses the request
                check_prompt(p, engine.vocab_size)
        except Exception as exc:  # noqa: BLE001
            return refuse(request, exc)
        # Phase 2: the frontend counts each prompt's request from here on.
        rid = oai.new_id("cmpl")
        candidates = req.num_candidates
        try:
            if req.stream:
                return await _stream_completion(request, req, engine, prompts[0], params, rid)
            streams = []
            for p in prompts:
                streams += _choice_streams(
                    frontend,
                    p,
                    params,
                    candidates,
                    cache_salt=req.cache_salt,
                    request_id=req.request_id if len(prompts) == 1 else None,
                )
            results = await until_disconnect(request, _collect_all(streams))
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        decode = _decoder(engine)
        choices = []
        for k, prompt in enumerate(prompts):
            group = results[k * candidates : (k + 1) * candidates]
            prompt_ids = _prompt_ids(engine, prompt) if req.echo else []
            echo_text = (prompt if isinstance(prompt, str) else decode_ids(engine, prompt)) if req.echo else ""
            prompt_lps = group[0].prompt_logprobs
            if candidates > req.num_choices:  # best_of: keep the n best by logprob per token
                group = sorted(group, key=lambda r: olp.mean_logprob(r.logprobs), reverse=True)[: req.num_choices]
            for r in group:
                logprobs = None
                if req.logprobs is not None:
                    builder = olp.CompletionLogprobs(decode, req.logprobs)
                    parts = []
                    if req.echo and prompt_lps is not None:
                        parts.append(builder.build(prompt_lps, prompt_ids[:1]))
                    parts.append(builder.build(r.logprobs))
                    logprobs = olp.merge_completion_logprobs(parts)
                text = echo_text + "".join(r.text)
                choices.append(
                    {"index": len(choices), "text": text, "finish_reason": r.finish_reason, "logprobs": logprobs}
                )
        leaders = results[::candidates]
        total = oai.usage(
            sum(r.prompt_tokens for r in leaders),  # the prompt once, however many choices
            sum(r.completion_tokens for r in results),
            {t: sum(r.cached.get(t, 0) for r in leaders) for t in TIERS},
        )
        return JSONResponse(oai.completion_response(rid, frontend.model_name, choices, total))

    async def _stream_completion(
        request: Request, req: oai.CompletionRequest, engine: Any, prompt: Any, params: SamplingParams, rid: str
    ) -> Response:
        streams = _choice_streams(
            frontend, prompt, params, req.num_choices, cache_salt=req.cache_salt, request_id=req.request_id
        )
        merged = _merged(streams)
        first = await until_disconnect(request, _first(merged))
        model, created = frontend.model_name, int(time.time())
        decode = _decoder(engine)
        builders = [olp.CompletionLogprobs(decode, req.logprobs or 0) for _ in streams]
        echo_pending = [bool(req.echo)] * len(streams)
        prompt_ids = _prompt_ids(engine, prompt) if req.echo else []
        echo_text = (prompt if isinstance(prompt, str) else decode_ids(engine, prompt)) if req.echo else ""
        prompt_lps: list = []

        def on_chunk(index: int, chunk: StreamChunk) -> list[dict]:
            reason = (chunk.finish_reason or "stop") if chunk.finished else None
            text, parts = chunk.text, []
            if chunk.prompt_logprobs is not None:
                prompt_lps[:] = [chunk.prompt_logprobs]
            if echo_pending[index]:
                echo_pending[index] = False
                text = echo_text + text
                if req.logprobs is not None and prompt_lps:
                    parts.append(builders[index].build(prompt_lps[0], prompt_ids[:1]))
            logprobs = None
            if req.logprobs is not None:
                parts.append(builders[index].build(chunk.logprobs or []))
                logprobs = olp.merge_completion_logprobs(parts)
            event = oai.completion_chunk(rid, model, text, reason, created)
            event["choices"][0].update(index=index, logprobs=logprobs)
            return [event]

        usage = (
            (lambda totals: oai.usage_chunk(rid, model, "text_completion", created, totals))
            if req.include_usage
            else None
        )
        return _sse_response(merged, first, [], on_chunk, usage, continuous_usage=req.continuous_usage)

    @app.post("/v1/chat/completions", dependencies=inference_auth)
    async def chat_completions(request: Request) -> Response:
        # Phase 1: refusals before the frontend (counted by `refuse`).
        try:
            req = await read_body(request, oai.ChatCompletionRequest, limit, timeout_s=body_timeout)
            engine = engine_and_model(req.model)
            req.check_unsupported()
            tokenizer = getattr(engine, "tokenizer", None)
            if tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; use /v1/completions with token ids")
            tools = tool_calls.plan(req, tokenizer, config.tool_call_parser)
            prompt = tokenizer.apply_chat_template(
                tools.messages,
                req.wants_generation_prompt,
                continue_final_message=bool(req.continue_final_message),
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                **({"tools": tools.template_tools} if tools.template_tools else {}),
            )
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=bool(req.add_special_tokens))
            defaults = model_defaults(engine)
            max_tokens = req.max_output_tokens()
            if max_tokens is None:  # the model's max_new_tokens, else the server's default, within the context
                room = engine.max_context_tokens - len(prompt_ids)
                default = getattr(defaults, "max_new_tokens", None) or config.default_chat_max_tokens
                max_tokens = max(1, min(default, room))
            params = req.sampling_params(max_tokens, _sampling_defaults(defaults))
            if tools.constraint is not None:
                if params.structured is not None:
                    raise InvalidRequestError(
                        "tool_choice required or a named function cannot be combined with an output constraint"
                    )
                params = dataclasses.replace(params, structured=tools.constraint)
            params.check_vocab(engine.vocab_size)
            frontend.check_fits(len(prompt_ids), max_tokens)
        except Exception as exc:  # noqa: BLE001
            return refuse(request, exc)
        # Phase 2: the frontend counts the request from here on.
        rid = oai.new_id("chatcmpl")
        try:
            streams = _choice_streams(
                frontend, prompt_ids, params, req.num_choices, cache_salt=req.cache_salt, request_id=req.request_id
            )
            if req.stream:
                return await _stream_chat(request, req, engine, streams, rid, tools.fmt)
            results = await until_disconnect(request, _collect_all(streams))
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        decode = _decoder(engine)
        body = oai.chat_response(
            rid, frontend.model_name, "".join(results[0].text), results[0].finish_reason, results[0].usage()
        )
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(r.text)}
            finish = r.finish_reason
            if tools.fmt is not None:
                content, calls = tools.fmt.parse(message["content"])
                if calls:
                    message = {
                        "role": "assistant",
                        "content": content or None,
                        "tool_calls": [c.openai() for c in calls],
                    }
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": olp.chat_logprobs(r.logprobs, decode, req.top_logprobs or 0) if req.logprobs else None,
            }
            choices.append(choice)
        body["choices"] = choices
        body["usage"] = oai.usage(
            results[0].prompt_tokens, sum(r.completion_tokens for r in results), results[0].cached
        )
        return JSONResponse(body)

    async def _stream_chat(
        request: Request,
        req: oai.ChatCompletionRequest,
        engine: Any,
        streams: list[AsyncIterator[StreamChunk]],
        rid: str,
        fmt: Any = None,
    ) -> Response:
        merged = _merged(streams)
        first = await until_disconnect(request, _first(merged))
        model, created = frontend.model_name, int(time.time())
        decode = _decoder(engine)
        calls = [tool_calls.CallStream(fmt) for _ in streams] if fmt is not None else None

        def on_chunk(index: int, chunk: StreamChunk) -> list[dict]:
            out = []
            text, deltas = chunk.text, []
            if calls is not None:  # content outside tool calls streams; each call goes out once complete
                text, deltas = calls[index].push(chunk.text, final=chunk.finished)
            if text or chunk.logprobs:
                event = oai.chat_chunk(rid, model, {"content": text}, None, created)
                logprobs = (
                    olp.chat_logprobs(chunk.logprobs or [], decode, req.top_logprobs or 0) if req.logprobs else None
                )
                event["choices"][0].update(index=index, logprobs=logprobs)
                out.append(event)
            if deltas:
                event = oai.chat_chunk(rid, model, {"tool_calls": deltas}, None, created)
                event["choices"][0]["index"] = index
                out.append(event)
            if chunk.finished:
                finish = chunk.finish_reason or "stop"
                if calls is not None and calls[index].calls and finish == "stop":
                    finish = "tool_calls"
                event = oai.chat_chunk(rid, model, {}, finish, created)
                event["choices"][0]["index"] = index
                out.append(event)
            return out

        opening = []
        for i in range(len(streams)):
            role = oai.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, created)
            role["choices"][0]["index"] = i
            opening.append(role)
        usage = (
            (lambda totals: oai.usage_chunk(rid, model, "chat.completion.chunk", created, totals))
            if req.include_usage
            else None
        )
        return _sse_response(merged, first, opening, on_chunk, usage, continuous_usage=req.continuous_usage)

    def _sse_response(
        stream: AsyncIterator[tuple[int, StreamChunk]],
        first: tuple[int, StreamChunk] | None,
        opening: list[dict],
        on_chunk: Callable[[int, StreamChunk], list[dict]],
        usage_chunk: Callable[[dict], dict] | None,
        *,
        continuous_usage: bool = False,
    ) -> Response:
        """An SSE response over merged choice streams: ``opening`` events, the events
        ``on_chunk`` makes of each chunk (each with the usage so far when
        ``continuous_usage``), the usage event (if the client asked for one), then ``[DONE]``.
        Usage counts the prompt once, whatever the number of choices."""

        async def events() -> AsyncIterator[str]:
            totals: dict[int, _Totals] = {}
            try:
                for event in opening:
                    yield _sse(event)
                item = first
                while item is not None:
                    index, chunk = item
                    totals.setdefault(index, _Totals()).add(chunk)
                    for event in on_chunk(index, chunk):
                        if continuous_usage:
                            event["usage"] = _usage_of(totals)
                        yield _sse(event)
                    item = await anext(stream, None)
                if usage_chunk is not None:
                    yield _sse(usage_chunk(_usage_of(totals)))
                yield "data: [DONE]\n\n"
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
                err = map_error(exc)
                yield _sse(oai.error_body(err.message, err.type, err.code))
            finally:
                await stream.aclose()

        return AbortingStreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.get("/v1/models", dependencies=inference_auth)
    async def models() -> JSONResponse:
        engine = frontend.engine_or_none
        entry = {"id": frontend.model_name, "object": "model", "created": 0, "owned_by": "strata-jax"}
        if engine is not None:
            entry["max_model_len"] = engine.max_context_tokens
        return JSONResponse({"object": "list", "data": [entry] if engine is not None else []})

    # ---- what a router asks of a worker (SGLang's routes; serving/worker_info.py) ----
    def _worker_answer(build: Callable[[], Any]) -> JSONResponse:
        try:
            return JSONResponse(build())
        except Exception as exc:  # noqa: BLE001 - 503 while warming up / draining
            return map_error(exc).response()

    @app.get("/server_info", dependencies=inference_auth)
    @app.get("/get_server_info", dependencies=inference_auth)
    async def server_info() -> JSONResponse:
        return _worker_answer(lambda: worker_info.server_info(frontend, instance_id))

    @app.get("/model_info", dependencies=inference_auth)
    @app.get("/get_model_info", dependencies=inference_auth)
    async def model_info() -> JSONResponse:
        return _worker_answer(lambda: worker_info.model_info(frontend))

    @app.get("/get_load", dependencies=inference_auth)
    async def get_load() -> JSONResponse:
        return _worker_answer(lambda: worker_info.load_info(frontend))

    @app.post("/flush_cache", dependencies=admin_auth)
    async def sglang_flush_cache() -> JSONResponse:
        """SGLang's flush: this server's own tiers (L1, L2); the shared L3 is left alone
        (``POST /admin/flush_cache {"tier": "storage"}`` clears it)."""
        try:
            engine = frontend.engine()
            for tier in worker_info.LOCAL_TIERS:
                await asyncio.to_thread(engine.flush_cache, tier)
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        return JSONResponse({"flushed": list(worker_info.LOCAL_TIERS)})

    # ---- operations ----------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when ready; 503 otherwise, with the start-up progress while warming up
        (``{"status": "warming", "progress": {"phase", "programs_done", "programs_total", ...}}``)."""
        body: dict = {"status": frontend.state.value}
        if not frontend.ready and frontend.warmup_progress is not None:
            body["progress"] = frontend.warmup_progress.snapshot()
        return JSONResponse(body, 200 if frontend.ready else 503)

    @app.get("/metrics", dependencies=inference_auth)
    async def metrics() -> Response:
        body = await asyncio.to_thread(frontend.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/cache_stats", dependencies=admin_auth)
    async def cache_stats() -> JSONResponse:
        try:
            stats = await asyncio.to_thread(frontend.engine().cache_stats)
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        return JSONResponse(json.loads(json.dumps(stats, default=str)))

    @app.get("/admin/check_accounting", dependencies=admin_auth)
    async def check_accounting() -> JSONResponse:
        """The cache invariants and exact page accounting (``Engine.check_accounting``): a soak
        or an operator asks it after traffic; 500 ``accounting`` with the broken invariant."""
        try:
            figures = await asyncio.to_thread(frontend.engine().check_accounting)
        except AssertionError as exc:
            return HTTPError(
                500, f"the engine's accounting is broken: {exc}", "internal_error", "accounting"
            ).response()
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        return JSONResponse(figures)

    @app.post("/admin/flush_cache", dependencies=admin_auth)
    async def flush_cache(request: Request) -> JSONResponse:
        try:
            req = await read_body(request, oai.AdminFlushRequest, limit, allow_empty=True, timeout_s=body_timeout)
            await asyncio.to_thread(frontend.engine().flush_cache, req.tier)
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        return JSONResponse({"flushed": req.tier})

    @app.post("/admin/profile/start", dependencies=admin_auth)
    async def profile_start(request: Request) -> JSONResponse:
        try:
            req = await read_body(request, oai.AdminProfileRequest, limit, allow_empty=True, timeout_s=body_timeout)
            log_dir = req.log_dir or config.profile_dir
            if not log_dir:
                raise HTTPError(
                    400,
                    "no log_dir given and the server has no --profile-dir",
                    "invalid_request_error",
                    param="log_dir",
                )
            await asyncio.to_thread(frontend.engine().start_profile, log_dir)
        except RuntimeError as exc:  # a trace is already running
            return HTTPError(409, str(exc), "invalid_request_error", "profile_state").response()
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        return JSONResponse({"log_dir": log_dir})

    @app.post("/admin/profile/stop", dependencies=admin_auth)
    async def profile_stop() -> JSONResponse:
        try:
            trace_dir = await asyncio.to_thread(frontend.engine().stop_profile)
        except RuntimeError as exc:  # no trace running
            return HTTPError(409, str(exc), "invalid_request_error", "profile_state").response()
        except Exception as exc:  # noqa: BLE001
            return map_error(exc).response()
        return JSONResponse({"trace_dir": str(trace_dir)})

    return app
