"""The persistent XLA compilation cache (on by default) and counting what was compiled.

``configure(setting)`` turns JAX's persistent cache on before anything compiles:

* ``"auto"`` (the default): ``$XDG_CACHE_HOME/strata-jax/xla`` (``~/.cache/strata-jax/xla``
  when ``XDG_CACHE_HOME`` is unset);
* a path: that directory;
* ``"none"`` / ``"off"`` / ``""`` / ``None``: no persistent cache.

Safety across models, configs and versions: JAX keys every entry by a hash of the
program itself (the full StableHLO module, so any change of model, shapes, dtype,
bucket or kernel yields another key), the compile options, the device kind and
platform version, and the jax / jaxlib versions (``jax._src.cache_key``); the
directory is further split per jax/jaxlib version and platform, so a different
install never even looks at another's entries.  Every program is cached (minimum
compile time 0), so a second start of the same command compiles nothing.

The engine's step programs are also kept whole beside it (``executable_cache``), so a
warm start does not even trace them.

``COUNTER`` counts, for the whole process, the programs handed to XLA (``requests``)
and those read back from the cache (``cache_hits``); ``compiled = requests - hits``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import jax

log = logging.getLogger(__name__)

OFF_VALUES = ("none", "off", "")
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # wraps compile-or-read-from-cache
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"  # recorded when XLA writes what it compiled


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/strata-jax/xla`` or ``~/.cache/strata-jax/xla``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata-jax" / "xla"


def version_subdir() -> str:
    import jaxlib

    return f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}-{jax.default_backend()}"


def resolve(setting: str | None) -> Path | None:
    """The cache directory ``setting`` names (see the module docstring), or None for off."""
    if setting is None or setting.strip().lower() in OFF_VALUES:
        return None
    root = default_cache_root() if setting.strip().lower() == "auto" else Path(setting).expanduser()
    return root / version_subdir()


_configured: Path | None = None
_lock = threading.Lock()


def configure(setting: str | None) -> Path | None:
    """Point JAX's persistent compilation cache at ``setting`` (or turn it off); returns the
    directory in use.  Call before the first compile; calling again with another
    directory switches caches (later compiles use the new one)."""
    global _configured
    directory = resolve(setting)
    with _lock:
        if directory == _configured:
            return directory
        from jax.experimental.compilation_cache import compilation_cache as cc

        if directory is None:
            jax.config.update("jax_compilation_cache_dir", None)
        else:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OSError(f"cannot create the compilation cache directory {directory}: {exc}") from exc
            jax.config.update("jax_compilation_cache_dir", str(directory))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        cc.reset_cache()  # JAX decides once whether a cache is used; make it look again
        _configured = directory
        log.info("XLA compilation cache: %s", directory or "off")
    return directory


@dataclass
class CompileCounts:
    requests: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0  # time in XLA compile-or-read-from-cache

    @property
    def compiled(self) -> int:
        """Programs XLA actually compiled (not read back from the persistent cache)."""
        return self.requests - self.cache_hits

    def minus(self, earlier: CompileCounts) -> CompileCounts:
        return CompileCounts(
            self.requests - earlier.requests,
            self.cache_hits - earlier.cache_hits,
            self.compile_seconds - earlier.compile_seconds,
        )

    def as_dict(self) -> dict:
        return {
            "programs": self.requests,
            "compiled": self.compiled,
            "cache_hits": self.cache_hits,
            "compile_s": round(self.compile_seconds, 3),
        }


class _Counter:
    def __init__(self) -> None:
        self._counts = CompileCounts()
        self._lock = threading.Lock()
        self._thread = threading.local()
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **_: object) -> None:
        # jax records these in the thread that compiles (jax._src.compiler.compile_or_get_cached),
        # so the thread-local counts tell what one compile did.
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self._counts.cache_hits += 1
            self._thread.hits = getattr(self._thread, "hits", 0) + 1
        elif event == _CACHE_WRITE_EVENT:
            self._thread.writes = getattr(self._thread, "writes", 0) + 1

    def _on_duration(self, event: str, duration_secs: float, **_: object) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self._counts.requests += 1
                self._counts.compile_seconds += duration_secs

    def this_thread(self) -> tuple[int, int]:
        """(reads from the persistent cache, writes to it) by compiles on the calling thread so far."""
        return getattr(self._thread, "hits", 0), getattr(self._thread, "writes", 0)

    def snapshot(self) -> CompileCounts:
        with self._lock:
            c = self._counts
            return CompileCounts(c.requests, c.cache_hits, c.compile_seconds)


COUNTER = _Counter()
