"""Prometheus metrics of the serving faces and of the engine's cache.

Request-level metrics (counts, TTFT, inter-token latency, tokens) are recorded by
``serving.frontend`` as requests flow.  Engine/cache metrics (queue depth, pool
occupancy, hit tokens and evictions per tier, transfer bytes and bandwidth,
compiles) are read from ``engine.cache_stats()`` at scrape time by
``EngineStatsCollector``, so they can never drift from the engine's own numbers.
Everything lives in one ``CollectorRegistry`` owned by the server (no globals).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeGuard

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "strata"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Keys of cache_stats() whose numbers only ever grow (exported as counters).
_CUMULATIVE = re.compile(
    r"(hit_tokens|evictions|compiles|compiles_after_warmup|recomputed_tokens|deferrals|retractions"
    r"|steps|prefill_steps|decode_steps|finished|aborted|failed|kv_events_\w+_total|prefetch_(waits|wait_rounds|not_waited)"
    r"|speculation_(drafts|draft_tokens|accepted_tokens|stepped_aside))"
    r"|transfers?_\w+_pages|\w+_bytes_total|(loaded|backed_up|written|prefetched)_bytes"
)
_RATES = ("per_s", "gbps", "bandwidth")
# Why a request was refused (``strata_requests_rejected_total{reason=...}``).
REJECT_REASONS = (
    "invalid_request",  # 400 / INVALID_ARGUMENT: a malformed or unsupported request
    "too_long",  # 400 / INVALID_ARGUMENT: prompt + max_tokens exceed the context
    "not_found",  # 404: unknown model name
    "unauthorized",  # 401 / UNAUTHENTICATED: missing or wrong API key; 403 / PERMISSION_DENIED: the other scope's key
    "body_too_large",  # 413 / RESOURCE_EXHAUSTED on message size
    "overloaded",  # 429 / RESOURCE_EXHAUSTED: the waiting queue is full
    "unavailable",  # 503 / UNAVAILABLE: warming up, failed or shutting down
)


def is_cumulative(name: str) -> bool:
    """Whether the flattened ``cache_stats()`` key ``name`` is a running total."""
    return bool(_CUMULATIVE.fullmatch(name)) and not name.endswith(_RATES)


def transfer_bytes(stats: Mapping[str, object]) -> dict[str, float]:
    """Bytes moved per transfer kind, from the engine's page counts x ``page_bytes``."""
    transfers = stats.get("transfers")
    if not isinstance(transfers, Mapping) or not _is_number(transfers.get("page_bytes")):
        return {}
    page_bytes = float(transfers["page_bytes"])
    out = {}
    for key, value in transfers.items():
        if str(key).endswith("_pages") and _is_number(value):
            out[str(key)[: -len("_pages")]] = float(value) * page_bytes
    return out


_TIERS = frozenset({"device", "host", "storage"})


class StatsSource(Protocol):
    """What the metrics read of the engine: ``Engine.cache_stats``."""

    def cache_stats(self) -> dict: ...


