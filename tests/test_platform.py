"""Per-platform defaults (strata_jax.runtime.platform) and `strata-jax info`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import dispatch, native
from strata_jax.runtime.platform import CPU_CONTEXT_CAP, defaults_for, resolve

REPO = Path(__file__).resolve().parents[1]


def test_defaults_per_platform():
    cpu, cuda, rocm = defaults_for("cpu"), defaults_for("cuda"), defaults_for("rocm")
    assert (cpu.dtype, cpu.kv_dtype, cpu.kernel_backend, cpu.host_memory_kind) == (
        "float32",
        "float32",
        "xla",
        "unpinned_host",
    )
    assert cpu.max_context_cap == CPU_CONTEXT_CAP
    for gpu in (cuda, rocm):
        assert (gpu.dtype, gpu.kv_dtype, gpu.kernel_backend, gpu.host_memory_kind) == (
            "bfloat16",
            "bfloat16",
            "pallas",
            "pinned_host",
        )
        assert gpu.max_context_cap is None
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        defaults_for("metal")


def test_resolve_applies_explicit_choices_over_defaults(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    here = resolve()
    assert here.platform == "cpu" and here.kv_dtype == "float32" and here.kernel_backend == "xla"
    gpu = resolve(platform="cuda", kv_dtype="float32", kernel_backend="interpret")
    assert (gpu.dtype, gpu.kv_dtype, gpu.kernel_backend) == ("bfloat16", "float32", "interpret")
    monkeypatch.setenv(dispatch.ENV_VAR, "interpret")  # "auto" defers to the environment, as dispatch does
    assert resolve().kernel_backend == "interpret"
    assert here.max_context_tokens(32768, None) == CPU_CONTEXT_CAP
    assert resolve(platform="rocm").max_context_tokens(32768, None) == 32768
    assert here.max_context_tokens(32768, 100) == 100
    with pytest.raises(
        ValueError, match="kv_dtype must be one of float32, bfloat16, float8_e4m3fn \\(or fp8\\), got .float16."
    ):
        resolve(kv_dtype="float16")


def test_cpu_kv_default_avoids_xla_cpu_bf16_pool_rewrite():
    """The reason the CPU KV default is float32: XLA:CPU lowers an in-place update of a bf16
    buffer as convert(whole buffer) -> update -> convert back; an f32 buffer is updated in place."""
    shape = (4096, 64)

    def full_buffer_converts(dtype) -> int:
        f = jax.jit(lambda pool, i, v: pool.at[i].set(v), donate_argnums=0)
        hlo = (
            f.lower(
                jax.ShapeDtypeStruct(shape, dtype),
                jax.ShapeDtypeStruct((8,), jnp.int32),
                jax.ShapeDtypeStruct((8, 64), dtype),
            )
            .compile()
            .as_text()
        )
        return sum(1 for line in hlo.splitlines() if " convert(" in line and "[4096,64]" in line)

    assert full_buffer_converts(jnp.float32) == 0
    assert full_buffer_converts(jnp.bfloat16) > 0


def test_engine_takes_its_defaults_from_the_platform_module():
    from strata_jax.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(warmup=False, show_progress=False), start=False)
    try:
        expected = defaults_for("cpu")
        assert engine.platform.defaults == expected
        assert engine.runner.kv_pool.dtype == jnp.dtype(expected.kv_dtype)
        assert engine.runner.kernel_backend == expected.kernel_backend
        assert engine.max_context_tokens == min(engine.model_config.max_context_tokens, CPU_CONTEXT_CAP)
    finally:
        engine.shutdown()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_info_json_reports_devices_versions_and_choices():
    proc = _cli("info", "--json", "--check-lowering")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["versions"]["jax"] == jax.__version__
    assert len(info["devices"]) == jax.device_count()  # the session's XLA_FLAGS reach the subprocess
    assert all("device" in d["memory_kinds"] for d in info["devices"])
    assert info["chosen"]["defaults"] == defaults_for("cpu").to_dict()
    assert info["chosen"]["kernels"]["ragged_paged_attention_pool"].endswith("native.cpu_paged_attention_pool")
    assert info["chosen"]["native_kernels"] == native.status()  # "on (path)" here, or why not
    for platform in ("cuda", "rocm"):
        col = info["would_choose"][platform]
        assert col["defaults"] == defaults_for(platform).to_dict()
        assert col["kernels"]["scatter_pages"].endswith("scatter_pages_pallas")
        assert col["lowering"] == {op: "ok" for op in ("ragged_paged_attention_pool", "scatter_pages", "gather_pages")}


def test_info_text():
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "chosen here (cpu)" in proc.stdout
        and "would choose on cuda" in proc.stdout
        and "would choose on rocm" in proc.stdout
    )
    assert f"jax {jax.__version__}" in proc.stdout
