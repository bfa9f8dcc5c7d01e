"""A small stand-in for ``strata_jax.engine.Engine`` that honours its contract.

Used by the serving tests only where the real engine is not importable.  It keeps
honest page accounting (pages allocated on admission, freed on finish or abort)
and a count of locked tree nodes, so leak checks mean the same thing as with the
real engine.  Tokens are bytes: id = byte value + 3 (0..2 are pad/bos/eos).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jax

from strata_jax.api import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    StreamChunk,
    empty_tier_counts,
    validate_request,
)

_OFFSET = 3
EOS_ID = 2


class ByteTokenizer:
    """Bytes as tokens; enough for tests."""

    vocab_size = 256 + _OFFSET
    eos_token_id = EOS_ID

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + _OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **_: object) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


@dataclass
class FakeEngineConfig:
    """Knobs of the fake engine."""

    model: str = "tiny"
    max_context_tokens: int = 512
    page_size: int = 16
    total_pages: int = 4096
    max_waiting: int = 64
    max_running: int = 32
    step_s: float = 0.002


class _Req:
    def __init__(self, rid: str, ids: list[int], params: SamplingParams, loop, queue) -> None:
        self.rid = rid
        self.ids = ids
        self.params = params
        self.loop = loop
        self.queue = queue
        self.out: list[int] = []
        self.pages = 0
        self.aborted = False
        self.t0 = time.perf_counter()


class FakeEngine:
    """Thread-backed fake engine: a step loop on its own thread, async streams."""

    def __init__(self, config: FakeEngineConfig | None = None) -> None:
        self.config = config or FakeEngineConfig()
        self.model_name = self.config.model
        self.max_context_tokens = self.config.max_context_tokens
        self.tokenizer = ByteTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self._lock = threading.Lock()
        self._waiting: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}
        self._used_pages = 0
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._hits = 0
        self._prefixes: set[tuple[int, ...]] = set()
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()
        self.is_ready = True

    # ---- requests -------------------------------------------------------
    def _validate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[list[int], SamplingParams]:
        """The real engine's checks (``strata_jax.api.validate_request``), with its limits."""
        limits = RequestLimits(vocab_size=self.vocab_size, max_context_tokens=self.max_context_tokens)
        valid = validate_request(
            prompt, params, limits, request_id=request_id, cache_salt=cache_salt, tokenizer=self.tokenizer
        )
        return valid.prompt_ids, valid.params

    def _submit(self, ids, params, request_id, loop, queue) -> _Req:
        with self._lock:
            if not self._accepting:
                raise EngineUnavailableError("engine is shutting down")
            if len(self._waiting) >= self.config.max_waiting:
                raise OverloadedError(f"waiting queue is full ({self.config.max_waiting} requests)")
            rid = request_id or f"req-{next(self._ids)}"
            req = _Req(rid, ids, params, loop, queue)
            self._waiting.append(req)
        self._wake.set()
        return req

    async def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        follows: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """As ``Engine.stream``; ``follows`` (another choice of the same prompt) is accepted
        and needs no waiting here: the fake has no prefill to share.  It holds no LoRA
        adapters (the faces refuse other model names before they get here)."""
        if lora_name is not None:
            raise InvalidRequestError(f"the fake engine has no LoRA adapter {lora_name!r}")
        ids, params = self._validate(prompt, params, request_id, cache_salt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = self._submit(ids, params, request_id, loop, queue)
        try:
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            self.abort(req.rid)

    def generate(self, prompts, params=None, cache_salt=None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)

        async def one(p):
            toks, text, reason, t0, ttft = [], "", "abort", time.perf_counter(), 0.0
            ids = self._validate(p, params)[0]
            async for c in self.stream(p, params, cache_salt=cache_salt):
                ttft = ttft or time.perf_counter() - t0
                toks += c.token_ids
                text += c.text
                reason = c.finish_reason or reason
            return RequestOutput("", ids, toks, text, reason, ttft_s=ttft, latency_s=time.perf_counter() - t0)

        async def run():
            return await asyncio.gather(*(one(p) for p in batch))

        return asyncio.run(run())

    def abort(self, request_id: str) -> bool:
        with self._lock:
            for r in list(self._waiting):
                if r.rid == request_id:
                    self._waiting.remove(r)
                    return True
            req = self._running.pop(request_id, None)
            if req is None:
                return False
            self._used_pages -= req.pages
            return True

    # ---- step loop -----------------------------------------------------
    def _emit(self, req: _Req, chunk: StreamChunk) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, chunk)
        except RuntimeError:  # loop closed: the client is gone
            self.abort(req.rid)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._waiting and not self._running
            if idle:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with jax.profiler.TraceAnnotation("schedule"):
                admitted = []
                with self._lock:
                    while self._waiting and len(self._running) < self.config.max_running:
                        req = self._waiting.popleft()
                        total = len(req.ids) + req.params.max_tokens
                        req.pages = math.ceil(min(total, self.max_context_tokens) / self.config.page_size)
                        self._used_pages += req.pages
                        self._running[req.rid] = req
                        admitted.append(req)
            with jax.profiler.TraceAnnotation("extend"):
                for req in admitted:
                    key = tuple(req.ids[: self.config.page_size])
                    hit = self.config.page_size if key in self._prefixes and len(req.ids) > len(key) else 0
                    self._prefixes.add(key)
                    self._hits += hit
                    req.hit = hit
            with jax.profiler.TraceAnnotation("decode"):
                time.sleep(self.config.step_s)
                with self._lock:
                    running = list(self._running.values())
                for req in running:
                    tok = _OFFSET + ord("a") + (len(req.out) + len(req.ids)) % 26
                    req.out.append(tok)
                    stop = tok in req.params.stop_token_ids
                    done = stop or len(req.out) >= req.params.max_tokens
                    done = done or len(req.ids) + len(req.out) >= self.max_context_tokens
                    chunk = StreamChunk(
                        request_id=req.rid,
                        token_ids=[tok],
                        text=self.tokenizer.decode([tok]),
                        finished=done,
                        finish_reason=("stop" if stop else "length") if done else None,
                        prompt_tokens=len(req.ids),
                        completion_tokens=len(req.out),
                        cached_tokens={"device": getattr(req, "hit", 0), "host": 0, "storage": 0},
                    )
                    if done:
                        with self._lock:
                            if self._running.pop(req.rid, None) is not None:
                                self._used_pages -= req.pages
                    self._emit(req, chunk)
            with jax.profiler.TraceAnnotation("postprocess"):
                pass

    # ---- admin ---------------------------------------------------------
    def check_accounting(self) -> dict:
        with self._lock:
            return {
                "device_used_pages": self._used_pages,
                "locked_nodes": len(self._running),
                "live_requests": len(self._running),
            }

    def cache_stats(self) -> dict:
        with self._lock:
            return {
                "device_pool": {"used_pages": self._used_pages, "total_pages": self.config.total_pages},
                "host_pool": {"used_pages": 0, "total_pages": 0},
                "locked_nodes": len(self._running),
                "hit_tokens": {**empty_tier_counts(), "device": self._hits},
                "evictions": empty_tier_counts(),
                "transfers": {
                    "loaded_pages": 0,
                    "backed_up_pages": 0,
                    "prefetched_pages": 0,
                    "page_bytes": 4096,
                    "link_bandwidth_bytes_per_s": 16e9,
                },
                "compiles": 3,
                "waiting": len(self._waiting),
                "running": len(self._running),
            }

    def flush_cache(self, tier: str = "all", lora_name: str | None = None) -> None:
        if lora_name is not None:
            raise InvalidRequestError(f"the fake engine has no LoRA adapter {lora_name!r}")
        if tier not in ("all", "device", "host", "storage"):
            raise InvalidRequestError(f"unknown tier {tier!r}")
        self._prefixes.clear()

    def start_profile(self, log_dir: str) -> None:
        self._profile_dir = log_dir
        jax.profiler.start_trace(log_dir)

    def stop_profile(self) -> str:
        jax.profiler.stop_trace()
        return self._profile_dir

    def shutdown(self, grace_s: float = 10.0) -> None:
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._waiting and not self._running:
                    break
            time.sleep(0.01)
        with self._lock:
            leftover = list(self._waiting) + list(self._running.values())
        for req in leftover:
            self.abort(req.rid)
            self._emit(req, StreamChunk(req.rid, [], "", True, "abort", len(req.ids), len(req.out)))
        self._stop.set()
        self._thread.join(timeout=5)
