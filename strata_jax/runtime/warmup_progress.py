"""Start-up progress an engine reports while it loads and compiles (thread-safe).

The engine calls ``phase(name)`` (``loading model`` -> ``compiling`` -> ``ready``) and
``programs(done, total)`` during the warm-up; ``serve`` reads ``snapshot()`` to answer
/health with 503 and the progress until the engine is ready, and logs each step.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("strata_jax.startup")


class WarmupProgress:
    def __init__(self, *, log_progress: bool = False) -> None:
        self._lock = threading.Lock()
        self._phase = "starting"
        self._done = 0
        self._total = 0
        self._started = time.monotonic()
        self._log = log_progress

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase = name
        if self._log:
            log.info("start-up: %s (%.1f s)", name, time.monotonic() - self._started)

    def programs(self, done: int, total: int) -> None:
        with self._lock:
            self._done, self._total = done, total
        if self._log:
            log.info("warming up: compiled %d/%d programs (%.1f s)", done, total, time.monotonic() - self._started)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "phase": self._phase,
                "programs_done": self._done,
                "programs_total": self._total,
                "elapsed_s": round(time.monotonic() - self._started, 1),
            }
