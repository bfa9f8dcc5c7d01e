"""Shared pytest setup: CPU-only by default, several host devices for mesh tests."""

from __future__ import annotations

import os
import sys

# Must be set before jax is imported anywhere in the test session.
os.environ.setdefault("JAX_PLATFORMS", "cpu" if not os.environ.get("STRATA_TEST_GPU") else "")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU (set STRATA_TEST_GPU=1 on a GPU machine)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real model (SmolLM2-135M-Instruct, Q4_1 GGUF), fetched once; skips when it cannot be."""
    pytest.importorskip("gguf", reason="the real-model tests need the gguf extra: pip install -e '.[gguf]'")
    from real_model import FetchError, smollm2_gguf_path

    try:
        return str(smollm2_gguf_path())
    except FetchError as exc:
        pytest.skip(f"real model unavailable: {exc}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    harness = sys.modules.get("serving_harness")
    if harness is not None:
        harness.stop_shared_server()