class ServingMetrics:
    """Request-level metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by face and outcome, each counted once when it ends: stop / length (finished), abort "
            "(the engine gave up on it, e.g. shutdown), cancelled (the client went away), rejected (refused; "
            "see strata_requests_rejected_total for why), error (a server bug)",
            ["api", "status"],
            registry=registry,
        )
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected",
            "Refused requests by face and reason (invalid_request, too_long, not_found, unauthorized, "
            "body_too_large, overloaded, unavailable); each is also counted as strata_requests_total{status=rejected}",
            ["api", "reason"],
            registry=registry,
        )
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests being served", registry=registry)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=registry
        )
        self.inter_token = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            f"{PREFIX}_request_latency_seconds", "End-to-end request latency", buckets=_E2E_BUCKETS, registry=registry
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of requests that got a first token", registry=registry
        )
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "Tokens generated", registry=registry)
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_request_cached_tokens",
            "Prompt tokens served from the cache, by tier",
            ["tier"],
            registry=registry,
        )
        # per LoRA adapter (the base model's requests are not counted here); label = the adapter's name
        self.lora_requests = Counter(
            f"{PREFIX}_lora_requests",
            "Requests under a LoRA adapter, by adapter and outcome (as strata_requests_total)",
            ["adapter", "status"],
            registry=registry,
        )
        self.lora_prompt_tokens = Counter(
            f"{PREFIX}_lora_prompt_tokens",
            "Prompt tokens of requests under a LoRA adapter",
            ["adapter"],
            registry=registry,
        )
        self.lora_completion_tokens = Counter(
            f"{PREFIX}_lora_completion_tokens", "Tokens generated under a LoRA adapter", ["adapter"], registry=registry
        )
        # prefill/decode disaggregation (serving/disaggregation.py)
        self.pd_prefills = Counter(
            f"{PREFIX}_pd_prefills",
            "Prefill role: disaggregated requests whose prompt (and one token) this replica ran",
            registry=registry,
        )
        self.pd_handoffs = Counter(
            f"{PREFIX}_pd_handoffs",
            "Decode role: waits for a prompt's pages in L3, by how they ended (complete; stalled, prefill_lost or "
            "deadline: the rest of the prompt computed here; local: short enough to compute here without waiting)",
            ["outcome"],
            registry=registry,
        )
        self.pd_pages_received = Counter(
            f"{PREFIX}_pd_pages_received",
            "Decode role: pages of handed-over prompts that were in L3 when the wait ended",
            registry=registry,
        )
        self.pd_wait = Histogram(
            f"{PREFIX}_pd_handoff_wait_seconds",
            "Decode role: time a request waited for its prompt's pages",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.pd_handoff_to_first_token = Histogram(
            f"{PREFIX}_pd_handoff_to_first_token_seconds",
            "Decode role: from the last page of a prompt landing in L3 (the prefill's end, as seen here) to "
            "the request's first token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )

    def count_rejected(self, api: str, reason: str) -> None:
        """One refused request (``reason`` from ``REJECT_REASONS``)."""
        self.requests.labels(api, "rejected").inc()
        self.rejected.labels(api, reason).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_") or "value"


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten_stats(stats: Mapping[str, object], prefix: str = "") -> Iterable[tuple[str, str | None, float]]:
    """Yield ``(metric_name, tier_or_None, value)`` for every number in ``stats``.

    A dict keyed by tier names (``{"device": .., "host": .., "storage": ..}``)
    becomes one metric with a ``tier`` label; other nesting joins keys with ``_``.
    """
    for key, value in stats.items():
        name = f"{prefix}_{_sanitize(str(key))}" if prefix else _sanitize(str(key))
        if _is_number(value):
            yield name, None, float(value)
        elif isinstance(value, Mapping):
            if value and set(map(str, value)) <= _TIERS and all(_is_number(v) for v in value.values()):
                for tier, v in value.items():
                    yield name, str(tier), float(v)
            else:
                yield from flatten_stats(value, name)


class EngineStatsCollector(Collector):
    """Exports ``engine.cache_stats()`` at scrape time.

    ``get_engine`` returns the engine or ``None`` while it warms up (then nothing
    is exported).  Cumulative keys become counters, the rest gauges; names are
    ``strata_engine_<path>`` with a ``tier`` label for per-tier dicts.
    """

    def __init__(self, get_engine: Callable[[], StatsSource | None]) -> None:
        self._get_engine = get_engine

    def collect(self) -> Iterable[Metric]:
        engine = self._get_engine()
        if engine is None:
            return
        try:
            stats = engine.cache_stats()
        except Exception:  # a scrape must never take the server down
            log.exception("cache_stats() failed during a metrics scrape")
            return
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, tier, value in flatten_stats(stats):
            full = f"{PREFIX}_engine_{name}"
            cumulative = is_cumulative(name)
            if cumulative and full.endswith("_total"):
                full = full[: -len("_total")]
            family = families.get(full)
            if family is None:
                labels = ["tier"] if tier is not None else []
                doc = f"engine cache_stats {name}"
                family = (CounterMetricFamily if cumulative else GaugeMetricFamily)(full, doc, labels=labels)
                families[full] = family
            try:
                family.add_metric([tier] if tier is not None else [], value)
            except ValueError:  # same name both with and without a tier label: skip the odd one
                continue
        per_position = (stats.get("speculation") or {}).get("accepted_per_position")
        if isinstance(per_position, list):  # vLLM's spec_decode_num_accepted_tokens_per_pos
            family = CounterMetricFamily(
                f"{PREFIX}_engine_speculation_accepted_per_position",
                "Accepted proposed tokens by their position in the proposal (0 first)",
                labels=["position"],
            )
            for position, value in enumerate(per_position):
                family.add_metric([str(position)], float(value))
            families[family.name] = family
        moved = transfer_bytes(stats)
        if moved:
            family = CounterMetricFamily(
                f"{PREFIX}_engine_transfer_bytes", "KV bytes moved between tiers, by kind", labels=["kind"]
            )
            for kind, value in moved.items():
                family.add_metric([kind], value)
            families[family.name] = family
        yield from families.values()


def build_metrics(get_engine: Callable[[], StatsSource | None]) -> ServingMetrics:
    """A fresh registry holding the request metrics and the engine collector."""
    # No `<counter>_created` timestamp samples (a process-wide switch of prometheus_client, which vLLM
    # flips too): scrapers that do not know them, such as aiperf, read them as counter resets.
    disable_created_metrics()
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry)
    registry.register(EngineStatsCollector(get_engine))
    return metrics
