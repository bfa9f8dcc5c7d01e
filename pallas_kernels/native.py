"""Native CPU kernels: C++ XLA FFI custom calls, compiled on this machine on first use.

Two kernels, the pool attention of the ``"xla"`` backend on CPU (``cpu_paged_attention_pool``
picks): ``paged_extend_attention_pool`` (``native/paged_extend.cc``) for prefill chunks,
scores computed transposed (K Q^T) over 96-key blocks read from the pages, the softmax
across rows in vector lanes, register-tiled in the CPU's widest vectors (docs/kernels.md), and
``paged_decode_attention_pool`` (``native/paged_decode.cc``) for decode batches.  The
block-causal XLA attention (``pallas_kernels.blocked``) copies each KV block of every row
into a new array before its matmuls (XLA:CPU's gather moves ~6-10 GB/s) and makes several
elementwise passes over its score blocks; the kernels read the pages where they lie.  The
decode reads all heads of a token at once, and tokens whose first page is the same (a
document and the questions asked about it) take each page in turn, so a shared page comes
from memory once.  Measured side by side with the blocked XLA attention (docs/runtime.md):
decode 0.3-0.7x the time, extend 0.5-0.8x.

Learned attention sinks (GPT-OSS, ``sinks``: float32 ``[num_q_heads]``, the reference's
``normalize_with_sinks``) are one more operand of both kernels: each query head's sink
logit joins its softmax denominator in the final normalisation only, so the key loops do
the same work with or without them.  ``sinks=None`` sends -inf for every head, which
leaves the results bit for bit what they are without the operand (one program, no
attribute to switch on).

Building: the sources are compiled with the system C++ compiler (``$CXX``, else ``g++``,
``c++`` or ``clang++``) against the FFI headers jaxlib ships, ``-O3 -march=native``, into
``$XDG_CACHE_HOME/strata-jax/native`` (``~/.cache/...``), keyed by the source, the flags,
jaxlib's version and this CPU, so a second process (and a second run) loads it in
milliseconds.  A build takes a few seconds, once.

``$STRATA_NATIVE_KERNELS=0`` turns the native kernels off: the ``"xla"`` backend then
runs the blocked XLA attention.  When they cannot be built (no compiler), the same happens
and a warning says why, once per process; ``available()`` and ``status()`` say which.
The extend kernel's vectors are as wide as ``-march=native`` offers (512 bits with
AVX-512F, else 256); ``$STRATA_NATIVE_VECTOR_BITS=256`` forces the narrower build (and 512
on a CPU without AVX-512F is refused); ``vector_bits()`` and ``status()`` say which.

Only float32 pools use the kernels (the CPU default), and the extend only head_dim a
multiple of 16; others take the XLA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.blocked import blocked_paged_attention_pool, decode_token_rows

ENV_VAR = "STRATA_NATIVE_KERNELS"
SOURCE_DIR = Path(__file__).with_name("native")
SOURCES = (SOURCE_DIR / "paged_decode.cc", SOURCE_DIR / "paged_extend.cc")
HEADERS = (SOURCE_DIR / "common.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
WIDTH_ENV_VAR = "STRATA_NATIVE_VECTOR_BITS"  # 256 forces the AVX2-width code on an AVX-512 CPU
VECTOR_WIDTHS = (256, 512)
_TARGET = "strata_paged_decode_attention"
_SYMBOL = "StrataPagedDecodeAttention"
_EXTEND_TARGET = "strata_paged_extend_attention"
_EXTEND_SYMBOL = "StrataPagedExtendAttention"
_BUILD_TIMEOUT_S = 300
EXTEND_HEAD_DIM_MULTIPLE = 16  # the extend kernel's register tiles are 16 dims wide

logger = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded here."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "strata-jax" / "native"


def compiler() -> str | None:
    """The C++ compiler a build would use (``$CXX`` first), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return platform.machine() + "\n".join(sorted(set(keep)))


def cpu_has_avx512() -> bool:
    """Whether this CPU offers AVX-512F (what the 512-bit build needs)."""
    return "avx512f" in _cpu_identity().split()


