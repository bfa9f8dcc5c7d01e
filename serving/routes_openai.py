"""OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when
``stream``) and ``GET /v1/models``.

Each generation route runs in two phases.  Phase 1 reads and checks the request;
a refusal there is counted by ``HttpContext.refuse``.  Phase 2 hands the request's
choices to the frontend (``Frontend.stream_choices``), which counts each of them.

A streaming response waits for the engine's first chunk before sending headers,
so admission errors (400/429/503) keep their status codes; after that a client
disconnect closes the SSE generator, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serving import openai_logprobs as olp
from serving import openai_protocol as oai
from serving import tool_calls
from serving.disaggregation import Handoff, handoff_for
from serving.frontend import TIERS, EngineLike
from serving.http_common import ADMIN_AUTH, INFERENCE_AUTH, HttpContext, http_context, map_error, until_disconnect
from serving.openai_streams import ChoiceTotals, ChunkStream, collect_all, first_item, merged, sse_response
from strata_jax.api import InvalidRequestError, SamplingParams, StreamChunk, check_prompt

router = APIRouter()


# ---- helpers shared by both generation routes ------------------------------------
def _decoder(engine: Any) -> Callable[[int], str]:
    """Token id -> its text, for logprobs (``<id>`` without a tokenizer)."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return olp.token_text(lambda t: f"<{t}>")
    return olp.token_text(lambda t: tokenizer.decode([t]))


def _sampling_defaults(defaults: Any) -> dict[str, Any]:
    """The model's recommended sampling values (generation_config.json), if the engine has any."""
    return defaults.sampling_defaults() if defaults is not None else {}


def _echo(engine: Any, prompt: Any, echo: bool | None) -> tuple[list[int], str]:
    """The prompt's token ids and text for ``echo`` (empty without it)."""
    if not echo:
        return [], ""
    tokenizer = getattr(engine, "tokenizer", None)
    if isinstance(prompt, str):
        return (tokenizer.encode(prompt) if tokenizer is not None else []), prompt
    ids = list(prompt)
    return ids, (tokenizer.decode(ids) if tokenizer is not None else "")


def _usage_chunk(req: Any, rid: str, model: str, obj: str, created: int) -> Callable[[dict], dict] | None:
    """The final usage-only chunk's builder, when the client asked for one."""
    if not req.include_usage:
        return None
    return lambda totals: oai.usage_chunk(rid, model, obj, created, totals)


# ---- /v1/completions ---------------------------------------------------------------
@dataclasses.dataclass
class _Completion:
    req: oai.CompletionRequest
    engine: EngineLike
    prompts: list[Any]
    params: SamplingParams
    lora_name: str | None  # the LoRA adapter ``model`` selects (None: the base model)
    handoffs: list[Handoff | None] = dataclasses.field(default_factory=list)  # per prompt (serving/disaggregation.py)

    @property
    def model(self) -> str:
        return self.req.model


async def _read_completion(ctx: HttpContext, request: Request) -> _Completion:
    """Phase 1: everything that can refuse a completion before the frontend sees it."""
    req = await ctx.read_body(request, oai.CompletionRequest)
    engine = ctx.engine_for(req.model)
    req.check_unsupported()
    prompts = req.prompts()
    if len(prompts) > ctx.config.max_batch_prompts:
        raise InvalidRequestError(f"at most {ctx.config.max_batch_prompts} prompts per request, got {len(prompts)}")
    if req.stream and len(prompts) != 1:
        raise InvalidRequestError("streaming supports exactly one prompt")
    params = req.sampling_params(
        16 if req.max_tokens is None else req.max_tokens,
        _sampling_defaults(ctx.model_defaults(engine)),
    )
    params.check_vocab(engine.vocab_size)
    for p in prompts:  # all prompts are checked before any runs: one bad prompt refuses the request
        check_prompt(p, engine.vocab_size)
    return _play_role(ctx, _Completion(req, engine, prompts, params, ctx.frontend.lora_name(req.model)))


