"""What a router or an operator asks of a worker: SGLang's worker routes
(``serving/worker_info.py``) ``GET /server_info``, ``GET /model_info`` (and the older
``/get_server_info``, ``/get_model_info``), ``GET /get_load``, ``POST /flush_cache``,
plus ``GET /health``, ``GET /metrics`` and, for prefill/decode disaggregation,
``GET /pd/rooms/{room}`` (``serving/disaggregation.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from serving import worker_info
from serving.http_common import ADMIN_AUTH, INFERENCE_AUTH, http_context, map_error

router = APIRouter()


def _worker_answer(build: Callable[[], Any]) -> JSONResponse:
    try:
        return JSONResponse(build())
    except Exception as exc:  # noqa: BLE001 - 503 while warming up / draining
        return map_error(exc).response()


@router.get("/server_info", dependencies=INFERENCE_AUTH)
@router.get("/get_server_info", dependencies=INFERENCE_AUTH)
async def server_info(request: Request) -> JSONResponse:
    ctx = http_context(request)
    return _worker_answer(lambda: worker_info.server_info(ctx.frontend, ctx.instance_id))


@router.get("/model_info", dependencies=INFERENCE_AUTH)
@router.get("/get_model_info", dependencies=INFERENCE_AUTH)
async def model_info(request: Request) -> JSONResponse:
    frontend = http_context(request).frontend
    return _worker_answer(lambda: worker_info.model_info(frontend))


@router.get("/get_load", dependencies=INFERENCE_AUTH)
async def get_load(request: Request) -> JSONResponse:
    frontend = http_context(request).frontend
    return _worker_answer(lambda: worker_info.load_info(frontend))


@router.post("/flush_cache", dependencies=ADMIN_AUTH)
async def sglang_flush_cache(request: Request) -> JSONResponse:
    """SGLang's flush: this server's own tiers (L1, L2); the shared L3 is left alone
    (``POST /admin/flush_cache {"tier": "storage"}`` clears it)."""
    try:
        engine = http_context(request).frontend.engine()
        for tier in worker_info.LOCAL_TIERS:
            await asyncio.to_thread(engine.flush_cache, tier)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse({"flushed": list(worker_info.LOCAL_TIERS)})


@router.get("/pd/rooms/{room}")
async def pd_room(request: Request, room: int) -> JSONResponse:
    """How a disaggregated prompt stands on this (prefill) replica, for the decode replica
    waiting for its pages: ``in_flight``, ``done``, ``failed`` or ``unknown``.  Unauthenticated,
    as ``/health``: the decode replica holds no key, and a room's state tells nothing else."""
    return JSONResponse({"room": room, "state": http_context(request).frontend.rooms.state(room)})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when ready; 503 otherwise, with the start-up progress while warming up
    (``{"status": "warming", "progress": {"phase", "programs_done", "programs_total", ...}}``)."""
    frontend = http_context(request).frontend
    body: dict = {"status": frontend.state.value}
    if not frontend.ready and frontend.warmup_progress is not None:
        body["progress"] = frontend.warmup_progress.snapshot()
    return JSONResponse(body, 200 if frontend.ready else 503)


@router.get("/metrics", dependencies=INFERENCE_AUTH)
async def metrics(request: Request) -> Response:
    body = await asyncio.to_thread(http_context(request).frontend.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
