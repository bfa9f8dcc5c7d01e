"""strata-jax: a JAX/XLA serving engine with hierarchical (HBM / DRAM / storage) KV caching.

``from strata_jax import Engine, EngineConfig, SamplingParams``.  Exports are lazy so
that pure-Python subpackages (scheduler, radix tree) import without jax.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "strata_jax.engine",
    "EngineConfig": "strata_jax.engine.config",
    "SamplingParams": "strata_jax.api",
    "RequestOutput": "strata_jax.api",
    "StreamChunk": "strata_jax.api",
    "InvalidRequestError": "strata_jax.api",
    "OverloadedError": "strata_jax.api",
    "EngineUnavailableError": "strata_jax.api",
    "RequestAbortedError": "strata_jax.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'strata_jax' has no attribute {name!r}")
