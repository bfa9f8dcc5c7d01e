"""Helpers of the serving tests: build an engine (real if available), run a server, check leaks."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from serving.config import ServerConfig
from serving.server import ThreadedServer


def real_engine_available() -> bool:
    if os.environ.get("STRATA_SERVING_FAKE"):
        return False
    try:
        from strata_jax.engine import Engine, EngineConfig  # noqa: F401
    except ImportError:
        return False
    return True


def fake_engine_factory(**overrides: Any) -> Callable[[], Any]:
    """The contract fake (for tests of the faces alone: auth, warm-up)."""
    from serving_fake_engine import FakeEngine, FakeEngineConfig

    return lambda: FakeEngine(FakeEngineConfig(**overrides))


def engine_factory(**overrides: Any) -> Callable[[], Any]:
    """A factory of the real tiny engine (fake one if the engine is not there yet).

    ``overrides`` use the fake's names (max_waiting, max_running, max_context_tokens,
    step_s); they are translated to the real ``EngineConfig``'s field paths.
    """
    if real_engine_available():
        from strata_jax.engine import Engine, EngineConfig

        from serving.server_cli import build_engine_config

        config = build_engine_config(EngineConfig, "tiny", _real_overrides(EngineConfig, overrides))
        return lambda: Engine(config)
    from serving_fake_engine import FakeEngine, FakeEngineConfig

    return lambda: FakeEngine(FakeEngineConfig(**overrides))


_REAL_NAMES = {
    "max_waiting": ("max_waiting",),
    "max_running": ("max_batch_size", "max_decode_batch_size", "max_running"),
    "max_context_tokens": ("max_context_tokens",),
    "step_s": (),
}


def _real_overrides(config_cls: type, overrides: dict[str, Any]) -> dict[str, Any]:
    from serving.server_cli import engine_flag_fields

    paths = [path for path, _f, _d in engine_flag_fields(config_cls)]
    out: dict[str, Any] = {"show_progress": False} if "show_progress" in paths else {}
    if "compilation_cache_dir" in paths:  # warm-ups after the first one hit the XLA cache
        import tempfile

        out["compilation_cache_dir"] = os.path.join(tempfile.gettempdir(), "strata_serving_tests_xla_cache")
    for key, value in overrides.items():
        for candidate in _REAL_NAMES.get(key, (key,)):
            match = [p for p in paths if p == candidate or p.endswith("." + candidate)]
            if match:
                out[match[0]] = value
                break
    return out


def start_server(**engine_overrides: Any) -> ThreadedServer:
    config = ServerConfig(port=0, grpc_port=0, max_body_bytes=1 << 20, grace_s=5.0)
    return ThreadedServer(config, engine_factory(**engine_overrides)).start()


def pool_baseline(engine: Any) -> tuple[int, int]:
    """(used device pages that no request holds, locked nodes) right now."""
    stats = engine.cache_stats()
    return stats["device_pool"]["used_pages"], stats["locked_nodes"]


def wait_idle(engine: Any, timeout: float = 30.0) -> dict:
    """Wait until no request is waiting or running and no tree node is locked; return the stats."""
    deadline = time.monotonic() + timeout
    stats = engine.cache_stats()
    while time.monotonic() < deadline:
        stats = engine.cache_stats()
        if not stats.get("waiting") and not stats.get("running") and not stats.get("locked_nodes"):
            return stats
        time.sleep(0.05)
    return stats


def assert_no_leaks(engine: Any, baseline_used: int) -> None:
    """No request-held pages (after a flush only the cache's own pages may stay) and no locked nodes."""
    stats = wait_idle(engine)
    assert stats.get("locked_nodes", 0) == 0, stats
    assert stats.get("running", 0) == 0 and stats.get("waiting", 0) == 0, stats
    engine.flush_cache("device")
    after = engine.cache_stats()
    assert after["device_pool"]["used_pages"] <= baseline_used, after
