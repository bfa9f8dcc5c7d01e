"""Dispatch picks the implementation per platform; config and env override it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.attention import ragged_paged_attention_pallas
from pallas_kernels.reference import ragged_paged_attention_reference, scatter_pages_reference
from pallas_kernels.transfer import scatter_pages_pallas


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


@pytest.mark.parametrize("platform,want", [("cpu", "xla"), ("cuda", "pallas"), ("rocm", "pallas"), ("tpu", "xla")])
def test_platform_defaults(platform, want):
    assert dispatch.resolve_backend(platform=platform) == want
    assert dispatch.resolve_backend("auto", platform=platform) == want


def test_this_machine_is_cpu_and_uses_the_xla_backend():
    from pallas_kernels.blocked import blocked_paged_attention

    assert dispatch.platform_name() == "cpu"
    assert dispatch.get_implementation("scatter_pages") is scatter_pages_reference
    assert dispatch.get_implementation("ragged_paged_attention") is blocked_paged_attention
    assert dispatch.get_implementation("ragged_paged_attention", "reference") is ragged_paged_attention_reference


def test_env_overrides_auto_but_not_an_explicit_choice(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "interpret")
    assert dispatch.resolve_backend(platform="cuda") == "interpret"
    assert dispatch.resolve_backend(dispatch.KernelConfig("auto"), platform="cpu") == "interpret"
    assert dispatch.resolve_backend("reference", platform="cuda") == "reference"
    assert dispatch.resolve_backend(dispatch.KernelConfig("pallas")) == "pallas"
    assert dispatch.get_implementation("scatter_pages", "pallas") is scatter_pages_pallas


def test_use_backend_scope_sits_between_explicit_choice_and_env(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    with dispatch.use_backend("interpret"):
        assert dispatch.resolve_backend(platform="cuda") == "interpret"  # beats env and platform
        assert dispatch.resolve_backend("pallas") == "pallas"  # an explicit argument still wins
        with dispatch.use_backend("auto"):  # "auto" defers to env / platform again
            assert dispatch.resolve_backend(platform="cuda") == "reference"
        assert dispatch.resolve_backend() == "interpret"
    assert dispatch.resolve_backend(platform="cuda") == "reference"  # scope restored on exit
    with pytest.raises(dispatch.UnknownBackendError), dispatch.use_backend("triton"):
        pass


def test_use_backend_does_not_leak_into_other_threads():
    import threading

    seen = []
    with dispatch.use_backend("interpret"):
        worker = threading.Thread(target=lambda: seen.append(dispatch.resolve_backend(platform="cuda")))
        worker.start()
        worker.join()
    assert seen == ["pallas"]


def test_bad_names_raise(monkeypatch):
    with pytest.raises(dispatch.UnknownBackendError):
        dispatch.KernelConfig("triton")
    with pytest.raises(dispatch.UnknownBackendError):
        dispatch.resolve_backend("cuda")
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(dispatch.UnknownBackendError):
        dispatch.resolve_backend()
    with pytest.raises(KeyError):
        dispatch.get_implementation("matmul", "reference")


def test_every_op_has_every_concrete_backend():
    for op in dispatch.operations():
        for backend in ("xla", "reference", "pallas", "interpret"):
            assert callable(dispatch.get_implementation(op, backend))


def test_auto_falls_back_to_xla_for_untileable_head_dim(monkeypatch):
    # head_dim 12 cannot be tiled by Triton: "auto" on a GPU platform falls back, an explicit "pallas" raises.
    monkeypatch.setattr(dispatch, "platform_name", lambda: "cuda")
    q = jnp.ones((2, 2, 12))
    k = jnp.ones((4, 2, 1, 12))
    table = jnp.zeros((1, 2), jnp.int32)
    seq_lens, qs = jnp.asarray([2], jnp.int32), jnp.asarray([0, 2], jnp.int32)
    out = dispatch.ragged_paged_attention(q, k, k, table, seq_lens, qs, sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(out), 1.0)
    with pytest.raises(ValueError):
        dispatch.ragged_paged_attention(q, k, k, table, seq_lens, qs, sm_scale=1.0, backend="pallas")
    assert ragged_paged_attention_pallas is dispatch.get_implementation("ragged_paged_attention", "pallas")
