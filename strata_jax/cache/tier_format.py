"""How L2 (host) pages and L3 objects hold KV: the *tier format* (pure Python, no jax).

``CacheConfig.kv_tier_format`` names it; ``TierFormat.resolve(name, l1_dtype)`` makes it
concrete for an L1 pool of ``l1_dtype``:

==========  ==========================  ==========================================
name        element dtype in L2 / L3     scales
==========  ==========================  ==========================================
``full``    the L1 dtype                 none
``fp8``     float8_e4m3fn                float32 per (page, layer, K/V, KV head)
``int8``    int8 (symmetric, +-127)      float32 per (page, layer, K/V, KV head)
==========  ==========================  ==========================================

``full`` is the default: the tiers hold what L1 holds (with ``--kv-dtype
float8_e4m3fn`` that is fp8 already; ``fp8`` over an fp8 L1 resolves to ``full``, a
second quantization would only lose bits).  Why that scale granularity, and the exact
quantization formula: ``pallas_kernels.quant_transfer``.

A quantized page is stored as two arrays in L2 (``HostPool.data`` in the element dtype,
``HostPool.scales[P, L, 2, H]`` float32) and as one L3 object whose payload is::

    page header (32 bytes) | values [L, 2, S, H, D] | scales [L, 2, H] (float32, little-endian)

The page header names the format, so a reader never decodes bytes of another
format: ``MAGIC "SJKVPG01" | format | element dtype | scale layout | flags | L | S | H | D``
(u8 x 4, u32 x 4, little-endian, zero padded).  ``flags`` bit 0 (``GLOBAL_ONLY``): the
page lacks its sliding-window layers' KV (a server with layer groups keeps the local
KV only near where a match can end, so it backs up some pages without it); only such a
server reads it, as a page with global KV only, and everyone else misses on it.  Every
object carries it, full width included; a headerless object of exactly the full-width
page size is read as full width, so objects stored without a page header stay readable.
On top of that, a quantized format's
objects live under other keys (``object_key``): servers with different tier formats
sharing one L3 never even find each other's objects, and each writes its own.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy.typing as npt

TIER_FORMATS = ("full", "fp8", "int8")
FP8_DTYPE = "float8_e4m3fn"
_ELEMENT_DTYPE = {"fp8": FP8_DTYPE, "int8": "int8"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, FP8_DTYPE: 1, "int8": 1}
SCALE_LAYOUT = "f32/page-layer-kv-head"

PAGE_MAGIC = b"SJKVPG01"
PAGE_HEADER = struct.Struct("<8sBBBBIIII4x")  # 32 bytes
GLOBAL_ONLY = 1  # header flag: the page's local-layer (sliding-window) KV is not in it
_FORMAT_CODES = {"full": 0, "fp8": 1, "int8": 2}
_DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, FP8_DTYPE: 4, "int8": 5}
_SCALE_CODES = {"none": 0, SCALE_LAYOUT: 1}
_KEY_TAG = b"strata-jax/tier-format/v1\x00"


class PageShape(Protocol):
    """The fields of a ``pallas_kernels.layout.KVLayout`` that size a page (any object with them)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


def dtype_name(dtype: npt.DTypeLike) -> str:
    """``"float32"``, ``"bfloat16"``, ... for a dtype name, a NumPy/ml_dtypes dtype or a jnp scalar type."""
    if isinstance(dtype, str) and dtype in _ITEMSIZE:
        return dtype
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 names with numpy)
    import numpy as np

    return np.dtype(dtype).name


class TierFormatError(ValueError):
    """An unknown tier format or an L1 dtype it cannot describe."""


