"""What ``Engine.cache_stats`` and ``Engine.check_accounting`` report (run on the engine thread)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_jax.engine.core import EngineCore
    from strata_jax.engine.engine import Engine


def accounting(core: EngineCore) -> dict[str, int]:
    """Assert the cache invariants and exact page accounting; returns usage figures."""
    ctl = core.ctl
    ctl.drain()  # backups in flight hold locks until they land
    live = core.live_requests.values()
    held = [p for t in live for p in t.page_table[t.shared_pages :]]
    ctl.check(device_held=held)
    return {
        "device_used_pages": ctl.device_alloc.num_used,
        "device_request_pages": len(held),
        "host_used_pages": ctl.host_alloc.num_used,
        "locked_nodes": core.locked_nodes(),
        "transient_nodes": sum(1 for n in ctl.tree.iter_nodes() if n.is_transient),
        "live_requests": len(core.live_requests),
    }


def cache_stats(engine: Engine) -> dict[str, Any]:
    core, ctl, runner = engine.core, engine.ctl, engine.runner
    s = core.scheduler.stats()
    c = ctl.stats()
    device = engine.executor.device
    held = {str(t.request_id): ctl.device_kv_bytes(t.request_id, t.page_table) for t in core.live_requests.values()}
    transfer_compiles = ctl.device_pool.compile_count if ctl.device_pool is not None else 0
    return {
        "device_pool": {
            "used_pages": c["device_pages"] - c["device_free_pages"],
            "total_pages": c["device_pages"],
            "page_size": engine.page_size,
        },
        "host_pool": {"used_pages": c["host_pages"] - c["host_free_pages"], "total_pages": c["host_pages"]},
        "locked_nodes": core.locked_nodes(),
        # L1 KV bytes the running requests hold (with layer groups: only their windows' local layers);
        # per request as a list, so /metrics exports the sum and not one series per request
        "running_device_kv_bytes": sum(held.values()),
        "running_device_kv_bytes_by_request": [{"request_id": r, "bytes": b} for r, b in held.items()],
        "hit_tokens": dict(s.hit_tokens),
        "recomputed_tokens": s.recomputed_prompt_tokens,
        "load_or_recompute": {"requests": s.load_or_recompute_recomputed, "tokens": s.load_or_recompute_tokens},
        "evictions": {"device": c["evicted_device_pages"], "host": c["evicted_host_pages"]},
        "transfers": {
            "loaded_pages": c["loaded_pages"],
            "backed_up_pages": c["backed_up_pages"],
            "storage_written_pages": c["storage_written_pages"],
            "prefetched_pages": c["prefetched_pages"],
            "storage_errors": c["storage_errors"],
            "page_bytes": ctl.page_bytes,
            "link_bandwidth_bytes_per_s": c["link_bandwidth_bytes_per_s"],
        },
        "storage": c.get("storage"),
        "compiles": runner.compile_count,
        "compiles_after_warmup": runner.compile_count - engine.compiles_at_warmup,
        "startup_xla": engine.startup_compiles.as_dict(),
        "startup_executables_reused": engine.executables_reused,
        "transfer_compiles_after_warmup": transfer_compiles - engine.transfer_compiles_at_warmup,
        "waiting": core.scheduler.num_waiting,
        "running": core.scheduler.num_running,
        "deferrals": s.deferrals,
        "prefetch": {
            "waits": s.prefetch_waits,
            "wait_rounds": s.prefetch_wait_rounds,
            "not_waited": s.prefetch_not_waited,
        },
        "retractions": s.retractions,
        "device_dispatches": device.dispatches,
        "device_idle_dispatches": device.idle_dispatches,
        "device_idle_s": device.idle_s,
        **core.counters,
        **({"kv_events": engine.kv_event_publisher.stats()} if engine.kv_event_publisher is not None else {}),
        **({"speculation": speculation_stats(core)} if core.speculator is not None else {}),
    }


def speculation_stats(core: EngineCore) -> dict[str, Any]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens, accepted per
    proposal position) and what the cost decision did (rows that stepped aside)."""
    spec = core.speculator
    assert spec is not None
    c = spec.counters
    return {
        "drafts": c.drafts,
        "draft_tokens": c.draft_tokens,
        "accepted_tokens": c.accepted_tokens,
        "accepted_per_position": list(c.accepted_per_position),
        "mean_accepted_length": c.mean_accepted_length,
        "stepped_aside": spec.stepped_aside,
        "break_even_accepted_tokens": spec.break_even(),
    }
