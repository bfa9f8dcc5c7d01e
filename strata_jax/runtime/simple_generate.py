"""A plain single-sequence generation loop over the ModelRunner (no engine, no cache).

Used by tests and as the reference path the engine must agree with.
"""

from __future__ import annotations

import hashlib

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.runtime.model_runner import ModelRunner, SeqInput


def request_rng_key(seed: int | None, request_id: str, step: int) -> tuple[int, int]:
    """A per-request, per-step raw PRNG key (two uint32 words)."""
    material = f"{seed if seed is not None else request_id}:{step}".encode()
    digest = hashlib.sha256(material).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def generate_one(
    runner: ModelRunner,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...] = (),
    request_id: str = "simple",
) -> list[int]:
    """Generate for one prompt using pages 0..n of the runner's pool (prefill in chunks, then decode)."""
    page_size = runner.config.page_size
    limit = runner.config.max_context_tokens
    if not prompt_ids:
        raise InvalidRequestError("prompt is empty")
    if len(prompt_ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {limit} tokens"
        )
    pages_needed = -(-(len(prompt_ids) + params.max_tokens) // page_size)
    if pages_needed > runner.config.num_device_pages:
        raise InvalidRequestError(f"needs {pages_needed} KV pages, the pool has {runner.config.num_device_pages}")
    pages = list(range(pages_needed))
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    chunk = runner.config.max_batch_tokens
    out: list[int] = []
    pos = 0
    while pos < len(prompt_ids):
        piece = prompt_ids[pos : pos + chunk]
        result = runner.step([_seq(piece, pos, pages, params, request_id, 0)])
        pos += len(piece)
    token = int(result.next_tokens[0])
    while True:
        out.append(token)
        if token in stops or len(out) >= params.max_tokens:
            return out
        result = runner.step([_seq([token], pos, pages, params, request_id, len(out))])
        pos += 1
        token = int(result.next_tokens[0])


def _seq(tokens: list[int], start: int, pages: list[int], params: SamplingParams, rid: str, step: int) -> SeqInput:
    return SeqInput(
        token_ids=tokens,
        start_pos=start,
        page_ids=pages,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        rng_key=request_rng_key(params.seed, rid, step),
    )
