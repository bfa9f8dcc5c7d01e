"""Whole step executables kept across starts, so a warm start skips tracing and lowering.

The persistent XLA cache (``compilation_cache``) saves the compiles, but to find its
key each warm start still traces every step program and lowers it to StableHLO:
~0.3 s a program on the 2-core CPU machine, 4-5x the time of reading the compiled
program back.  This cache stores the compiled executable itself
(``jax.experimental.serialize_executable``) and finds it by a key made, without
tracing, of everything that decides what the trace would produce:

* the source of ``strata_jax`` and ``pallas_kernels`` (every ``.py`` file's bytes, as
  they were when this module was imported);
* the versions of Python, jax, jaxlib, flax, numpy and ml_dtypes;
* jax's global config values (but those of caching and logging), flax's config and
  ``XLA_FLAGS``;
* the backend: platform, platform version, the host's CPU features (XLA:CPU code is
  built for them), every device with its kind and process, this process's index;
* the program: the model's graph and config, the runner config, the resolved kernel
  backend, the mesh with its devices in order, and the tree, shapes, dtypes,
  shardings and devices of its arguments.

Any difference gives another key: a miss, which traces, lowers and compiles as
before and stores the result; never a reuse of a wrong program.  What the key
cannot see is code changed in memory (a monkeypatched function) or jax config set
in a thread-local context around the engine: turn the cache off
(``EngineConfig.reuse_executables=False``) for such experiments.  Code changed on
disk after import is seen: nothing is stored then (``code_unchanged``), so an entry
never holds older code under a newer key.

Entries are ``<key>.exe`` files in ``<compilation cache dir>/executables``, written
to a temporary name and renamed, so a crash never leaves half an entry under a real
name.  Only programs that XLA compiled in this start are stored, not those it read
from its own cache (``compile_fresh``: XLA:CPU re-serializes those incompletely), so
a start whose programs all came from the XLA cache stores nothing and the next one
reads the XLA cache again.  An entry that cannot be read back is a miss (logged) and
is overwritten; a read-back program that fails when run is removed (``discard``), so
the next start compiles it.  Beyond ``MAX_BYTES`` (2 GiB) the least recently used
entries are removed.  A directory that cannot be made, or code that cannot be read,
turns the cache off for that start (logged); start-up goes on.  Entries hold native
code, like the XLA cache's: the directory must be as trusted as the Python
environment itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import jax
import numpy as np

from strata_jax.runtime import compilation_cache

log = logging.getLogger(__name__)

FORMAT = 1
SUBDIR = "executables"
# Every code change makes new keys, so old entries pile up; beyond this many bytes the
# least recently used entries (by mtime, refreshed on each read) are removed.
MAX_BYTES = 2 << 30
# jax config values that change where things are cached or what is logged, not the program.
_IGNORED_CONFIG_PREFIXES = (
    "jax_compilation_cache",
    "jax_persistent_cache",
    "jax_enable_compilation_cache",
    "jax_raise_persistent_cache_errors",
    "jax_log_compiles",
    "jax_explain_cache_misses",
    "jax_logging_level",
    "jax_debug_log_modules",
    "jax_pprint_use_color",
)


def _xla_cache_on() -> bool:
    options = jax.config.values  # (the attributes jax sets per option are not in its stub)
    return bool(options["jax_enable_compilation_cache"] and options["jax_compilation_cache_dir"])


def compile_fresh(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """``lowered.compile()`` and whether XLA certainly compiled it in this call.

    Only such an executable may be stored: XLA:CPU serializes one that it read back
    from its own cache without all of its functions, and running that copy after
    another start fails ("Function wrapped_iota not found").  With XLA's cache on, a
    compile counts as fresh only on positive evidence (XLA wrote the result to its
    cache, and read nothing); anything else, e.g. jax's events renamed or the
    listeners cleared, means not fresh: not stored."""
    cache_on = _xla_cache_on()
    hits, writes = compilation_cache.COUNTER.this_thread()
    compiled = lowered.compile()
    hits_after, writes_after = compilation_cache.COUNTER.this_thread()
    if not cache_on:
        return compiled, hits_after == hits
    return compiled, hits_after == hits and writes_after > writes


def _code_roots() -> list[Path]:
    import pallas_kernels
    import strata_jax

    return [Path(strata_jax.__file__).parent, Path(pallas_kernels.__file__).parent]


def source_fingerprint(roots: Iterable[Path]) -> str | None:
    """sha256 over the relative path and bytes of every ``.py`` file under ``roots``; None
    when one cannot be read (a dangling editor lock file, a file removed mid-checkout)."""
    digest = hashlib.sha256()
    try:
        for root in roots:
            digest.update(f"root {root.name}\n".encode())
            for path in sorted(root.rglob("*.py")):
                data = path.read_bytes()
                digest.update(f"{path.relative_to(root).as_posix()} {len(data)}\n".encode())
                digest.update(data)
    except OSError as exc:
        log.warning("cannot fingerprint the code (%s); step executables are not reused", exc)
        return None
    return digest.hexdigest()


# The code as it was when the engine's modules were imported: the key of every entry.
# A program traced after the files changed on disk is not stored (``code_unchanged``),
# so an entry never holds older code under a newer key.
_loaded_code: str | None = source_fingerprint(_code_roots())


def code_unchanged() -> bool:
    """The files on disk are still those fingerprinted at import (and could be read)."""
    return _loaded_code is not None and source_fingerprint(_code_roots()) == _loaded_code


@cache
def _cpu_features() -> str:
    """The host's CPU flags: XLA:CPU code is compiled for them, and device_kind is just "cpu"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_fingerprint() -> str | None:
    """Code, versions, jax and flax config, backend and process: the part of every key
    that is not the program; None when the code could not be fingerprinted."""
    import flax
    import jaxlib
    import ml_dtypes

    if _loaded_code is None:
        return None
    backend = jax.devices()[0].client
    config = sorted(
        (name, repr(value))
        for name, value in jax.config.values.items()
        if not name.startswith(_IGNORED_CONFIG_PREFIXES)
    )
    flax_config = sorted(
        (name, repr(getattr(flax.config, name))) for name in dir(flax.config) if name.startswith(("flax_", "nnx_"))
    )
    parts = [
        f"format {FORMAT}",
        f"code {_loaded_code}",
        f"python {platform.python_implementation()} {sys.version}",
        f"versions jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__} "
        f"numpy {np.__version__} ml_dtypes {ml_dtypes.__version__}",
        f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
        f"config {config}",
        f"flax config {flax_config}",
        f"backend {backend.platform} {backend.platform_version}",
        f"cpu {platform.machine()} {_cpu_features() if backend.platform == 'cpu' else ''}",
        f"devices {[(d.id, d.device_kind, d.process_index) for d in jax.devices()]}",
        f"process {jax.process_index()} of {jax.process_count()}",
    ]
    return "\n".join(parts)


