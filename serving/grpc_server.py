"""The gRPC face: ``strata.v1.Strata`` plus ``grpc.health.v1`` and reflection.

Error mapping (``map_error``):

=========================  ====================
``InvalidRequestError``    ``INVALID_ARGUMENT``
``OverloadedError``        ``RESOURCE_EXHAUSTED``
``EngineUnavailableError`` ``UNAVAILABLE``
``RequestAbortedError``    ``ABORTED``
``StepFailedError``        ``INTERNAL`` (the message names the cause)
``StorageError``           ``UNAVAILABLE`` (an admin call that needs L3)
anything else              ``INTERNAL`` (logged)
=========================  ====================

A client cancelling its ``Generate`` stream cancels the handler task; the
``Frontend`` stream's ``finally`` aborts the engine request, freeing its pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from serving import auth
from serving.config import ServerConfig
from serving.disaggregation import BootstrapFields, handoff_for
from serving.frontend import TIERS, Frontend
from serving.protos import strata_pb2, strata_pb2_grpc
from strata_jax.api import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestAbortedError,
    SamplingParams,
    StepFailedError,
    StreamChunk,
    TokenLogprob,
)
from strata_jax.cache.storage import StorageError
from strata_jax.lora.registry import AdapterNotFoundError

log = logging.getLogger(__name__)

SERVICE_NAME = strata_pb2.DESCRIPTOR.services_by_name["Strata"].full_name
_PUBLIC_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def map_error(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC status code and message for an error raised while serving a call."""
    if isinstance(exc, LookupError | AdapterNotFoundError):  # a model or LoRA adapter this server does not hold
        return grpc.StatusCode.NOT_FOUND, str(exc).strip("'\"")
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "the server is overloaded; retry later"
    if isinstance(exc, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, RequestAbortedError):
        return grpc.StatusCode.ABORTED, str(exc) or "the request was aborted"
    if isinstance(exc, StepFailedError):  # the engine serves on; the message names the cause
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, StorageError):  # L3 unreachable for an admin call (a flush): the store, not the server
        return grpc.StatusCode.UNAVAILABLE, f"the L3 storage is unavailable: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def params_from_proto(
    msg: strata_pb2.SamplingParams, model_defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """``SamplingParams`` from the proto.  An unset field takes ``model_defaults`` (the model's
    generation_config.json), else ``SamplingParams``' default (greedy, no filters)."""
    kwargs: dict = dict(model_defaults or {})
    for name in (
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "repetition_penalty",
        "logprobs",
        "prompt_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
    ):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.stop:
        kwargs["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    return SamplingParams(**kwargs)


def _tiers(counts: dict[str, int]) -> strata_pb2.TierCounts:
    return strata_pb2.TierCounts(**{t: int(counts.get(t, 0)) for t in TIERS})


def _logprob(x: TokenLogprob) -> strata_pb2.TokenLogprob:
    top = [strata_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in x.top]
    return strata_pb2.TokenLogprob(token_id=x.token_id, logprob=x.logprob, top=top)


def chunk_to_proto(chunk: StreamChunk) -> strata_pb2.GenerateResponse:
    """One ``StreamChunk`` as a ``GenerateResponse`` (usage on the final one)."""
    msg = strata_pb2.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finished=chunk.finished,
        cached_tokens=_tiers(chunk.cached_tokens),
    )
    if chunk.logprobs:
        msg.logprobs.extend(_logprob(x) for x in chunk.logprobs)
    if chunk.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob(x) for x in chunk.prompt_logprobs if x is not None)
    if chunk.finished:
        msg.finish_reason = chunk.finish_reason or "stop"
        msg.usage.CopyFrom(
            strata_pb2.Usage(
                prompt_tokens=chunk.prompt_tokens,
                completion_tokens=chunk.completion_tokens,
                cached_tokens=sum(int(chunk.cached_tokens.get(t, 0)) for t in TIERS),
                cached_tokens_per_tier=_tiers(chunk.cached_tokens),
            )
        )
    return msg


