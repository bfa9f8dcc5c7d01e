"""The OpenAI-compatible HTTP face (FastAPI): builds the app from its routers.

Routers (each over the ``Frontend``, reading ``app.state.http``, a ``HttpContext``):
``serving/routes_openai.py`` (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), ``serving/routes_worker.py`` (what a router asks of a worker in
SGLang's shapes, ``/health``, ``/metrics``) and ``serving/routes_admin.py``
(``/admin/*``); what they share is in ``serving/http_common.py``.  Keys
(``serving/auth.py``): the admin routes and ``POST /flush_cache`` take
``--admin-api-key`` when set, the rest ``--api-key``; ``/health`` and
``/openapi.json`` take none.

Every response carries ``X-Strata-Instance: <id>`` (also in ``/server_info`` as
``instance_id``), so a client behind a router can tell which replica answered.

Status codes: 400 bad request, 401 wrong API key, 403 a valid key of the wrong
scope (``--admin-api-key``), 404 unknown model, 408 body too slow, 413 body too
large, 429 queue full, 503 warming up / shutting down, 500 bug.  Validation errors
name the offending field in ``error.param`` and in the message.

``GET /openapi.json`` describes every route, request bodies included (the
handlers read raw requests, so the bodies are added from the pydantic models).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import openai_protocol as oai
from serving import routes_admin, routes_openai, routes_worker
from serving.config import ServerConfig
from serving.frontend import Frontend
from serving.http_common import HttpContext, HTTPError, http_context

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


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, raised anywhere (an API-key check, FastAPI's own routing), becomes an
    OpenAI-style error response; a refused generation request is counted."""

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return http_context(request).refuse(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return http_context(request).refuse(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return http_context(request).refuse(request, HTTPError(400, str(exc), "invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = HTTPError(exc.status_code, str(exc.detail), "invalid_request_error")
        return http_context(request).refuse(request, error)


def create_app(frontend: Frontend, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``frontend``."""
    app = FastAPI(title="strata-jax", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    instance_id = uuid.uuid4().hex[:16]
    app.state.http = HttpContext(frontend, config, instance_id)
    app.add_middleware(InstanceHeader, instance_id=instance_id)
    _install_error_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_worker.router)
    app.include_router(routes_admin.router)
    return app
