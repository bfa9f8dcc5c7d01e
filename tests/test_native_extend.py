"""The native paged-extend kernel (``pallas_kernels.native``, the ``"xla"`` backend's
prefill attention on CPU) against the float64 brute force and the block-causal XLA attention.

Batches come from ``test_pallas_attention.make_batch``: unwritten KV slots, padding
queries and page-table entries past a sequence's pages are NaN / garbage, so reading what
it should not turns the output into NaN.  Row lengths cross the kernel's query blocks (192
rows of tokens x GQA group) and its 96-key blocks, with one-token rows (a decode in a
mixed batch) and empty rows between them.  Both vector widths the build can take (256-bit,
forced; 512-bit where the CPU has AVX-512) run against the brute force in a subprocess
each, and the 512-bit build is compiled on any x86 host.  Learned attention sinks (GPT-OSS) are checked
with the decode tests' helpers (tests/test_native_decode.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_native_decode import (
    check_no_sinks_equal_minus_inf_sinks,
    check_sinks_equal_the_reference,
    check_traced_layer_and_window_under_a_scan,
    check_traced_sinks_under_a_scan,
    nan_pool,
)
from test_pallas_attention import brute_force, make_batch, make_sinks

from pallas_kernels import dispatch, native
from pallas_kernels.blocked import blocked_paged_attention_pool
from pallas_kernels.reference import ragged_paged_attention_pool_reference, ragged_paged_attention_reference

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@pytest.mark.parametrize(
    "page_size,head_dim,heads",
    [(16, 64, (9, 3)), (16, 16, (8, 2)), (8, 32, (4, 4)), (16, 16, (2, 1)), (4, 48, (12, 1)), (16, 256, (4, 1))],
)
@pytest.mark.parametrize("soft_cap", (None, 5.0))
@pytest.mark.parametrize("window", (None, 0, 1, 7, 40))
def test_ragged_extend_equals_brute_force(page_size, head_dim, heads, soft_cap, window):
    rng = np.random.default_rng(page_size * 100 + head_dim + (window or 0))
    # a decode row, a fresh prompt, a chunk over cached context longer than a query block,
    # an empty row, a short question over a long context
    q_lens, contexts = (1, 37, 130, 0, 5), (40, 0, 70, 0, 200)
    args, host = make_batch(
        rng,
        page_size=page_size,
        q_lens=q_lens,
        ctx_lens=contexts,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        pad_tokens=3,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    got, _ = native.paged_extend_attention_pool(
        q, nan_pool(k, v), 1, table, seq_lens, qs, sm_scale=0.3, soft_cap=soft_cap, sliding_window=window
    )
    got = np.asarray(got)
    n = int(qs[-1])
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[n:], 0.0)  # padding tokens
    want = brute_force(*host, 0.3, soft_cap, None if not window else window)
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)


def test_a_long_chunk_equals_the_reference_and_the_xla_attention():
    """A 512-token chunk over 1,000 cached tokens and a 300-token prompt beside it (the
    engine's shapes: many query and key blocks, the diagonal inside a block), with
    SmolLM2's heads; against the pure-JAX reference, the block-causal XLA attention and
    the brute force."""
    rng = np.random.default_rng(11)
    args, host = make_batch(
        rng,
        page_size=16,
        q_lens=(512, 300),
        ctx_lens=(1000, 0),
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        pad_tokens=0,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool = nan_pool(k, v)
    got = np.asarray(native.paged_extend_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.125)[0])
    np.testing.assert_allclose(got, brute_force(*host, 0.125, None), atol=2e-5, rtol=2e-5)
    xla = np.asarray(blocked_paged_attention_pool(q, pool, 1, table, seq_lens, qs, sm_scale=0.125)[0])
    np.testing.assert_allclose(got, xla, atol=2e-5, rtol=2e-5)
    ref = np.asarray(ragged_paged_attention_reference(q, k, v, table, seq_lens, qs, sm_scale=0.125))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_traced_layer_and_window_under_a_scan_in_place():
    check_traced_layer_and_window_under_a_scan(
        native.paged_extend_attention_pool, (20, 3, 1), (30, 64, 9), pad_tokens=2
    )


def test_the_cpu_backend_takes_the_extend_kernel_for_float32_and_whole_tiles(monkeypatch):
    """The ``"xla"`` backend's pool attention on an extend: the native extend on a float32
    pool with head_dim a multiple of 16; the XLA attention for bfloat16, head_dim 12, or
    with ``$STRATA_NATIVE_KERNELS=0``."""
    assert dispatch.get_implementation("ragged_paged_attention_pool", "xla") is native.cpu_paged_attention_pool

    def custom_calls(head_dim: int, dtype=jnp.float32) -> int:
        rng = np.random.default_rng(head_dim)
        args, _ = make_batch(
            rng,
            page_size=16,
            q_lens=(3, 1),
            ctx_lens=(9, 20),
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=head_dim,
            pad_tokens=0,
            dtype=jnp.float32,
        )
        q, k, v, table, seq_lens, qs = args
        pool = nan_pool(k, v).astype(dtype)
        fn = jax.jit(lambda p: native.cpu_paged_attention_pool(q, p, 1, table, seq_lens, qs, sm_scale=0.25)[0])
        return fn.lower(pool).as_text().count(native._EXTEND_TARGET)

    assert custom_calls(16) == 1
    assert custom_calls(16, jnp.bfloat16) == 0
    assert custom_calls(12) == 0
    with pytest.raises(ValueError, match="head_dim % 16"):
        native.paged_extend_attention_pool(
            jnp.zeros((3, 2, 12)),
            jnp.zeros((1, 2, 2, 4, 1, 12)),
            0,
            jnp.zeros((1, 2), jnp.int32),
            jnp.asarray([3]),
            jnp.asarray([0, 3]),
            sm_scale=1.0,
        )
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load.cache_clear()
    try:
        assert custom_calls(16) == 0
        with pytest.raises(native.NativeBuildError, match="off"):
            native.paged_extend_attention_pool(
                jnp.zeros((3, 2, 16)),
                jnp.zeros((1, 2, 2, 4, 1, 16)),
                0,
                jnp.zeros((1, 2), jnp.int32),
                jnp.asarray([3]),
                jnp.asarray([0, 3]),
                sm_scale=1.0,
            )
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._load.cache_clear()
    assert native.available()


@pytest.mark.parametrize(
    "page_size,head_dim,heads", [(16, 64, (9, 3)), (8, 32, (4, 4)), (4, 48, (12, 1)), (16, 16, (8, 2))]
)
@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, None), (None, 7), (5.0, 40)])
def test_extend_with_sinks_equals_the_reference(page_size, head_dim, heads, soft_cap, window):
    """GQA groups (up to 12 heads on one KV head), soft cap and window over a mixed batch:
    a decode row, a fresh prompt, a chunk longer than a query block, an empty row, padding."""
    check_sinks_equal_the_reference(
        native.paged_extend_attention_pool,
        seed=page_size * 100 + head_dim + (window or 0),
        page_size=page_size,
        head_dim=head_dim,
        heads=heads,
        soft_cap=soft_cap,
        window=window,
        q_lens=(1, 37, 130, 0, 5),
        ctx_lens=(40, 0, 70, 0, 200),
        pad_tokens=3,
    )


def test_extend_without_sinks_equals_minus_inf_sinks():
    check_no_sinks_equal_minus_inf_sinks(native.paged_extend_attention_pool, (20, 1, 0, 70), (0, 30, 0, 50), 3)


def test_extend_traced_sinks_under_a_scan():
    check_traced_sinks_under_a_scan(native.paged_extend_attention_pool, (20, 3, 1), (30, 64, 9), pad_tokens=2)


def test_extend_sinks_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\) \(one per query head\), got \(3,\)"):
        native.paged_extend_attention_pool(
            jnp.zeros((3, 2, 16)),
            jnp.zeros((1, 2, 2, 4, 1, 16)),
            0,
            jnp.zeros((1, 2), jnp.int32),
            jnp.asarray([3]),
            jnp.asarray([0, 3]),
            sm_scale=1.0,
            sinks=jnp.zeros(3),
        )[0].block_until_ready()


def test_the_cpu_backend_passes_sinks_to_the_extend_kernel_and_the_xla_attention(monkeypatch):
    """``cpu_paged_attention_pool`` on an extend with sinks: the native extend (a custom
    call) on a float32 pool, the block-causal XLA attention with the kernels off; both
    equal the reference."""
    rng = np.random.default_rng(4)
    args, _ = make_batch(
        rng,
        page_size=16,
        q_lens=(3, 1, 0),
        ctx_lens=(9, 20, 0),
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        pad_tokens=2,
        dtype=jnp.float32,
    )
    q, k, v, table, seq_lens, qs = args
    pool, sinks = nan_pool(k, v), make_sinks(rng, 8)
    options = dict(sm_scale=0.25, soft_cap=5.0, sliding_window=7)
    n = int(qs[-1])

    def attention(p, s):
        return native.cpu_paged_attention_pool(q, p, 1, table, seq_lens, qs, sinks=s, **options)[0]

    want = np.asarray(ragged_paged_attention_pool_reference(q, pool, 1, table, seq_lens, qs, sinks=sinks, **options)[0])
    fn = jax.jit(attention)
    assert fn.lower(pool, sinks).as_text().count(native._EXTEND_TARGET) == 1
    np.testing.assert_allclose(np.asarray(fn(pool, sinks))[:n], want[:n], atol=2e-5, rtol=2e-5)
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load.cache_clear()
    try:
        fallback = jax.jit(lambda p, s: attention(p, s))  # a new function, traced again: kernels off
        assert fallback.lower(pool, sinks).as_text().count(native._EXTEND_TARGET) == 0
        np.testing.assert_allclose(np.asarray(fallback(pool, sinks))[:n], want[:n], atol=2e-5, rtol=2e-5)
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._load.cache_clear()
    assert native.available()


# One mixed batch per shape (SmolLM2's heads, Gemma 3's head_dim 256 on one KV head, a
# 48-dim head: a 32- and a 16-dim values tile at 512 bits), windows and a soft cap, all
# crossing 96-key and 192-row blocks; computed in a subprocess that builds the kernels at
# one vector width, then compared here with the brute force.
_WIDTH_CASES = (
    dict(page_size=16, head_dim=64, heads=(9, 3), soft_cap=None, window=None),
    dict(page_size=16, head_dim=256, heads=(4, 1), soft_cap=None, window=100),
    dict(page_size=8, head_dim=48, heads=(6, 2), soft_cap=5.0, window=None),
)
_WIDTH_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_native_decode import nan_pool
from test_pallas_attention import make_batch
import jax.numpy as jnp
from pallas_kernels import native
assert native.available(), native.status()
outputs = {"bits": native.vector_bits()}
for i, case in enumerate(json.loads(sys.argv[2])):
    args, _ = make_batch(np.random.default_rng(i), page_size=case["page_size"], q_lens=(1, 150, 0, 40),
                         ctx_lens=(300, 0, 0, 230), num_q_heads=case["heads"][0], num_kv_heads=case["heads"][1],
                         head_dim=case["head_dim"], pad_tokens=2, dtype=jnp.float32)
    q, k, v, table, seq_lens, qs = args
    got = native.paged_extend_attention_pool(q, nan_pool(k, v), 1, table, seq_lens, qs, sm_scale=0.2,
                                             soft_cap=case["soft_cap"], sliding_window=case["window"])[0]
    np.save(sys.argv[3] + f"/{i}.npy", np.asarray(got))
print(json.dumps(outputs))
"""


@pytest.mark.parametrize("bits", native.VECTOR_WIDTHS)
def test_each_vector_width_equals_brute_force(bits, tmp_path):
    """The extend kernel built at 256 bits (forced, as on an AVX2 CPU) and at 512 (AVX-512,
    where this CPU has it) against the float64 brute force, each in its own process (a
    process loads one build)."""
    if bits == 512 and not native.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512F: the 512-bit build cannot run here (it is compiled below)")
    tests_dir = str(Path(__file__).parent)
    env = {**os.environ, native.WIDTH_ENV_VAR: str(bits)}
    done = subprocess.run(
        [sys.executable, "-c", _WIDTH_SCRIPT, tests_dir, json.dumps(_WIDTH_CASES), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["bits"] == bits
    for i, case in enumerate(_WIDTH_CASES):
        _, host = make_batch(
            np.random.default_rng(i),
            page_size=case["page_size"],
            q_lens=(1, 150, 0, 40),
            ctx_lens=(300, 0, 0, 230),
            num_q_heads=case["heads"][0],
            num_kv_heads=case["heads"][1],
            head_dim=case["head_dim"],
            pad_tokens=2,
            dtype=jnp.float32,
        )
        got = np.load(tmp_path / f"{i}.npy")
        n = int(host[5][-1])
        np.testing.assert_array_equal(got[n:], 0.0)
        want = brute_force(*host, 0.2, case["soft_cap"], case["window"])
        np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5, err_msg=f"{bits}-bit, case {case}")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX-512 is an x86 instruction set")
def test_the_512_bit_build_compiles_on_any_x86_host(tmp_path):
    """The AVX-512 code (16-float vectors) compiles whether or not this CPU could run it,
    so a change cannot break it unseen on AVX2 machines; and forcing it on a CPU without
    AVX-512F is refused by name."""
    cxx = native.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = [f for f in native.FLAGS if f not in ("-shared", "-fPIC")]
    command = [cxx, *flags, "-mavx512f", "-DSTRATA_VECTOR_BITS=512", f"-I{jax.ffi.include_dir()}", "-c"]
    for source in native.SOURCES:
        done = subprocess.run([*command, str(source), "-o", str(tmp_path / (source.stem + ".o"))], capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    if not native.cpu_has_avx512():
        os.environ[native.WIDTH_ENV_VAR] = "512"
        try:
            with pytest.raises(native.NativeBuildError, match="needs a CPU with AVX-512F"):
                native.build_flags()
        finally:
            del os.environ[native.WIDTH_ENV_VAR]
    with pytest.MonkeyPatch.context() as m:
        m.setenv(native.WIDTH_ENV_VAR, "384")
        with pytest.raises(native.NativeBuildError, match="must be one of"):
            native.build_flags()


def test_the_rate_benchmark_runs_both_kernels(tmp_path):
    """``scripts/bench_native_rate.py`` on small cases: an extend and both decode layouts,
    each printing its number (the script the docs' kernel tables come from)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_native_rate.py"
    done = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "smollm2@64", "shared@2", "own@2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("extend smollm2@64: ") and "% of the matmul rate" in line for line in lines), lines
    for case in ("shared@2", "own@2"):
        assert any(line.startswith(f"decode {case}: ") and line.endswith(")") for line in lines), lines
