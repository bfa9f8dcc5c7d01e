"""Whole step executables across starts (runtime/executable_cache.py): a second warm-up
reads every step program back without tracing or compiling and computes exactly what
a freshly compiled one does; anything that could change the program is another key."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import jax
import numpy as np
import pytest

from strata_jax.models.config import ModelConfig
from strata_jax.models.weights import random_model
from strata_jax.runtime import compilation_cache
from strata_jax.runtime.executable_cache import ExecutableCache, environment_fingerprint, source_fingerprint
from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

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
RUNNER = RunnerConfig(page_size=4, num_device_pages=16, max_batch_tokens=16, max_batch_size=2, max_context_tokens=32)


def _runner(config: ModelConfig = CONFIG, runner_config: RunnerConfig = RUNNER, *, fresh: bool = True) -> ModelRunner:
    if fresh:
        jax.clear_caches()  # as a fresh process would start: nothing traced or compiled in memory
    return ModelRunner(random_model(config), runner_config)


def _warm(cache: ExecutableCache, config: ModelConfig = CONFIG, runner_config: RunnerConfig = RUNNER):
    runner = _runner(config, runner_config)
    before = compilation_cache.COUNTER.snapshot()
    runner.warmup(show_progress=False, executables=cache)
    return runner, compilation_cache.COUNTER.snapshot().minus(before)


def _steps(runner: ModelRunner) -> list:
    """An extend of two prompts then two decodes, sampled with temperature and asking for
    logprobs; on a warmed-up runner every one runs on a warm-up program (no jit fallback)."""
    out = []
    prefill = runner.step(
        [
            SeqInput(list(range(1, 8)), 0, [0, 1], temperature=0.9, rng_key=(1, 2), logprobs=True),
            SeqInput(list(range(9, 13)), 0, [2], logprobs=True),
        ]
    )
    out.append(prefill)
    tokens = [int(t) for t in prefill.next_tokens]
    for step in range(2):
        decode = runner.step(
            [
                SeqInput([tokens[0]], 7 + step, [0, 1, 3], temperature=0.9, rng_key=(3, step), logprobs=True),
                SeqInput([tokens[1]], 4 + step, [2, 4], logprobs=True),
            ]
        )
        out.append(decode)
        tokens = [int(t) for t in decode.next_tokens]
    if runner._compiled:  # a warmed-up runner: nothing went through jit
        assert runner.compile_count == len(runner.program_shapes)
    return out


def _assert_same(a: list, b: list, *, rtol: float = 0.0) -> None:
    """Same tokens; same logprobs, bit for bit unless ``rtol``."""
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.next_tokens, y.next_tokens)
        for u, v in zip(x.sample_logprobs, y.sample_logprobs, strict=True):
            np.testing.assert_allclose(u, v, rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def stored_entries(tmp_path_factory):
    """A directory of entries from one cold warm-up (with its runner's step results),
    copied by the tests that start from a filled cache."""
    compilation_cache.configure("none")
    directory = tmp_path_factory.mktemp("stored")
    runner, _counts = _warm(ExecutableCache(directory))
    return directory, _steps(runner)


def _filled(stored_entries, tmp_path) -> tuple:
    directory, expected = stored_entries
    target = tmp_path / "entries"
    shutil.copytree(directory, target)
    return target, expected


@pytest.fixture
def no_xla_cache():
    compilation_cache.configure("none")  # compiles count as compiles, not as XLA cache reads
    yield


def test_second_warmup_reads_every_program_back_and_computes_the_same(tmp_path, no_xla_cache):
    steps = len(_runner().program_shapes)
    cold_cache = ExecutableCache(tmp_path)
    cold_runner, cold = _warm(cold_cache)
    assert cold_cache.stored == steps and cold_cache.loaded == 0
    writers = 1 + cold_runner.seqs.warmup_programs  # the sampling and sequence tables' row and mask writers (plain jit)
    assert cold.requests == steps + writers
    assert len(list(tmp_path.glob("*.exe"))) == steps
    expected = _steps(cold_runner)

    warm_cache = ExecutableCache(tmp_path)
    warm_runner, warm = _warm(warm_cache)
    assert warm_cache.loaded == steps and warm_cache.stored == 0
    assert warm.requests == writers  # only the row writers: no step program reached XLA
    pool_before = warm_runner.pool.kv
    got = _steps(warm_runner)
    assert pool_before.is_deleted()  # the read-back programs still donate the pool (updated in place)
    _assert_same(got, expected)

    # and the same as a runner that never saw the cache
    _assert_same(_steps(_runner()), expected)


@pytest.mark.heavy  # 20-50 s on 2 cores; the default suite stays near 15 min
def test_a_program_read_from_the_xla_cache_is_not_stored(tmp_path):
    """XLA:CPU re-serializes an executable it read from its own cache without all its
    functions: stored and read back by a third start, such a copy failed with "Function
    wrapped_iota not found" (found by running the demo twice over an older XLA cache)."""
    compilation_cache.configure(str(tmp_path / "xla"))
    try:
        xla_only = _runner()
        xla_only.warmup(show_progress=False)  # fills XLA's cache alone
        expected = _steps(xla_only)
        second = ExecutableCache(tmp_path / "executables")
        _warm(second)
        assert second.stored == 0 and second.not_stored == len(xla_only.program_shapes)
        third = ExecutableCache(tmp_path / "executables")
        runner, counts = _warm(third)
        assert third.loaded == 0 and counts.cache_hits == len(runner.program_shapes) + 1 + runner.seqs.warmup_programs
        _assert_same(_steps(runner), expected)
    finally:
        compilation_cache.configure("none")


@pytest.mark.heavy  # 20-50 s on 2 cores; the default suite stays near 15 min
def test_a_tensor_parallel_runner_reads_its_programs_back_onto_its_devices(tmp_path, no_xla_cache):
    from strata_jax.runtime.sharding import make_mesh, pool_sharding

    def tp_runner(devices) -> ModelRunner:
        jax.clear_caches()
        mesh = make_mesh(2, devices)
        return ModelRunner(random_model(CONFIG), RUNNER, mesh=mesh)

    cold_cache = ExecutableCache(tmp_path)
    cold = tp_runner(jax.devices()[:2])
    cold.warmup(show_progress=False, executables=cold_cache)
    expected = _steps(cold)
    warm_cache = ExecutableCache(tmp_path)
    warm = tp_runner(jax.devices()[:2])
    warm.warmup(show_progress=False, executables=warm_cache)
    assert warm_cache.loaded == len(warm.program_shapes) == cold_cache.stored
    got = _steps(warm)
    assert warm.pool.kv.sharding.is_equivalent_to(pool_sharding(warm.mesh), 6)
    _assert_same(got, expected)
    # the single-device runner's tokens; logprobs to float32 rounding (sums split over 2 shards)
    _assert_same(got, _steps(_runner()), rtol=1e-5)
    # the same program on two other devices is another mesh: another key, not a reuse
    other = tp_runner(jax.devices()[2:4])
    assert not set(other.executable_keys().values()) & set(warm.executable_keys().values())


def test_another_model_or_runner_config_is_another_key():
    base = _runner(fresh=False).executable_keys()
    assert len(set(base.values())) == len(base)  # one per program
    assert _runner(fresh=False).executable_keys() == base  # a second start: the same keys
    variants = [
        (ModelConfig(**{**CONFIG.__dict__, "num_layers": 3}), RUNNER),  # other weights' shapes
        (ModelConfig(**{**CONFIG.__dict__, "rope_theta": 5000.0}), RUNNER),  # same shapes, other program
        (ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": not CONFIG.tie_word_embeddings}), RUNNER),
        (CONFIG, RunnerConfig(**{**RUNNER.__dict__, "num_device_pages": 24})),  # other pool
        (CONFIG, RunnerConfig(**{**RUNNER.__dict__, "kv_dtype": "bfloat16"})),
        (CONFIG, RunnerConfig(**{**RUNNER.__dict__, "scan_layers": False})),
        (CONFIG, RunnerConfig(**{**RUNNER.__dict__, "kernel_backend": "interpret"})),
    ]
    seen = set(base.values())
    for model_config, runner_config in variants:
        keys = set(_runner(model_config, runner_config, fresh=False).executable_keys().values())
        assert not keys & seen, (model_config, runner_config)
        seen |= keys


@pytest.mark.heavy  # 20-50 s on 2 cores; the default suite stays near 15 min
def test_an_unreadable_entry_is_compiled_again_and_overwritten(stored_entries, tmp_path, no_xla_cache, caplog):
    tmp_path, expected = _filled(stored_entries, tmp_path)
    entries = sorted(tmp_path.glob("*.exe"))
    entries[0].write_bytes(entries[0].read_bytes()[:1000])  # truncated, as by a full disk
    entries[1].write_bytes(b"not a pickle at all")
    cache = ExecutableCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="strata_jax.runtime.executable_cache"):
        runner, _counts = _warm(cache)
    assert cache.loaded == len(entries) - 2 and cache.stored == 2
    assert sum("unreadable" in r.getMessage() for r in caplog.records) == 2
    _assert_same(_steps(runner), expected)
    again = ExecutableCache(tmp_path)
    _warm(again)
    assert again.loaded == len(entries) and again.stored == 0  # rewritten whole
    assert not list(tmp_path.glob("*.tmp"))


def test_source_fingerprint_sees_every_change_of_a_python_file(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    (root / "notes.txt").write_text("not code")
    seen = {source_fingerprint([root])}

    def changed() -> None:
        fp = source_fingerprint([root])
        assert fp not in seen
        seen.add(fp)

    (root / "a.py").write_text("x = 2\n")
    changed()
    (root / "sub" / "c.py").write_text("")
    changed()
    (root / "sub" / "c.py").rename(root / "c.py")
    changed()
    shutil.copytree(root, tmp_path / "copy")
    assert source_fingerprint([tmp_path / "copy"]) != source_fingerprint([root])  # another root name
    (root / "notes.txt").write_text("edited")  # not Python: same program
    assert source_fingerprint([root]) in seen


def test_environment_fingerprint_follows_jax_config_but_not_cache_or_logging(tmp_path):
    base = environment_fingerprint()
    old_precision, old_log = jax.config.jax_default_matmul_precision, jax.config.jax_log_compiles
    try:
        jax.config.update("jax_log_compiles", not old_log)
        assert environment_fingerprint() == base
        jax.config.update("jax_default_matmul_precision", "highest")
        assert environment_fingerprint() != base
    finally:
        jax.config.update("jax_default_matmul_precision", old_precision)
        jax.config.update("jax_log_compiles", old_log)
    assert environment_fingerprint() == base


def test_engine_keeps_executables_beside_the_xla_cache_and_can_be_told_not_to(tmp_path):
    from strata_jax.engine import Engine, EngineConfig
    from strata_jax.runtime import executable_cache

    kwargs = dict(
        model="tiny",
        show_progress=False,
        max_batch_tokens=32,
        max_batch_size=2,
        device_tokens=256,
        max_context_tokens=64,
    )
    config = EngineConfig(**kwargs, compilation_cache_dir=str(tmp_path))
    directory = compilation_cache.resolve(str(tmp_path)) / executable_cache.SUBDIR
    try:
        first = Engine(config, start=False)
        entries = {p: p.stat().st_mtime_ns for p in directory.glob("*.exe")}
        assert first.executables_reused == 0 and len(entries) == len(first.runner.program_shapes)
        second = Engine(config, start=False)
        assert second.executables_reused == len(second.runner.program_shapes)
        assert second.cache_stats()["startup_executables_reused"] == second.executables_reused
        assert second.cache_stats()["startup_xla"]["compiled"] == 0
        entries = {p: p.stat().st_mtime_ns for p in directory.glob("*.exe")}  # reads refresh the mtime
        off = Engine(dataclasses.replace(config, reuse_executables=False), start=False)
        assert off.executables_reused == 0
        assert off.cache_stats()["startup_xla"]["cache_hits"] >= len(
            off.runner.program_shapes
        )  # traced, read from XLA's cache
        assert {p: p.stat().st_mtime_ns for p in directory.glob("*.exe")} == entries  # neither read nor written
    finally:
        compilation_cache.configure("none")


def test_least_recently_used_entries_go_beyond_the_size_cap(tmp_path):
    import os

    compiled = jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32)).compile()
    old = []
    for i in range(3):  # entries of earlier code versions, used at t = 1000, 2000, 3000
        path = tmp_path / f"old{i}.exe"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 * (i + 1), 1000 * (i + 1)))
        old.append(path)
    probe = ExecutableCache(tmp_path / "probe")
    assert probe.store("k", compiled)
    size = probe.path("k").stat().st_size
    cache = ExecutableCache(tmp_path, max_bytes=size + 1500)
    os.utime(old[0], (5000, 5000))  # read recently: kept over the newer-written old[1], old[2]
    assert cache.store("new", compiled)
    assert [p.exists() for p in old] == [True, False, False]
    np.testing.assert_array_equal(
        cache.load("new", compiled.in_tree)(np.ones(4, np.float32)), np.full(4, 2.0, np.float32)
    )