@router.post("/v1/completions", dependencies=INFERENCE_AUTH)
async def completions(request: Request) -> Response:
    ctx = http_context(request)
    try:
        job = await _read_completion(ctx, request)
    except Exception as exc:  # noqa: BLE001 - every refusal becomes its HTTP error
        return ctx.refuse(request, exc)
    req = job.req
    rid = oai.new_id("cmpl")
    try:
        if req.stream:
            return await _stream_completion(ctx, request, job, rid)
        streams: list[ChunkStream] = []
        for i, p in enumerate(job.prompts):
            streams += ctx.frontend.stream_choices(
                p,
                job.params,
                req.num_candidates,
                api="http",
                cache_salt=req.cache_salt,
                request_id=req.request_id if len(job.prompts) == 1 else None,
                lora_name=job.lora_name,
                handoff=_handoff(job, i),
            )
        results = await until_disconnect(request, collect_all(streams))
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse(_completion_body(job, results, rid, job.model))


def _completion_body(job: _Completion, results: list[ChoiceTotals], rid: str, model: str) -> dict:
    """The response to a non-streamed completion: each prompt's choices (the best
    ``n`` of ``best_of`` candidates), usage counting each prompt once."""
    req, candidates = job.req, job.req.num_candidates
    decode = _decoder(job.engine)
    choices: list[dict] = []
    for k, prompt in enumerate(job.prompts):
        group = results[k * candidates : (k + 1) * candidates]
        prompt_ids, echo_text = _echo(job.engine, prompt, req.echo)
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
    return oai.completion_response(rid, model, choices, total)


async def _stream_completion(ctx: HttpContext, request: Request, job: _Completion, rid: str) -> Response:
    req, prompt = job.req, job.prompts[0]
    streams = ctx.frontend.stream_choices(
        prompt,
        job.params,
        req.num_choices,
        api="http",
        cache_salt=req.cache_salt,
        request_id=req.request_id,
        lora_name=job.lora_name,
        handoff=_handoff(job),
    )
    chunks = merged(streams)
    first = await until_disconnect(request, first_item(chunks))
    model, created = job.model, int(time.time())
    builders = [olp.CompletionLogprobs(_decoder(job.engine), req.logprobs or 0) for _ in streams]
    echo_pending = [bool(req.echo)] * len(streams)
    prompt_ids, echo_text = _echo(job.engine, prompt, req.echo)
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

    usage = _usage_chunk(req, rid, model, "text_completion", created)
    return sse_response(chunks, first, [], on_chunk, usage, continuous_usage=req.continuous_usage)


# ---- /v1/chat/completions ----------------------------------------------------------
@dataclasses.dataclass
class _Chat:
    req: oai.ChatCompletionRequest
    engine: EngineLike
    prompt_ids: list[int]
    params: SamplingParams
    tools: tool_calls.ToolPlan
    lora_name: str | None  # the LoRA adapter ``model`` selects (None: the base model)
    handoffs: list[Handoff | None] = dataclasses.field(default_factory=list)  # per prompt (serving/disaggregation.py)

    @property
    def model(self) -> str:
        return self.req.model


def _chat_prompt_ids(engine: EngineLike, req: oai.ChatCompletionRequest, tools: tool_calls.ToolPlan) -> list[int]:
    """The messages rendered with the model's chat template, then encoded (the template
    writes the special tokens; ``add_special_tokens`` adds the tokenizer's on top)."""
    prompt = engine.tokenizer.apply_chat_template(
        tools.messages,
        req.wants_generation_prompt,
        continue_final_message=bool(req.continue_final_message),
        chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs,
        **({"tools": tools.template_tools} if tools.template_tools else {}),
    )
    return engine.tokenizer.encode(prompt, add_special_tokens=bool(req.add_special_tokens))


