"""The persistent compilation cache: on by default under the user's cache directory,
a second start of the same runner compiles nothing, another model never reuses a program."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from strata_jax.engine.config import EngineConfig
from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import random_model
from strata_jax.runtime import compilation_cache
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
RUNNER = RunnerConfig(
    page_size=4, num_device_pages=16, max_batch_tokens=16, max_batch_size=1, max_context_tokens=32
)  # 2 programs


@pytest.fixture
def restore_cache_setting():
    yield
    compilation_cache.configure("none")


def test_default_directory_and_off_switch(monkeypatch, tmp_path):
    assert EngineConfig().compilation_cache_dir == "auto"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    auto = compilation_cache.resolve("auto")
    assert auto.parent == tmp_path / "strata-jax" / "xla" and jax.__version__ in auto.name
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compilation_cache.resolve("auto").parent == Path.home() / ".cache" / "strata-jax" / "xla"
    for off in ("none", "None", "off", "", None):
        assert compilation_cache.resolve(off) is None
    assert compilation_cache.resolve(str(tmp_path / "x")).parent == tmp_path / "x"


def _warm(model_config: ModelConfig) -> compilation_cache.CompileCounts:
    jax.clear_caches()  # as a fresh process would start: nothing compiled in memory
    runner = ModelRunner(random_model(model_config), RUNNER)
    before = compilation_cache.COUNTER.snapshot()
    runner.warmup(show_progress=False)
    return compilation_cache.COUNTER.snapshot().minus(before)


def test_second_start_compiles_nothing_and_other_models_do_not_reuse(tmp_path, restore_cache_setting):
    compilation_cache.configure(str(tmp_path))
    probe = ModelRunner(random_model(CONFIG), RUNNER)
    steps = len(probe.program_shapes)
    writers = (
        1 + probe.seqs.warmup_programs
    )  # the sampling table's and the sequence tables' row and mask writers, compiled at warm-up too
    programs = steps + writers
    cold = _warm(CONFIG)
    assert cold.requests == programs and cold.compiled == programs and cold.cache_hits == 0
    assert any(compilation_cache.resolve(str(tmp_path)).iterdir())  # entries were written
    warm = _warm(CONFIG)
    assert warm.requests == programs and warm.compiled == 0 and warm.cache_hits == programs
    # Other weights' shapes: every step program is new.  The row writers depend only on the
    # vocabulary, slot counts and page-table width, which are the same, so they alone may be reused.
    deeper = _warm(ModelConfig(**{**CONFIG.__dict__, "num_layers": 3}))
    assert deeper.requests == programs and deeper.compiled == steps and deeper.cache_hits == writers