def bootstrap_fields(request: strata_pb2.GenerateRequest) -> BootstrapFields:
    """The router's ``disaggregated_params`` (none: an ordinary request); an empty host or a
    zero port means the decode replica cannot ask the prefill replica and waits on L3 alone."""
    if not request.HasField("disaggregated_params"):
        return BootstrapFields()
    fields = request.disaggregated_params
    return BootstrapFields(fields.bootstrap_room, fields.bootstrap_host or None, fields.bootstrap_port or None)


class StrataServicer(strata_pb2_grpc.StrataServicer):
    """``strata.v1.Strata`` on top of a ``Frontend``."""

    def __init__(self, frontend: Frontend, config: ServerConfig) -> None:
        self._frontend = frontend
        self._config = config

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message = map_error(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.error("gRPC call failed", exc_info=exc)
        await context.abort(code, message)

    async def Generate(  # noqa: N802 (gRPC naming)
        self, request: strata_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[strata_pb2.GenerateResponse]:
        kind = request.WhichOneof("prompt")
        stream = None
        try:  # refusals before the frontend are counted here; the frontend counts the rest
            if kind is None:
                raise InvalidRequestError("prompt is empty: set `text` or `token_ids`")
            prompt = request.text if kind == "text" else list(request.token_ids.ids)
            engine = self._frontend.engine_or_none
            defaults = (
                getattr(engine, "generation_defaults", None) if self._config.generation_config == "auto" else None
            )
            params = params_from_proto(request.params, defaults.sampling_defaults() if defaults is not None else None)
            # NOT_FOUND for an adapter that is not loaded; the base model's name selects none
            lora_name = self._frontend.lora_name(request.lora_name) if request.lora_name else None
            handoff = handoff_for(self._config.role, bootstrap_fields(request))
            if handoff is not None and handoff.role == "prefill":
                params = self._frontend.play_prefill(params)
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            self._frontend.count_rejected("grpc", exc)
            await self._fail(context, exc)
            return
        try:
            stream = self._frontend.stream(
                prompt,
                params,
                api="grpc",
                cache_salt=request.cache_salt or None,
                request_id=request.request_id or None,
                lora_name=lora_name,
                handoff=handoff,
            )
            first = await stream.__anext__()  # admission errors surface here
        except StopAsyncIteration:
            return
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if stream is not None:
                await stream.aclose()
            await self._fail(context, exc)
            return
        try:
            yield chunk_to_proto(first)
            if first.finished:
                return
            async for chunk in stream:
                yield chunk_to_proto(chunk)
        except Exception as exc:  # noqa: BLE001 - mid-stream: aborted, shutting down, or a bug
            await self._fail(context, exc)
        finally:
            await stream.aclose()  # aborts the engine request if it did not finish

    async def GetCacheStats(self, request, context):  # noqa: N802
        try:
            stats = await asyncio.to_thread(self._frontend.engine().cache_stats)
            return strata_pb2.GetCacheStatsResponse(json=json.dumps(stats, default=str))
        except Exception as exc:  # noqa: BLE001
            await self._fail(context, exc)

    async def FlushCache(self, request, context):  # noqa: N802
        tier = request.tier or "all"
        try:
            if tier not in ("all", "device", "host", "storage"):
                raise InvalidRequestError(f"tier must be one of all, device, host, storage; got {tier!r}")
            await asyncio.to_thread(self._frontend.engine().flush_cache, tier)
            return strata_pb2.FlushCacheResponse()
        except Exception as exc:  # noqa: BLE001
            await self._fail(context, exc)

    async def StartProfile(self, request, context):  # noqa: N802
        try:
            log_dir = request.log_dir or self._config.profile_dir
            if not log_dir:
                raise InvalidRequestError("no log_dir given and the server has no --profile-dir")
            await asyncio.to_thread(self._frontend.engine().start_profile, log_dir)
            return strata_pb2.StartProfileResponse(log_dir=log_dir)
        except RuntimeError as exc:  # e.g. a trace is already running
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001
            await self._fail(context, exc)

    async def StopProfile(self, request, context):  # noqa: N802
        try:
            trace_dir = await asyncio.to_thread(self._frontend.engine().stop_profile)
            return strata_pb2.StopProfileResponse(trace_dir=str(trace_dir))
        except RuntimeError as exc:  # e.g. no trace running
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001
            await self._fail(context, exc)


GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
OnRefused = Callable[[str], None]  # called with a rejection reason for each refused Generate call


ADMIN_METHODS = frozenset(
    f"/{SERVICE_NAME}/{name}" for name in ("GetCacheStats", "FlushCache", "StartProfile", "StopProfile")
)


def method_scope(method: str) -> auth.Scope:
    """The key scope of a ``strata.v1.Strata`` method (``serving/auth.py``)."""
    return auth.Scope.ADMIN if method in ADMIN_METHODS else auth.Scope.INFERENCE


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the key of their scope in ``authorization: Bearer <key>``
    (``serving/auth.py``; health and reflection exempt): ``UNAUTHENTICATED``, or
    ``PERMISSION_DENIED`` for a valid key of the other scope."""

    def __init__(self, config: ServerConfig, on_refused: OnRefused | None = None) -> None:
        self._config = config
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_PUBLIC_METHOD_PREFIXES):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization")
        refusal = auth.check(self._config, method_scope(details.method), sent)
        if refusal is None:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if details.method == GENERATE_METHOD and self._on_refused is not None:
            self._on_refused("unauthorized")

        code = grpc.StatusCode.PERMISSION_DENIED if refusal.forbidden else grpc.StatusCode.UNAUTHENTICATED

        async def deny_unary(request, context):
            await context.abort(code, refusal.message)

        async def deny_stream(request, context):
            await context.abort(code, refusal.message)
            yield  # pragma: no cover - makes this an async generator

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            deny_unary, handler.request_deserializer, handler.response_serializer
        )


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """Turns undecodable requests (e.g. invalid UTF-8 in a string field) into ``INVALID_ARGUMENT``.

    Without it grpc answers ``UNKNOWN`` with a Python exception name.
    """

    def __init__(self, on_refused: OnRefused | None = None) -> None:
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        decode = handler.request_deserializer

        def safe_decode(data: bytes) -> object:
            try:
                return decode(data)
            except DecodeError as exc:
                return _Undecodable(str(exc))

        counted = details.method == GENERATE_METHOD and self._on_refused is not None

        async def reject(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
            if counted:
                self._on_refused("invalid_request")  # type: ignore[misc]
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {bad.reason}")

        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def guarded_stream(request, context):
                if isinstance(request, _Undecodable):
                    await reject(context, request)
                    return
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(guarded_stream, safe_decode, handler.response_serializer)
        if handler.unary_unary:
            inner_unary = handler.unary_unary

            async def guarded_unary(request, context):
                if isinstance(request, _Undecodable):
                    await reject(context, request)
                    return None
                return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(guarded_unary, safe_decode, handler.response_serializer)
        return handler


class GrpcFace:
    """The gRPC server: Strata service, health (NOT_SERVING until the engine is ready), reflection."""

    def __init__(self, frontend: Frontend, config: ServerConfig) -> None:
        def on_refused(reason: str) -> None:
            frontend.metrics.count_rejected("grpc", reason)

        interceptors: list[grpc.aio.ServerInterceptor] = (
            [ApiKeyInterceptor(config, on_refused)] if auth.any_key(config) else []
        )
        interceptors.append(DecodeGuardInterceptor(on_refused))
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", config.max_body_bytes),
                ("grpc.max_send_message_length", config.max_body_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        strata_pb2_grpc.add_StrataServicer_to_server(StrataServicer(frontend, config), self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        address = f"{config.host}:{config.grpc_port}"
        if ":" in config.host:  # IPv6 literal
            address = f"[{config.host}]:{config.grpc_port}"
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind the gRPC port {address}")

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, let in-flight ones finish for up to ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
