"""Every Pallas kernel lowers for CUDA and ROCm from this CPU machine.

``jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`` runs the Pallas ->
Triton lowering in Python and embeds the kernel as a ``__gpu$xla.gpu.triton``
custom call; a kernel using an op or tile shape Triton cannot express fails here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import ragged_paged_attention_pallas, ragged_paged_attention_pool_pallas
from pallas_kernels.transfer import gather_pages_pallas, scatter_pages_pallas

PLATFORMS = ("cuda", "rocm")
TRITON_CALL = "__gpu$xla.gpu.triton"


def _lowered_text(fn, *args, platform, donate=()):
    return jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _pool(page_size, dtype, layers=4, pages=32, heads=8, dim=128):
    return jax.ShapeDtypeStruct((layers, 2, pages, page_size, heads, dim), dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("page_size", (1, 16, 64))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_transfer_kernels_lower(platform, page_size, dtype):
    pool = _pool(page_size, dtype)
    staging = jax.ShapeDtypeStruct((5, 4, 2, page_size, 8, 128), dtype)
    ids = jax.ShapeDtypeStruct((5,), jnp.int32)
    text = _lowered_text(scatter_pages_pallas, pool, staging, ids, platform=platform, donate=(0,))
    assert TRITON_CALL in text
    assert "tf.aliasing_output = 0" in text  # donated pool aliased to the output
    assert "output_operand_aliases" in text  # and the kernel writes into it in place
    text = _lowered_text(gather_pages_pallas, pool, ids, platform=platform)
    assert TRITON_CALL in text


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    "page_size,dtype,soft_cap,max_q_len",
    [(1, jnp.bfloat16, None, None), (16, jnp.bfloat16, 30.0, 1), (64, jnp.float32, None, 8), (8, jnp.float16, 50.0, None)],
)
def test_attention_kernel_lowers(platform, page_size, dtype, soft_cap, max_q_len):
    num_tokens, batch, pages = 32, 4, 64
    args = (
        jax.ShapeDtypeStruct((num_tokens, 32, 128), dtype),
        jax.ShapeDtypeStruct((pages, page_size, 8, 128), dtype),
        jax.ShapeDtypeStruct((pages, page_size, 8, 128), dtype),
        jax.ShapeDtypeStruct((batch, 16), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
    )
    fn = functools.partial(
        ragged_paged_attention_pallas, sm_scale=float(1 / np.sqrt(128)), soft_cap=soft_cap, max_q_len=max_q_len
    )
    assert TRITON_CALL in _lowered_text(fn, *args, platform=platform)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_pool_attention_lowers_without_copying_the_layer(platform):
    """The whole-pool variant hands the pool to the kernel as a reshape (a bitcast), not a slice."""
    pool = jax.ShapeDtypeStruct((4, 2, 64, 16, 8, 128), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((32, 32, 128), jnp.bfloat16),
        pool,
        jax.ShapeDtypeStruct((4, 16), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((5,), jnp.int32),
    )

    def step(q, kv_pool, table, seq_lens, query_start):
        return ragged_paged_attention_pool_pallas(q, kv_pool, 2, table, seq_lens, query_start, sm_scale=0.1)

    text = _lowered_text(step, *args, platform=platform)
    assert TRITON_CALL in text
    pool_type = "tensor<4x2x64x16x8x128xbf16>"
    pool_ops = [line.strip() for line in text.splitlines() if pool_type in line and "func.func" not in line]
    assert pool_ops and all(line.split("=")[1].split()[0] == "stablehlo.reshape" for line in pool_ops), pool_ops