async def _read_chat(ctx: HttpContext, request: Request) -> _Chat:
    """Phase 1: everything that can refuse a chat completion before the frontend sees it."""
    req = await ctx.read_body(request, oai.ChatCompletionRequest)
    engine = ctx.engine_for(req.model)
    req.check_unsupported()
    if getattr(engine, "tokenizer", None) is None:
        raise InvalidRequestError("this model has no tokenizer; use /v1/completions with token ids")
    tools = tool_calls.plan(req, engine.tokenizer, ctx.config.tool_call_parser)
    prompt_ids = _chat_prompt_ids(engine, req, tools)
    defaults = ctx.model_defaults(engine)
    max_tokens = req.max_output_tokens()
    if max_tokens is None:  # the model's max_new_tokens, else the server's default, within the context
        room = engine.max_context_tokens - len(prompt_ids)
        default = getattr(defaults, "max_new_tokens", None) or ctx.config.default_chat_max_tokens
        max_tokens = max(1, min(default, room))
    params = req.sampling_params(max_tokens, _sampling_defaults(defaults))
    if tools.constraint is not None:
        if params.structured is not None:
            raise InvalidRequestError(
                "tool_choice required or a named function cannot be combined with an output constraint"
            )
        params = dataclasses.replace(params, structured=tools.constraint)
    return _play_role(ctx, _Chat(req, engine, prompt_ids, params, tools, ctx.frontend.lora_name(req.model)))


_Job = TypeVar("_Job", _Completion, _Chat)


def _handoff(job: _Completion | _Chat, index: int = 0) -> Handoff | None:
    """Prompt ``index``'s part in a disaggregated request (None: served as usual)."""
    return job.handoffs[index] if index < len(job.handoffs) else None


def _play_role(ctx: HttpContext, job: _Job) -> _Job:
    """This replica's part in a disaggregated request (one carrying a ``bootstrap_room``): a
    prefill replica runs the prompt and one token, a decode replica waits for the prompt's pages."""
    prompts = len(job.prompts) if isinstance(job, _Completion) else 1
    job.handoffs = [handoff_for(ctx.config.role, job.req, i) for i in range(prompts)]
    if any(h is not None and h.role == "prefill" for h in job.handoffs):
        job.params = ctx.frontend.play_prefill(job.params)
    return job


@router.post("/v1/chat/completions", dependencies=INFERENCE_AUTH)
async def chat_completions(request: Request) -> Response:
    ctx = http_context(request)
    try:
        job = await _read_chat(ctx, request)
    except Exception as exc:  # noqa: BLE001 - every refusal becomes its HTTP error
        return ctx.refuse(request, exc)
    req = job.req
    rid = oai.new_id("chatcmpl")
    try:
        streams = ctx.frontend.stream_choices(
            job.prompt_ids,
            job.params,
            req.num_choices,
            api="http",
            cache_salt=req.cache_salt,
            request_id=req.request_id,
            lora_name=job.lora_name,
            handoff=_handoff(job),
        )
        if req.stream:
            return await _stream_chat(ctx, request, job, streams, rid)
        results = await until_disconnect(request, collect_all(streams))
    except Exception as exc:  # noqa: BLE001 - every failure becomes its HTTP error
        return map_error(exc).response()
    return JSONResponse(_chat_body(job, results, rid, job.model))


