"""Every Pallas kernel lowers for CUDA and ROCm from this CPU machine.

``jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`` runs the Pallas ->
Triton lowering in Python and embeds the kernel as a ``__gpu$xla.gpu.triton``
custom call; a kernel using an op or tile shape Triton cannot express fails here.
From jax 0.11 that lowering needs an abstract GPU device on a CPU-only host:
``pallas_kernels.aot.lower_for_gpu`` provides it (harmless on 0.10).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.aot import gpu_lowering_target, lower_for_gpu
from pallas_kernels.attention import ragged_paged_attention_pallas, ragged_paged_attention_pool_pallas
from pallas_kernels.transfer import gather_pages_pallas, scatter_pages_pallas

PLATFORMS = ("cuda", "rocm")
TRITON_CALL = "__gpu$xla.gpu.triton"


def _lowered_text(fn, *args, platform, donate=()):
    return lower_for_gpu(fn, *args, platform=platform, donate_argnums=donate).as_text()


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
    [
        (1, jnp.bfloat16, None, None),
        (16, jnp.bfloat16, 30.0, 1),
        (64, jnp.float32, None, 8),
        (8, jnp.float16, 50.0, None),
    ],
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


def _triton_operand_counts(text):
    """Operand count of each Triton custom call in the lowered module's text."""
    calls = [line for line in text.splitlines() if TRITON_CALL in line and "stablehlo.custom_call" in line]
    return [len(line.split(TRITON_CALL, 1)[1].split(")", 1)[0].split(",")) for line in calls]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    "page_size,dtype,soft_cap,max_q_len,window",
    [
        (16, jnp.bfloat16, None, 1, None),  # decode
        (64, jnp.float32, 30.0, None, 128),  # extend, soft cap, sliding window
        (8, jnp.float16, None, 8, None),
    ],
)
def test_attention_kernel_with_sinks_lowers(platform, page_size, dtype, soft_cap, max_q_len, window):
    """GPT-OSS sinks ([num_q_heads] float32) reach the kernel as one more operand; without
    them the call keeps today's eight operands."""
    num_tokens, batch, pages = 32, 4, 64
    args = (
        jax.ShapeDtypeStruct((num_tokens, 32, 128), dtype),
        jax.ShapeDtypeStruct((pages, page_size, 8, 128), dtype),
        jax.ShapeDtypeStruct((pages, page_size, 8, 128), dtype),
        jax.ShapeDtypeStruct((batch, 16), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
    )
    sinks = jax.ShapeDtypeStruct((32,), jnp.float32)

    def fn(*a, sinks=None):
        return ragged_paged_attention_pallas(
            *a,
            sm_scale=float(1 / np.sqrt(128)),
            soft_cap=soft_cap,
            sliding_window=window,
            sinks=sinks,
            max_q_len=max_q_len,
        )

    text = _lowered_text(lambda *a: fn(*a[:-1], sinks=a[-1]), *args, sinks, platform=platform)
    assert _triton_operand_counts(text) == [9]
    assert _triton_operand_counts(_lowered_text(fn, *args, platform=platform)) == [8]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_pool_attention_with_sinks_lowers_in_a_layer_scan(platform):
    """The pool variant under a layer scan, each layer's sinks and window scanned with it: one
    Triton call in the loop body, sinks a runtime operand (no recompile per layer)."""
    pool = jax.ShapeDtypeStruct((4, 2, 64, 16, 8, 64), jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((32, 64, 64), jnp.bfloat16),
        pool,
        jax.ShapeDtypeStruct((4, 16), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((5,), jnp.int32),
        jax.ShapeDtypeStruct((4, 64), jnp.float32),  # per-layer sinks
        jax.ShapeDtypeStruct((4,), jnp.int32),  # per-layer windows
    )

    def step(q, kv_pool, table, seq_lens, query_start, sinks, windows):
        def body(carry, xs):
            layer, layer_sinks, window = xs
            out = ragged_paged_attention_pool_pallas(
                q, kv_pool, layer, table, seq_lens, query_start, sm_scale=0.1, sliding_window=window, sinks=layer_sinks
            )
            return carry + out, None

        layers = jnp.arange(4, dtype=jnp.int32)
        return jax.lax.scan(body, jnp.zeros_like(q), (layers, sinks, windows))[0]

    text = _lowered_text(step, *args, platform=platform)
    assert "stablehlo.while" in text
    assert _triton_operand_counts(text) == [9]


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


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("tokens", [1, 5])  # decode bucket and extend bucket
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_engine_step_lowers_for_gpu_with_every_kernel_in_place(platform, tokens, scan_layers, monkeypatch):
    """The whole jitted model step the engine runs on a GPU: one Triton attention call in
    the layer scan's body (one per layer when unrolled), the pool donated and aliased to
    the output, and no pool-sized copy or slice."""
    from strata_jax.models.config import ModelConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig

    monkeypatch.setenv("STRATA_KERNEL_BACKEND", "pallas")
    config = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    runner = ModelRunner(
        random_model(config),
        RunnerConfig(
            page_size=16,
            num_device_pages=97,
            max_batch_tokens=32,
            max_batch_size=2,
            max_context_tokens=128,
            kv_dtype="bfloat16",
            scan_layers=scan_layers,
        ),
    )
    with gpu_lowering_target(platform):
        lowered = runner.lower_step(tokens, 1, decode=tokens == 1, platforms=(platform,))
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == (1 if scan_layers else config.num_layers)
    assert ("stablehlo.while" in text) == scan_layers
    assert "tf.aliasing_output" in text  # the donated pool comes back as an output buffer
    pool_type = "tensor<3x2x97x16x2x16xbf16>"
    pool_ops = {
        line.split("=")[1].split()[0] for line in text.splitlines() if "=" in line and pool_type in line.split("=")[1]
    }
    # no slice or copy of the pool; jax >= 0.11 adds a (free) Shardy annotation under the abstract mesh
    allowed = {
        "stablehlo.reshape",
        "stablehlo.scatter",
        "stablehlo.custom_call",
        "call",
        "func.call",
        "stablehlo.while",
        "sdy.sharding_constraint",
    }
    assert pool_ops <= allowed, pool_ops


def test_gpu_lowering_target_rejects_unknown_platform():
    with pytest.raises(ValueError, match="platform must be one of"), gpu_lowering_target("tpu"):
        pass


@pytest.mark.parametrize("platform", PLATFORMS)
def test_float32_attention_uses_ieee_dots_not_tf32(platform, monkeypatch, capsys):
    """Triton lowers an f32 dot of DEFAULT precision as TF32; the kernel asks for HIGHEST."""
    import pallas_kernels.attention as attention

    monkeypatch.setattr(attention.pl, "pallas_call", functools.partial(attention.pl.pallas_call, debug=True))
    args = (
        jax.ShapeDtypeStruct((8, 8, 64), jnp.float32),
        jax.ShapeDtypeStruct((16, 4, 2, 64), jnp.float32),
        jax.ShapeDtypeStruct((16, 4, 2, 64), jnp.float32),
        jax.ShapeDtypeStruct((2, 8), jnp.int32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
    )
    lower_for_gpu(functools.partial(attention.ragged_paged_attention_pallas, sm_scale=0.1), *args, platform=platform)
    dots = [line for line in capsys.readouterr().out.splitlines() if "tt.dot " in line]
    assert len(dots) == 2, dots  # q.k and p.v
    assert not any("tf32" in line for line in dots), dots