@dataclass(frozen=True)
class TierFormat:
    """The concrete format of the L2/L3 tiers over an L1 pool of ``l1_dtype``."""

    name: str
    l1_dtype: str

    def __post_init__(self) -> None:
        if self.name not in TIER_FORMATS:
            raise TierFormatError(f"unknown KV tier format {self.name!r}; choose one of {', '.join(TIER_FORMATS)}")
        if self.l1_dtype not in _ITEMSIZE:
            raise TierFormatError(f"KV dtype {self.l1_dtype!r} is not one of {', '.join(_ITEMSIZE)}")

    @classmethod
    def resolve(cls, name: str, l1_dtype: str) -> TierFormat:
        """``name`` over an L1 of ``l1_dtype``; ``fp8`` over an fp8 L1 is ``full`` (the same bytes)."""
        l1_dtype = dtype_name(l1_dtype)
        if name == "fp8" and l1_dtype == FP8_DTYPE:
            name = "full"
        return cls(name, l1_dtype)

    @property
    def quantized(self) -> bool:
        return self.name != "full"

    @property
    def element_dtype(self) -> str:
        """Dtype of the values in L2 and L3."""
        return _ELEMENT_DTYPE.get(self.name, self.l1_dtype)

    @property
    def scale_layout(self) -> str:
        return SCALE_LAYOUT if self.quantized else "none"

    # -- sizes (``layout``: a pallas_kernels.layout.KVLayout, or anything with its fields) ----
    @staticmethod
    def _values(layout: PageShape) -> int:
        return 2 * layout.num_layers * layout.page_size * layout.num_kv_heads * layout.head_dim

    def value_bytes(self, layout: PageShape) -> int:
        """Bytes of one page's values in the tier."""
        return self._values(layout) * _ITEMSIZE[self.element_dtype]

    def scale_bytes(self, layout: PageShape) -> int:
        """Bytes of one page's scales (0 for full width)."""
        return 4 * 2 * layout.num_layers * layout.num_kv_heads if self.quantized else 0

    def page_bytes(self, layout: PageShape) -> int:
        """Bytes of one page in L2 and on the link (values + scales): what a load moves."""
        return self.value_bytes(layout) + self.scale_bytes(layout)

    def object_bytes(self, layout: PageShape) -> int:
        """Payload bytes of one L3 object (page header + page)."""
        return PAGE_HEADER.size + self.page_bytes(layout)

    # -- L3 objects ---------------------------------------------------------------------
    def header(self, layout: PageShape, flags: int = 0) -> bytes:
        return PAGE_HEADER.pack(
            PAGE_MAGIC,
            _FORMAT_CODES[self.name],
            _DTYPE_CODES[self.element_dtype],
            _SCALE_CODES[self.scale_layout],
            flags,
            layout.num_layers,
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
        )

    def check_object(self, layout: PageShape, payload: bytes | memoryview) -> memoryview | None:
        """The page bytes (values then scales) of an L3 payload in exactly this format, else ``None``.

        ``None`` (a miss) for another format, element dtype, scale layout or shape, a bad
        magic, a wrong length (a truncated object), or a page without its local-layer KV.
        A headerless payload of exactly the full-width page size is accepted as full width
        (objects stored without a page header)."""
        got = self.check_object_flags(layout, payload)
        return got[0] if got is not None and got[1] == 0 else None

    def check_object_flags(self, layout: PageShape, payload: bytes | memoryview) -> tuple[memoryview, int] | None:
        """``check_object`` that also accepts a ``GLOBAL_ONLY`` page: ``(page bytes, flags)``
        (what a server with layer groups reads), else ``None``."""
        view = memoryview(payload)
        size = self.page_bytes(layout)
        if not self.quantized and len(view) == size and bytes(view[:8]) != PAGE_MAGIC:
            return view, 0
        if len(view) != PAGE_HEADER.size + size:
            return None
        head = bytes(view[: PAGE_HEADER.size])
        for flags in (0, GLOBAL_ONLY):
            if head == self.header(layout, flags):
                return view[PAGE_HEADER.size :], flags
        return None

    def object_key(self, key: bytes) -> bytes:
        """The L3 key of a page whose chain key is ``key``: the key itself for full width,
        a hash of the format and the key for a quantized format (another format: another key)."""
        if not self.quantized:
            return key
        return hashlib.sha256(
            _KEY_TAG + f"{self.name}|{self.element_dtype}|{self.scale_layout}".encode() + b"\x00" + key
        ).digest()

    def describe(self) -> str:
        return f"{self.name} ({self.element_dtype}{', scales ' + self.scale_layout if self.quantized else ''})"
