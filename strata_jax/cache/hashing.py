"""Content keys of KV pages: a SHA-256 chain seeded by the tenant namespace.

``hash(page i) = SHA256(hash(page i-1) || little-endian int64 token ids of page i)``
with ``hash(page -1) = namespace_seed(namespace, identity)``.  ``identity`` names what
the KV depends on besides the tokens (the model's weights, the KV dtype and layout:
``CacheConfig.kv_identity``), so two models, or one model at two dtypes, never share a
key; two tenants never do either; and a key names a page *and its whole prefix* (equal
keys mean equal KV).  Pure Python (hashlib); no jax.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_SEED_TAG = b"strata-jax/kv-chain/v1\x00"


def namespace_seed(namespace: str, identity: str = "") -> bytes:
    """The chain's starting value for ``namespace`` of the KV named by ``identity`` (32 bytes)."""
    if not identity:  # the namespace alone, so stores keyed without an identity stay readable
        return hashlib.sha256(_SEED_TAG + namespace.encode("utf-8")).digest()
    return hashlib.sha256(_SEED_TAG + identity.encode("utf-8") + b"\x00" + namespace.encode("utf-8")).digest()


def page_hash(prev: bytes, page_tokens: Sequence[int]) -> bytes:
    """Key of one page given the key of the page before it (or the seed)."""
    return hashlib.sha256(prev + struct.pack(f"<{len(page_tokens)}q", *page_tokens)).digest()


def chain_hashes(prev: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Keys of every *full* page of ``tokens`` continuing the chain from ``prev``.

    Same values as repeated ``page_hash``; packs all tokens once, then hashes
    page-sized slices (about 3x faster for long prompts).
    """
    n = len(tokens) - len(tokens) % page_size
    if n == 0:
        return []
    raw = memoryview(struct.pack(f"<{n}q", *tokens[:n]))
    step = 8 * page_size
    sha = hashlib.sha256
    out: list[bytes] = []
    for start in range(0, 8 * n, step):
        h = sha(prev)
        h.update(raw[start : start + step])
        prev = h.digest()
        out.append(prev)
    return out
