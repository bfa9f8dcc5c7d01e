"""``SchedulerConfig``: every knob of the control plane, validated once.

The defaults give reasonable throughput without tuning; each Strata stage can be
switched off on its own for ablation (``enable_*`` flags).  The ``fifo`` policy
ignores the stage flags (it is the no-stage baseline).
"""

from __future__ import annotations

from dataclasses import dataclass


class SchedulerConfigError(ValueError):
    """A ``SchedulerConfig`` field is out of range (raised at construction)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Control-plane configuration.

    policy: scheduler policy by name, ``"strata"`` (default) or ``"fifo"``
        (see ``strata_jax.scheduler.policy.available_policies()``).
    max_batch_tokens: new (computed) tokens per prefill step; a prompt longer than
        what is left of this budget is chunked over several steps.
    max_prefill_batch_size: requests in one prefill (extend) batch.
    max_decode_batch_size: requests in one decode batch (more decodes rotate).
    max_running_requests: requests running (prefilling or decoding) at once; a queued
        request starts only while fewer run (None: no cap; the engine sets it to the
        rows of per-sequence state its device holds).
    max_waiting: bound of the waiting queue (waiting + deferred requests, retracted
        ones excluded); ``submit`` beyond it raises ``OverloadedError``.
    enable_delay_hit: Strata stage 1, defer a request that matches another
        earlier request's not-yet-computed (transient) prefix.
    delay_hit_threshold: transient tokens a match must exceed to be deferred.
    enable_balanced_batch: Strata stage 2, Algorithm 1 (set aside loading-bound
        requests, pull bundle hits, in-order backfill).  Off: in-order filling.
    loading_bound_ratio: None (default) compares estimated load time with
        estimated compute time from the online ``CostModel``; a float fixes the
        predicate to ``load_tokens / computed_tokens > ratio`` (Strata's profiled
        constant, about 100 on H200).
    enable_bubble_filling: Strata stage 3, run the decode batch before a prefill
        batch whose KV load has not landed and outlasts a decode step.
    enable_load_or_recompute: a stage beyond the paper (off by default, like
        Strata, which always loads): a request whose cached prefix would be
        loaded from L2/L3 recomputes it instead when the estimated load time
        (bytes over the measured link/storage bandwidth plus
        ``CostPrior.transfer_overhead_s``) exceeds the estimated time to recompute
        it (the fitted extend model).  Counted in ``SchedulerStats``.
    wait_for_prefetch: hold a request back while its L3 prefetch is in flight and the
        cost model estimates the rest lands sooner than recomputing it would take (the
        storage read rate measured on the prefetches so far vs the fitted extend
        model), for at most that recompute estimate; then start it with what landed.
        The engine sets it for ``prefetch_policy="cost"`` (its default).
    max_lookahead: queued requests examined (prefix-matched) per round, from the
        head; bounds the cost of one round under a long queue (bundle hits
        further back are found once they move up).
    short_prefill_tokens: a queued request that loads nothing (its prefix, if any, is
        on the device) and computes at most this many tokens goes ahead of the rest of
        the queue: the continuing chunks of long prompts leave its tokens in the step's
        budget (a question about a document another request just prefilled, a chat turn
        whose history is cached, a short prompt).  Together they take at most half of
        ``max_batch_tokens``, and the continuing chunks keep a batch slot each and the
        first claim on device pages, so a long prompt still advances every step.  0
        turns it off (continuing chunks first, then the queue).
    enable_mixed_steps: a step with both prompt chunks and decode rows runs them as one
        program (each decode row a one-token row of the extend) instead of an extend and a
        decode, when the cost model's fitted times say one costs less than the two; the
        prefill's token budget leaves a token per decode row (at most a quarter of it) so
        the rows fit the chunk's program.  Saves the decode program's fixed cost (reading
        every weight once more) on each step a prompt is prefilling; vLLM's chunked prefill
        and SGLang's ``--enable-mixed-chunk`` do the same.
    """

    policy: str = "strata"
    max_batch_tokens: int = 8192
    max_prefill_batch_size: int = 64
    max_decode_batch_size: int = 256
    max_waiting: int = 4096
    max_running_requests: int | None = None
    enable_delay_hit: bool = True
    delay_hit_threshold: int = 100
    enable_balanced_batch: bool = True
    loading_bound_ratio: float | None = None
    enable_bubble_filling: bool = True
    enable_load_or_recompute: bool = False
    max_lookahead: int = 1024
    short_prefill_tokens: int = 64
    wait_for_prefetch: bool = False
    enable_mixed_steps: bool = False

    def __post_init__(self) -> None:
        from strata_jax.scheduler.policy import available_policies  # no cycle at import time

        if self.policy not in available_policies():
            raise SchedulerConfigError(
                f"unknown scheduler policy {self.policy!r}; choose one of {', '.join(available_policies())}"
            )
        for name in (
            "max_batch_tokens",
            "max_prefill_batch_size",
            "max_decode_batch_size",
            "max_waiting",
            "max_lookahead",
        ):
            _positive_int(name, getattr(self, name))
        _non_negative_int("delay_hit_threshold", self.delay_hit_threshold)
        _non_negative_int("short_prefill_tokens", self.short_prefill_tokens)
        if self.max_running_requests is not None:
            _positive_int("max_running_requests", self.max_running_requests)
        if self.loading_bound_ratio is not None:
            r = self.loading_bound_ratio
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 or r != r or r == float("inf"):
                raise SchedulerConfigError(f"loading_bound_ratio must be a positive finite number or None, got {r!r}")
        for name in (
            "enable_delay_hit",
            "enable_balanced_batch",
            "enable_bubble_filling",
            "enable_load_or_recompute",
            "wait_for_prefetch",
            "enable_mixed_steps",
        ):
            if not isinstance(getattr(self, name), bool):
                raise SchedulerConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SchedulerConfigError(f"{name} must be a positive integer, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchedulerConfigError(f"{name} must be a non-negative integer, got {value!r}")
