"""The prefill chunk from measured step costs (``EngineConfig.prefill_chunk = "auto"``).

At warm-up the engine times one prefill step per compiled extend bucket
(``ModelRunner.time_extend_buckets``: a sequence of exactly the bucket's tokens on top
of as many cached tokens as the largest bucket, on pages nothing holds yet) and hands
the seconds here.  The chunk is the
smallest bucket whose time per token is within ``tolerance`` of the cheapest bucket's:

* a longer chunk than that buys at most ``tolerance`` per token while it lengthens
  every step a running decode waits behind (and the TTFT of requests queued behind it);
* a bucket that costs *more* per token than a smaller one is never chosen over it, so
  the chunk the scheduler fills is never slower per token than a shorter one would be.

Pure Python (no jax): the measuring lives in the runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.10


@dataclass(frozen=True)
class BucketTimings:
    """Measured prefill steps: ``seconds[tokens]`` for a step of that many new tokens on
    top of ``context_tokens`` cached ones."""

    context_tokens: int
    seconds: Mapping[int, float]


def per_token_seconds(step_seconds: Mapping[int, float]) -> dict[int, float]:
    """Seconds per token of each measured bucket (``{tokens: step seconds}``)."""
    return {tokens: seconds / tokens for tokens, seconds in step_seconds.items()}


def choose_prefill_chunk(step_seconds: Mapping[int, float], tolerance: float = DEFAULT_TOLERANCE) -> int:
    """The smallest bucket whose per-token step time is within ``tolerance`` of the best."""
    if not step_seconds:
        raise ValueError("no extend bucket was measured")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    for tokens, seconds in step_seconds.items():
        if tokens <= 0 or not seconds > 0:
            raise ValueError(f"bad measurement: {tokens} tokens in {seconds} s")
    per_token = per_token_seconds(step_seconds)
    best = min(per_token.values())
    return min(tokens for tokens, cost in per_token.items() if cost <= best * (1.0 + tolerance))


def describe(step_seconds: Mapping[int, float], chosen: int) -> str:
    """One log line: every bucket's ms per token, the chosen one marked."""
    per_token = per_token_seconds(step_seconds)
    parts = [
        f"{tokens}: {1e3 * cost:.3f}{' (chosen)' if tokens == chosen else ''}"
        for tokens, cost in sorted(per_token.items())
    ]
    return "prefill chunk from measured steps, ms per token by bucket: " + ", ".join(parts)