def test_nothing_is_stored_once_the_code_changed_on_disk_after_import(tmp_path, monkeypatch, no_xla_cache, caplog):
    from strata_jax.runtime import executable_cache

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "model.py").write_text("LAYERS = 2\n")
    monkeypatch.setattr(executable_cache, "_code_roots", lambda: [package])
    monkeypatch.setattr(executable_cache, "_loaded_code", executable_cache.source_fingerprint([package]))
    cache = ExecutableCache(tmp_path / "executables")
    (package / "model.py").write_text("LAYERS = 3\n")  # edited (or a branch checked out) mid-run
    with caplog.at_level(logging.WARNING, logger="strata_jax.runtime.executable_cache"):
        _warm(cache)
    assert cache.stored == 0 and not list((tmp_path / "executables").glob("*.exe"))
    assert any("changed on disk" in r.getMessage() for r in caplog.records)
    (package / "model.py").unlink()
    (package / ".#model.py").symlink_to(package / "gone.py")  # an editor's dangling lock file
    assert executable_cache.source_fingerprint([package]) is None and not executable_cache.code_unchanged()


def test_entries_of_another_program_or_that_do_not_load_are_misses(stored_entries, tmp_path, no_xla_cache, caplog):
    import os
    import pickle

    tmp_path, _expected = _filled(stored_entries, tmp_path)
    runner = _runner(fresh=False)
    keys = runner.executable_keys()
    first, second, third = (ExecutableCache(tmp_path).path(keys[shape]) for shape in runner.program_shapes)
    before = third.stat().st_mtime_ns
    os.utime(third, ns=(before - 10**9, before - 10**9))
    second.write_bytes(first.read_bytes())  # another program's entry under this key
    entry = pickle.loads(first.read_bytes())
    first.write_bytes(pickle.dumps({**entry, "executable": b"\x80\x04garbage"}))  # a valid pickle that does not load
    cache = ExecutableCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="strata_jax.runtime.executable_cache"):
        runner, _counts = _warm(cache)
    assert cache.loaded == 1 and cache.stored == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("is not this program's" in m for m in messages) and any("does not load" in m for m in messages)
    assert third.stat().st_mtime_ns > before - 10**9  # read: marked recently used
    _steps(runner)


