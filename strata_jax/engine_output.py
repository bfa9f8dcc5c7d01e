"""Tokens out: stop rules, incremental text, stream chunks (pure Python).

``append_token(t, token, ...)`` records one sampled token of a live request and
returns the ``StreamChunk`` to deliver; ``chunk.finished`` says whether a stop
rule (stop token, EOS unless ignored, ``max_tokens``, the context limit, a stop
string) ended the request.  Text that could still turn into a stop string is held
back until it cannot.
"""

from __future__ import annotations

from collections.abc import Collection

from strata_jax.api import RequestOutput, StreamChunk
from strata_jax.engine_requests import TrackedRequest


def append_token(
    t: TrackedRequest, token: int, *, eos_token_ids: Collection[int], max_context_tokens: int, now: float
) -> StreamChunk:
    t.output_ids.append(token)
    if t.first_token_at is None:
        t.first_token_at = now
    p = t.params
    finish: str | None = None
    if len(t.output_ids) < p.min_tokens:
        pass  # below min_tokens no stop rule ends the request (EOS/stop ids are masked on device too)
    elif token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        finish = "stop"
    if finish is None and (len(t.output_ids) >= p.max_tokens or len(t.prompt_ids) + len(t.output_ids) >= max_context_tokens):
        finish = "length"
    delta = t.detok.push([token]) if t.detok is not None else ""
    if finish is not None and t.detok is not None:
        delta += t.detok.flush()
    if p.stop and t.detok is not None and len(t.output_ids) >= p.min_tokens:
        full = t.text + delta
        hit = find_stop(full, p.stop, len(t.text))
        if hit is not None:
            delta = full[len(t.text) : hit]
            finish = "stop"
        else:
            # hold back a tail that could still become a stop string
            hold = stop_prefix_len(full, p.stop)
            if finish is None and hold:
                delta = full[len(t.text) : len(full) - hold]
            elif finish is not None:
                delta = full[len(t.text) :]
    t.text += delta
    new_ids = t.output_ids[t.emitted_tokens :]
    t.emitted_tokens = len(t.output_ids)
    return StreamChunk(
        request_id=t.request_id,
        token_ids=new_ids,
        text=delta,
        finished=finish is not None,
        finish_reason=finish,
        prompt_tokens=len(t.prompt_ids),
        completion_tokens=len(t.output_ids),
        cached_tokens=dict(t.cached),
    )


def finish_without_token(t: TrackedRequest, *, now: float) -> StreamChunk:
    """The end of a ``max_tokens=0`` request (prompt scoring): no token, finish ``length``."""
    t.first_token_at = now
    return StreamChunk(
        request_id=t.request_id,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="length",
        prompt_tokens=len(t.prompt_ids),
        completion_tokens=0,
        cached_tokens=dict(t.cached),
    )


def collect(rid: str, chunks: list[StreamChunk]) -> RequestOutput:
    """One request's chunks as a ``RequestOutput``."""
    last = chunks[-1]
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])] if any(c.logprobs for c in chunks) else None
    prompt_logprobs = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=[],
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finish_reason=last.finish_reason or "abort",
        cached_tokens=dict(last.cached_tokens),
        ttft_s=getattr(last, "ttft_s", 0.0),
        latency_s=getattr(last, "latency_s", 0.0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts (searching where it could newly appear)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