def build_flags() -> tuple[str, ...]:
    """FLAGS plus the vector width ``$STRATA_NATIVE_VECTOR_BITS`` forces (256 or 512; unset:
    the widest ``-march=native`` offers, 512 with AVX-512F, else 256)."""
    forced = os.environ.get(WIDTH_ENV_VAR, "").strip()
    if not forced:
        return FLAGS
    if forced not in {str(bits) for bits in VECTOR_WIDTHS}:
        raise NativeBuildError(f"${WIDTH_ENV_VAR} must be one of {VECTOR_WIDTHS}, got {forced!r}")
    if forced == "512" and not cpu_has_avx512():
        raise NativeBuildError(f"${WIDTH_ENV_VAR}=512 needs a CPU with AVX-512F; this one has none")
    return (*FLAGS, f"-DSTRATA_VECTOR_BITS={forced}")


def library_path(cxx: str) -> Path:
    """Where the build for this source, flags, compiler, jaxlib and CPU lives."""
    key = hashlib.sha256()
    sources = tuple(path.read_bytes() for path in (*SOURCES, *HEADERS))
    flags = " ".join(build_flags()).encode()
    for part in (*sources, flags, cxx.encode(), jax.__version__.encode(), _cpu_identity().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"strata_native-{key.hexdigest()[:20]}.so"


def build() -> Path:
    """Compile the kernels unless this exact build is cached; returns the library's path."""
    cxx = compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler found ($CXX, g++, c++ or clang++); install one (apt install g++)")
    target = library_path(cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # then renamed: concurrent builds never see half a file
    os.close(fd)
    command = [cxx, *build_flags(), f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    logger.info("compiling the native CPU kernels (once): %s", " ".join(command))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeBuildError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise NativeBuildError(f"compiling {', '.join(p.name for p in SOURCES)} took over {_BUILD_TIMEOUT_S} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _load() -> tuple[bool, str, int]:
    if not enabled_by_env():
        return False, f"off (${ENV_VAR}=0)", 0
    try:
        path = build()
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in ((_TARGET, _SYMBOL), (_EXTEND_TARGET, _EXTEND_SYMBOL)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        bits = int(library.strata_native_vector_bits())
    except (NativeBuildError, OSError, AttributeError) as e:
        logger.warning("native CPU kernels unavailable, the XLA decode attention runs instead: %s", e)
        return False, f"unavailable: {e}", 0
    return True, f"on, {bits}-bit vectors ({path})", bits


def vector_bits() -> int:
    """The vector width the loaded build's extend kernel uses (512: AVX-512, 256: AVX2 or
    NEON pairs); 0 when the kernels are not available."""
    return _load()[2]


def available() -> bool:
    """Built, loaded and registered (builds on the first call; False when off or failed)."""
    return _load()[0]


def status() -> str:
    """One line for ``strata-jax info``: on (and where), off, or why unavailable."""
    return _load()[1]


def _require() -> None:
    if not available():
        raise NativeBuildError(f"the native CPU kernels are {status()}")


def status_for(backend: str) -> str:
    """``status()`` where ``backend`` would call the kernel (the ``"xla"`` backend on CPU),
    else that it is not used; building it only then."""
    if backend != "xla" or jax.default_backend() != "cpu":
        return "not used (the xla backend on CPU only)"
    return status()


def _call(
    target: str,
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int | jax.Array,
    row_operands: tuple[jax.Array, ...],
    sliding_window: int | jax.Array | None,
    sm_scale: float,
    soft_cap: float | None,
    sinks: jax.Array | None,
) -> jax.Array:
    """One kernel's custom call: ``(q, pool, layer, *row_operands, window, sinks)`` with the
    scale and soft cap as attributes; the output has q's shape and dtype.  The kernels'
    operands differ only in how rows are described (``row_operands``, int32).  ``sinks``
    goes as float32 ``[num_q_heads]`` (the kernel checks the count), None as all -inf."""
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    layer_index = jnp.clip(jnp.asarray(layer, jnp.int32), 0, kv_pool.shape[0] - 1)
    if sinks is None:  # exp(-inf - max) = 0: the denominator without a sink, exactly
        sink_logits = jnp.full((q.shape[1],), -jnp.inf, jnp.float32)
    else:
        if jnp.shape(sinks) != (q.shape[1],):  # as the reference refuses it, before anything runs
            raise ValueError(f"sinks must have shape ({q.shape[1]},) (one per query head), got {jnp.shape(sinks)}")
        sink_logits = jnp.asarray(sinks, jnp.float32).reshape(-1)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32),
        kv_pool,
        layer_index,
        *(a.astype(jnp.int32) for a in row_operands),
        jnp.maximum(window, 0),
        sink_logits,
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
    )
    return out.astype(q.dtype)


def paged_decode_attention_pool(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode-shaped attention (one token per row, ``T == B``) of layer ``layer`` of the
    float32 pool ``[L, 2, P, S, H, D]`` by the native kernel; same contract as
    ``blocked_paged_attention_pool``, ``sinks`` (float32 ``[num_q_heads]``) included.
    Raises ``NativeBuildError`` unless ``available()``."""
    _require()
    num_tokens = q.shape[0]
    if kv_pool.dtype != jnp.float32:
        raise ValueError(f"the native decode attention reads a float32 pool, got {kv_pool.dtype}")
    if num_tokens != page_table.shape[0]:
        raise ValueError(
            f"decode-shaped calls only (tokens == rows), got {num_tokens} tokens, {page_table.shape[0]} rows"
        )
    seq_of_token, kv_len = decode_token_rows(seq_lens, query_start, num_tokens)
    rows = (page_table[seq_of_token], kv_len)
    return _call(_TARGET, q, kv_pool, layer, rows, sliding_window, sm_scale, soft_cap, sinks), kv_pool


def paged_extend_attention_pool(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Ragged causal attention of a batch's new tokens (any tokens per row) over layer
    ``layer`` of the float32 pool ``[L, 2, P, S, H, D]`` by the native kernel; same
    contract as ``blocked_paged_attention_pool``, ``sinks`` (float32 ``[num_q_heads]``)
    included.  ``head_dim`` a multiple of 16; raises ``NativeBuildError`` unless
    ``available()``."""
    _require()
    head_dim = q.shape[2]
    if kv_pool.dtype != jnp.float32:
        raise ValueError(f"the native extend attention reads a float32 pool, got {kv_pool.dtype}")
    if head_dim % EXTEND_HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"the native extend attention needs head_dim % {EXTEND_HEAD_DIM_MULTIPLE} == 0, got {head_dim}"
        )
    rows = (page_table, query_start, seq_lens)
    return _call(_EXTEND_TARGET, q, kv_pool, layer, rows, sliding_window, sm_scale, soft_cap, sinks), kv_pool


def cpu_paged_attention_pool(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int | jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    **options,
) -> tuple[jax.Array, jax.Array]:
    """The ``"xla"`` backend's pool attention: on CPU with a float32 pool and the native
    kernels available, decode-shaped calls take the native decode and extends the native
    extend (head_dim a multiple of 16); everything else (other dtypes, other platforms,
    kernels off) the block-causal XLA attention.  ``sinks`` goes to whichever runs."""
    if kv_pool.dtype == jnp.float32 and jax.default_backend() == "cpu" and available():
        allowed = {k: v for k, v in options.items() if k in ("sm_scale", "soft_cap", "sliding_window", "sinks")}
        if q.shape[0] == page_table.shape[0]:
            return paged_decode_attention_pool(q, kv_pool, layer, page_table, seq_lens, query_start, **allowed)
        if q.shape[2] % EXTEND_HEAD_DIM_MULTIPLE == 0:
            return paged_extend_attention_pool(q, kv_pool, layer, page_table, seq_lens, query_start, **allowed)
    return blocked_paged_attention_pool(q, kv_pool, layer, page_table, seq_lens, query_start, **options)
