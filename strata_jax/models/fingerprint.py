"""What a model's KV depends on besides the tokens, as a short string (``kv_identity``).

It seeds every L3 key (``strata_jax.cache.hashing``), so replicas of the same model, dtype
and KV layout share L3 objects and nothing else does: another model (even one of the same
shape: a fine-tune), the same model at another weights or KV dtype, or another KV layout
is another key, a miss, never a wrong hit.  The weights are named by a SHA-256 of a sample
of every parameter (its first row, up to 256 values, in parameter order): cheap at start-up,
and two checkpoints that differ anywhere in training differ there.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np


def kv_identity(model: object, config: object, weights_dtype: str, layout: object) -> str:
    """``kv-v1:<sha256>`` of the model config, the dtypes, the KV layout and a weights sample."""
    from flax import nnx

    h = hashlib.sha256()
    h.update(f"{config!r}\n{weights_dtype}\n{layout!r}\n".encode())
    for path, leaf in sorted(
        jax.tree_util.tree_leaves_with_path(nnx.state(model)), key=lambda kv: jax.tree_util.keystr(kv[0])
    ):
        if not hasattr(leaf, "shape"):
            continue
        h.update(jax.tree_util.keystr(path).encode())
        h.update(repr((tuple(leaf.shape), str(leaf.dtype))).encode())
        first = leaf[(0,) * (leaf.ndim - 1)] if leaf.ndim > 1 else leaf
        h.update(np.asarray(first[:256], dtype=np.float32).tobytes())
    return "kv-v1:" + h.hexdigest()