def _leaf_signature(leaf: object) -> str:
    if isinstance(leaf, jax.Array):
        device_set: set[jax.Device] = leaf.sharding.device_set  # (its stub's element type does not resolve)
        devices = sorted(d.id for d in device_set)  # the sharding's repr names no devices
        return f"{leaf.shape} {leaf.dtype} weak={leaf.weak_type} {leaf.sharding} on {devices}"
    if isinstance(leaf, np.ndarray):
        return f"np {leaf.shape} {leaf.dtype}"
    return f"{type(leaf).__name__} {leaf!r}"


def arguments_signature(args: tuple) -> tuple[jax.tree_util.PyTreeDef, str]:
    """The tree of ``args`` (as ``jit`` flattens them: ``(args, {})``) and its leaves' shapes,
    dtypes and shardings."""
    leaves, tree = jax.tree_util.tree_flatten((args, {}))
    return tree, f"{tree}\n" + "\n".join(_leaf_signature(leaf) for leaf in leaves)


def program_key(environment: str | None, program: str, args_signature: str) -> str:
    return hashlib.sha256(f"{environment}\n--\n{program}\n--\n{args_signature}".encode()).hexdigest()


class ExecutableCache:
    """Compiled step programs on disk, by ``program_key``."""

    @classmethod
    def open(cls, directory: Path, **kwargs) -> ExecutableCache | None:
        """The cache in ``directory``, or None (logged) when it cannot be used: the directory
        cannot be created, or the code cannot be fingerprinted.  Start-up goes on without it."""
        if _loaded_code is None:
            return None
        try:
            return cls(directory, **kwargs)
        except OSError as exc:
            log.warning("executable cache off: cannot create %s (%s)", directory, exc)
            return None

    def __init__(self, directory: Path, *, max_bytes: int = MAX_BYTES):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.loaded = 0  # entries read back by this cache object (warm-up loads on several threads)
        self.stored = 0
        self.not_stored = 0  # programs XLA read from its own cache (see compile_fresh)
        self._lock = threading.Lock()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.exe"

    def load(self, key: str, in_tree: jax.tree_util.PyTreeDef) -> jax.stages.Compiled | None:
        """The executable stored under ``key`` for arguments of tree ``in_tree``, or None."""
        from jax.experimental import serialize_executable

        path = self.path(key)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as exc:  # truncated / foreign file: recompile and overwrite it
            log.warning("executable cache entry %s is unreadable (%s); compiling the program again", path.name, exc)
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            log.warning("executable cache entry %s is not this program's; compiling it again", path.name)
            return None
        if entry["in_tree"] != in_tree:  # the key covers the tree already; belt and braces
            log.warning("executable cache entry %s takes other arguments; compiling it again", path.name)
            return None
        by_id = {d.id: d for d in jax.devices()}
        if not all(i in by_id for i in entry["devices"]):
            log.warning(
                "executable cache entry %s runs on devices %s, not all here; compiling it again",
                path.name,
                entry["devices"],
            )
            return None
        try:
            compiled = serialize_executable.deserialize_and_load(
                entry["executable"],
                entry["in_tree"],
                entry["out_tree"],
                execution_devices=[by_id[i] for i in entry["devices"]],
            )
        except Exception as exc:
            log.warning("executable cache entry %s does not load (%s); compiling the program again", path.name, exc)
            return None
        try:
            os.utime(path)  # recently used: the last to be pruned
        except OSError:
            pass
        with self._lock:
            self.loaded += 1
        return compiled

    def store(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write ``compiled`` under ``key``; False (logged) if it cannot be serialized or written."""
        from jax.experimental import serialize_executable

        if not code_unchanged():
            log.warning("the code changed on disk since it was imported; step executable not stored")
            return False
        try:
            # The devices the program was compiled for, in its order (deserializing onto all
            # of the process's devices would make a one-device program expect a shard on each).
            # No public Compiled method gives them in the program's order: read its executable.
            devices = [d.id for d in compiled._executable.xla_extension_executable().local_devices()]
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            entry = {
                "format": FORMAT,
                "key": key,
                "executable": blob,
                "in_tree": in_tree,
                "out_tree": out_tree,
                "devices": devices,
            }
            payload = pickle.dumps(entry)
        except Exception as exc:  # e.g. a backend without executable serialization
            log.info("step executable not stored for reuse (%s: %s)", type(exc).__name__, exc)
            return False
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key[:16]}-", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, self.path(key))
        except OSError as exc:
            log.warning("cannot write the executable cache entry %s: %s", self.path(key), exc)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return False
        with self._lock:
            self.stored += 1
            self._prune()
        return True

    def discard(self, key: str, reason: object) -> None:
        """Remove the entry of a program that failed when run, so the next start compiles it."""
        log.warning("step executable %s failed when run (%s); removed from the executable cache", key[:16], reason)
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def skip_stale_copy(self) -> None:
        """Count a program not stored because XLA read it from its own cache."""
        with self._lock:
            self.not_stored += 1

    def _prune(self) -> None:
        """Remove the least recently used entries while the directory holds over ``max_bytes``."""
        entries = []
        for tmp in self.directory.glob(".*.tmp"):  # left by a writer that crashed
            try:
                if tmp.stat().st_mtime < time.time() - 3600:
                    tmp.unlink()
            except OSError:
                pass
        for path in self.directory.glob("*.exe"):
            try:
                st = path.stat()
            except OSError:  # removed meanwhile by another process
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _mtime, size, _path in entries)
        for _mtime, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
                total -= size
                log.info("executable cache: removed %s (least recently used)", path.name)
            except OSError:
                pass