def _chat_message(text: str, finish: str, fmt: Any) -> tuple[dict[str, Any], str]:
    """A choice's assistant message and finish reason: its tool calls parsed out when the
    request offered tools (``tool_calls`` then finishes a choice that stopped)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if fmt is not None:
        content, calls = fmt.parse(text)
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in calls]}
            finish = "tool_calls" if finish == "stop" else finish
    return message, finish


def _chat_body(job: _Chat, results: list[ChoiceTotals], rid: str, model: str) -> dict:
    """The response to a non-streamed chat completion; usage counts the prompt once."""
    req, decode = job.req, _decoder(job.engine)
    body = oai.chat_response(rid, model, "".join(results[0].text), results[0].finish_reason, results[0].usage())
    choices = []
    for i, r in enumerate(results):
        message, finish = _chat_message("".join(r.text), r.finish_reason, job.tools.fmt)
        logprobs = olp.chat_logprobs(r.logprobs, decode, req.top_logprobs or 0) if req.logprobs else None
        choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs})
    body["choices"] = choices
    body["usage"] = oai.usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results), results[0].cached)
    return body


def _indexed(event: dict, index: int) -> dict:
    event["choices"][0]["index"] = index
    return event


async def _stream_chat(
    ctx: HttpContext, request: Request, job: _Chat, streams: list[ChunkStream], rid: str
) -> Response:
    req = job.req
    chunks = merged(streams)
    first = await until_disconnect(request, first_item(chunks))
    model, created = job.model, int(time.time())
    decode = _decoder(job.engine)
    fmt = job.tools.fmt
    calls = [tool_calls.CallStream(fmt) for _ in streams] if fmt is not None else None

    def on_chunk(index: int, chunk: StreamChunk) -> list[dict]:
        out = []
        text = chunk.text
        deltas: list[dict] = []
        if calls is not None:  # content outside tool calls streams; each call goes out once complete
            text, deltas = calls[index].push(chunk.text, final=chunk.finished)
        if text or chunk.logprobs:
            event = oai.chat_chunk(rid, model, {"content": text}, None, created)
            logprobs = olp.chat_logprobs(chunk.logprobs or [], decode, req.top_logprobs or 0) if req.logprobs else None
            event["choices"][0].update(index=index, logprobs=logprobs)
            out.append(event)
        if deltas:
            out.append(_indexed(oai.chat_chunk(rid, model, {"tool_calls": deltas}, None, created), index))
        if chunk.finished:
            finish = chunk.finish_reason or "stop"
            if calls is not None and calls[index].call_count and finish == "stop":
                finish = "tool_calls"
            out.append(_indexed(oai.chat_chunk(rid, model, {}, finish, created), index))
        return out

    opening = [
        _indexed(oai.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, created), i)
        for i in range(len(streams))
    ]
    usage = _usage_chunk(req, rid, model, "chat.completion.chunk", created)
    return sse_response(chunks, first, opening, on_chunk, usage, continuous_usage=req.continuous_usage)


# ---- /v1/models --------------------------------------------------------------------
@router.get("/v1/models", dependencies=INFERENCE_AUTH)
async def models(request: Request) -> JSONResponse:
    frontend = http_context(request).frontend
    engine = frontend.engine_or_none
    base = frontend.model_name
    entry: dict[str, Any] = {"id": base, "object": "model", "created": 0, "owned_by": "strata-jax"}
    if engine is None:
        return JSONResponse({"object": "list", "data": []})
    entry["max_model_len"] = engine.max_context_tokens
    data = [entry]
    adapters = getattr(engine, "adapters", None)
    for loaded in adapters.listing() if adapters is not None else []:  # vLLM's shape: root = path, parent = base
        data.append(
            entry
            | {"id": loaded.adapter.name, "root": loaded.adapter.path, "parent": base, "lora_identity": loaded.identity}
        )
    return JSONResponse({"object": "list", "data": data})


# ---- LoRA adapters at run time (vLLM's routes and bodies) ------------------------------
@router.post("/v1/load_lora_adapter", dependencies=ADMIN_AUTH)
async def load_lora_adapter(request: Request) -> Response:
    """``{"lora_name": ..., "lora_path": ...}``: load a PEFT adapter folder (400 when refused)."""
    ctx = http_context(request)
    try:
        body = await ctx.read_body(request, oai.LoadLoraAdapterRequest)
        engine = ctx.frontend.engine()
        if body.lora_name == ctx.frontend.model_name:  # it would be shadowed: `model` = this name is the base
            raise InvalidRequestError(f"{body.lora_name!r} is the served model's name; give the adapter another")
        loader = getattr(engine, "load_lora_adapter", None)
        if loader is None:
            raise InvalidRequestError("this engine does not serve LoRA adapters")
        await asyncio.to_thread(loader, body.lora_name, body.lora_path)  # reads the folder off the event loop
    except Exception as exc:  # noqa: BLE001 - every refusal becomes its HTTP error
        return map_error(exc).response()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=ADMIN_AUTH)
async def unload_lora_adapter(request: Request) -> Response:
    """``{"lora_name": ...}``: unload an adapter; 409 while requests under it run (never waits)."""
    ctx = http_context(request)
    try:
        body = await ctx.read_body(request, oai.UnloadLoraAdapterRequest)
        engine = ctx.frontend.engine()
        unloader = getattr(engine, "unload_lora_adapter", None)
        if unloader is None:
            raise InvalidRequestError("this engine does not serve LoRA adapters")
        await asyncio.to_thread(unloader, body.lora_name)
    except Exception as exc:  # noqa: BLE001 - every refusal becomes its HTTP error
        return map_error(exc).response()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