def test_a_read_back_program_that_fails_on_the_device_leaves_the_cache(stored_entries, tmp_path, no_xla_cache, caplog):
    tmp_path, _expected = _filled(stored_entries, tmp_path)
    cache = ExecutableCache(tmp_path)
    runner, _counts = _warm(cache)
    shape = runner.program_shapes[-1]  # the extend program
    entry = cache.path(runner.executable_keys()[shape])

    def failing(*_args):
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function wrapped_iota not found (type id: 1)")

    runner._compiled[shape] = failing  # stands in for a broken read-back executable
    with (
        caplog.at_level(logging.WARNING, logger="strata_jax.runtime.executable_cache"),
        pytest.raises(jax.errors.JaxRuntimeError),
    ):
        runner.step([SeqInput(list(range(1, 8)), 0, [0, 1])])
    assert not entry.exists() and any("failed when run" in r.getMessage() for r in caplog.records)
    assert len(list(tmp_path.glob("*.exe"))) == len(runner.program_shapes) - 1  # the others stay


@pytest.mark.heavy  # 20-50 s on 2 cores; the default suite stays near 15 min
def test_engine_starts_without_the_executable_cache_when_its_directory_cannot_be_made(tmp_path, caplog):
    from strata_jax.engine import Engine, EngineConfig
    from strata_jax.runtime import executable_cache

    directory = compilation_cache.resolve(str(tmp_path))
    directory.mkdir(parents=True)
    (directory / executable_cache.SUBDIR).write_text("a file where the directory would go")
    config = EngineConfig(
        model="tiny",
        show_progress=False,
        max_batch_tokens=32,
        max_batch_size=2,
        device_tokens=256,
        max_context_tokens=64,
        compilation_cache_dir=str(tmp_path),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="strata_jax.runtime.executable_cache"):
            engine = Engine(config, start=False)
        assert engine.executables_reused == 0 and engine.is_ready
        assert any("executable cache off" in r.getMessage() for r in caplog.records)
    finally:
        compilation_cache.configure("none")
