"""The engine: the step loop and the request life cycle over the scheduler, the cache and an executor.

Modules (one job each; ``docs/design.md`` §2 has the map):

* ``engine.py``   ``Engine``: loads the model, composes the parts, threads, the public API
* ``core.py``     ``EngineCore``: the pipelined step (poll, schedule, load, run, postprocess)
* ``requests.py`` request state and page tables (``TrackedRequest``, ``RequestPages``)
* ``output.py``   stop rules, detokenization, stream chunks, the output thread
* ``sinks.py``    delivery to callers (sync, asyncio)
* ``executor.py`` the executor seam (``JaxExecutor`` real, ``SimExecutor`` simulated)
* ``cache_view.py`` the scheduler's read-only window on the cache
* ``config.py``   ``EngineConfig``
* ``stats.py``    what ``cache_stats`` and ``check_accounting`` report
* ``handoff.py``  how long a decode replica waits for a prompt another replica computes
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_jax.engine.config import EngineConfig
    from strata_jax.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    # Lazy: the simulator imports ``engine.core`` and must not pull in jax through ``Engine``.
    if name == "Engine":
        from strata_jax.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from strata_jax.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
