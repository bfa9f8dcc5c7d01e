"""The admin routes (``--admin-api-key`` when set): ``GET /admin/cache_stats``,
``GET /admin/check_accounting``, ``POST /admin/flush_cache``, ``POST /admin/profile/start``,
``POST /admin/profile/stop``."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from serving import openai_protocol as oai
from serving.http_common import ADMIN_AUTH, HTTPError, http_context, map_error

router = APIRouter()


def _profile_state_error(exc: RuntimeError) -> JSONResponse:
    """409: a trace is already running (start) or none is (stop)."""
    return HTTPError(409, str(exc), "invalid_request_error", "profile_state").response()


@router.get("/admin/cache_stats", dependencies=ADMIN_AUTH)
async def cache_stats(request: Request) -> JSONResponse:
    try:
        stats = await asyncio.to_thread(http_context(request).frontend.engine().cache_stats)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse(json.loads(json.dumps(stats, default=str)))


@router.get("/admin/check_accounting", dependencies=ADMIN_AUTH)
async def check_accounting(request: Request) -> JSONResponse:
    """The cache invariants and exact page accounting (``Engine.check_accounting``): a soak
    or an operator asks it after traffic; 500 ``accounting`` with the broken invariant."""
    try:
        figures = await asyncio.to_thread(http_context(request).frontend.engine().check_accounting)
    except AssertionError as exc:
        return HTTPError(500, f"the engine's accounting is broken: {exc}", "internal_error", "accounting").response()
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse(figures)


@router.post("/admin/flush_cache", dependencies=ADMIN_AUTH)
async def flush_cache(request: Request) -> JSONResponse:
    ctx = http_context(request)
    try:
        req = await ctx.read_body(request, oai.AdminFlushRequest, allow_empty=True)
        await asyncio.to_thread(ctx.frontend.engine().flush_cache, req.tier, req.lora_name)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse({"flushed": req.tier} | ({"lora_name": req.lora_name} if req.lora_name else {}))


@router.post("/admin/profile/start", dependencies=ADMIN_AUTH)
async def profile_start(request: Request) -> JSONResponse:
    ctx = http_context(request)
    try:
        req = await ctx.read_body(request, oai.AdminProfileRequest, allow_empty=True)
        log_dir = req.log_dir or ctx.config.profile_dir
        if not log_dir:
            raise HTTPError(
                400, "no log_dir given and the server has no --profile-dir", "invalid_request_error", param="log_dir"
            )
        await asyncio.to_thread(ctx.frontend.engine().start_profile, log_dir)
    except RuntimeError as exc:
        return _profile_state_error(exc)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse({"log_dir": log_dir})


@router.post("/admin/profile/stop", dependencies=ADMIN_AUTH)
async def profile_stop(request: Request) -> JSONResponse:
    try:
        trace_dir = await asyncio.to_thread(http_context(request).frontend.engine().stop_profile)
    except RuntimeError as exc:
        return _profile_state_error(exc)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse({"trace_dir": str(trace_dir)})
