"""Helpers of the serving tests: build an engine (real if available), run a server, check leaks.

Warming the real tiny engine takes the better part of two minutes on the shared
CPU machine, so all serving tests share one server per test process
(``shared_server()``), sized so that both the load test (32 clients) and the
overload test (fill the queue) work on it: 8 running + 32 waiting.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from serving.config import ServerConfig
from serving.server import ThreadedServer

MAX_RUNNING = 8
MAX_WAITING = 32
CONTEXT = 512

_shared: ThreadedServer | None = None
_shared_lock = threading.Lock()


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
        from serving.server_cli import build_engine_config
        from strata_jax.engine import Engine, EngineConfig

        config = build_engine_config(EngineConfig, "tiny", _real_overrides(EngineConfig, overrides))
        return lambda: Engine(config)
    return fake_engine_factory(**overrides)


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
    if "device_tokens" in paths and "max_context_tokens" in overrides:
        out["device_tokens"] = 16 * overrides["max_context_tokens"]  # a small pool: fast steps on CPU
    if "max_batch_tokens" in paths:
        out["max_batch_tokens"] = 256
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


def shared_server() -> ThreadedServer:
    """The process-wide test server (started on first use, stopped when the session ends)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = with_baseline(
                start_server(max_waiting=MAX_WAITING, max_running=MAX_RUNNING, max_context_tokens=CONTEXT)
            )
        return _shared


def with_baseline(srv: ThreadedServer) -> ThreadedServer:
    """Settle a started server (idle, tiers flushed) and record its L1 pages in use as
    ``srv.baseline_used``, what ``assert_no_leaks`` compares against."""
    engine = srv.frontend.engine()
    wait_idle(engine)
    engine.flush_cache("all")
    srv.baseline_used = engine.cache_stats()["device_pool"]["used_pages"]  # type: ignore[attr-defined]
    return srv


def stop_shared_server() -> None:
    """Stop the shared server if it runs.  Called from ``pytest_sessionfinish``: at
    interpreter exit (atexit) Python >= 3.12 refuses the threads a shutdown starts."""
    global _shared
    with _shared_lock:
        srv, _shared = _shared, None
    if srv is not None:
        srv.stop(30.0)


def wait_idle(engine: Any, timeout: float = 60.0) -> dict:
    """Wait until no request is waiting or running; return the stats."""
    deadline = time.monotonic() + timeout
    stats = engine.cache_stats()
    while time.monotonic() < deadline:
        stats = engine.cache_stats()
        if not stats.get("waiting") and not stats.get("running"):
            return stats
        time.sleep(0.05)
    return stats


def accounting(engine: Any) -> dict:
    """Exact usage figures: ``check_accounting()`` when the engine has it (drains backups first)."""
    if hasattr(engine, "check_accounting"):
        return dict(engine.check_accounting())
    stats = engine.cache_stats()
    return {
        "locked_nodes": stats["locked_nodes"],
        "live_requests": stats["waiting"] + stats["running"],
        "device_request_pages": stats["device_pool"]["used_pages"],
    }


def assert_no_leaks(engine: Any, baseline_used: int, timeout: float = 60.0) -> None:
    """No live request, no request-held page, no locked or transient node; after a flush the pool is at baseline."""
    deadline = time.monotonic() + timeout
    while True:
        wait_idle(engine, timeout)
        acc = accounting(engine)
        clean = (
            acc.get("live_requests", 0) == 0
            and acc.get("device_request_pages", 0) == 0
            and acc.get("locked_nodes", 0) == 0
            and acc.get("transient_nodes", 0) == 0
        )
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert clean, acc
    engine.flush_cache("all")
    after = engine.cache_stats()
    assert after["device_pool"]["used_pages"] <= baseline_used, after
    assert after["locked_nodes"] == 0, after
