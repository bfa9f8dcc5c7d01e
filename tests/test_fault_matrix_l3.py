"""Fault matrix, L3 file backend: faults a user meets on the storage directory, each against
the real server (tiny engine, tiers L1+L2+L3) where the user would meet it.

One in-process server for the module (``serving_harness.start_server``), its L3 a file store
wrapped in ``fault_backends.FaultBackend`` (registered as ``fault-file``; a pass-through
unless a test switches a fault on) in ``<tmpfs>/l3``: a tmpfs is mounted for the store when
this sandbox allows it (disk full = a filler file fills it; read-only = ``mount -o
remount,ro``; root ignores permission bits, so ``chmod`` would test nothing), else those two
rows inject ``ENOSPC`` / ``EROFS`` through the wrapper.  Plus the exact user sequence as
``strata-jax serve`` subprocesses (``test_corrupt_store_across_restart_subprocess``).

Every test: each request 200 (no 5xx: ``strata_requests_total{status="error"}`` unchanged),
the prompt's tokens equal its cold run's on the same server (greedy; text, tokens and top-5
logprobs), no leaked page (``assert_no_leaks``: ``check_accounting`` and the pool back at its
baseline), ``/health`` 200 and a further request afterwards.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import fault_backends as fb
import httpx
import pytest
from serving_harness import assert_no_leaks, real_engine_available, start_server, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT_TOKENS = 600  # 37 full pages (592 tokens) in L3
PAGES = PROMPT_TOKENS // 16
HANG_S = 20.0  # a read that hangs this long ...
HANG_BOUND_S = 10.0  # ... must not hold the request (or the engine) for more than this


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return fb.random_prompt(seed, n)


@dataclass
class Env:
    srv: Any
    url: str
    engine: Any
    storage_dir: str
    mount: str
    mounted: bool
    fault: fb.FaultBackend
    baseline_used: int

    def stats(self) -> dict:
        return self.engine.cache_stats()

    def storage_counter(self, name: str) -> int:
        s = self.stats()
        if name == "storage_errors":
            return s["transfers"]["storage_errors"]
        return (s.get("storage") or {}).get(name, 0)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    if not real_engine_available():
        pytest.skip("needs the real engine")
    mount = str(tmp_path_factory.mktemp("l3fs"))
    mounted = fb.mount_tmpfs(mount, "64m")
    storage_dir = os.path.join(mount, "l3")
    mp = pytest.MonkeyPatch()
    built = fb.register_fault_backend(mp, "fault-file", "file")
    try:
        srv = start_server(
            max_waiting=64,
            max_running=8,
            max_context_tokens=2048,
            device_tokens=8192,
            tiers="L1+L2+L3",
            storage_backend="fault-file",
            storage_dir=storage_dir,
        )
    except BaseException:
        mp.undo()
        if mounted:
            fb.umount(mount)
        raise
    engine = srv.frontend.engine()
    wait_idle(engine)
    engine.flush_cache("all")
    env = Env(
        srv,
        srv.http_url,
        engine,
        storage_dir,
        mount,
        mounted,
        built[-1],
        engine.cache_stats()["device_pool"]["used_pages"],
    )
    yield env
    env.fault.release()
    srv.stop(30.0)
    mp.undo()
    if mounted:
        fb.remount(mount, "rw")
        fb.umount(mount)


@pytest.fixture()
def checked(env):
    """After the test: no server error, alive, no leaked page; every fault switched off."""
    errors = fb.server_errors(env.srv)
    try:
        yield env
    finally:
        env.fault.reset()
        if env.mounted:
            fb.remount(env.mount, "rw")
            filler = os.path.join(env.mount, "filler.bin")
            if os.path.exists(filler):
                os.unlink(filler)
        # the test's own repair after 1e (FileStorage does not recreate its tmp/ dir), so that
        # every row starts from a working store
        os.makedirs(os.path.join(env.storage_dir, "tmp"), exist_ok=True)
    assert fb.server_errors(env.srv) == errors, "a request ended as a server error (5xx)"
    fb.assert_alive(env.url)
    assert_no_leaks(env.engine, env.baseline_used)  # also clears L3 for the next row


def _cold(env: Env, seed: int, *, stored: bool = True) -> tuple[list[int], dict, list[str]]:
    """The prompt's cold run (nothing of it cached anywhere); with ``stored``, wait until its
    pages are in L3, then drop L1 and L2 so that L3 is the only copy."""
    prompt = _prompt(seed)
    r = fb.complete(env.url, prompt)
    assert r.status_code == 200, r.text
    assert fb.cached(r) == {"device": 0, "host": 0, "storage": 0}
    paths = fb.wait_objects(env.storage_dir, PAGES) if stored else []
    fb.flush_local_tiers(env.url)
    return prompt, fb.tokens_of(r), paths


def _after_fault(env: Env, prompt: list[int], cold: dict) -> httpx.Response:
    """The same prompt after the fault, then once more (from what the first one cached)."""
    r = fb.complete(env.url, prompt)
    fb.assert_same_tokens(r, cold)
    again = fb.complete(env.url, prompt)
    fb.assert_same_tokens(again, cold)
    return r


# ------------------------------------------------------------------------- 1a, b, c, d: damage
def test_every_object_corrupted(checked):
    """1a: 16 bytes flipped in the middle of every object, L1 and L2 flushed, the same
    prompt: recomputed, the cold tokens (first in the module: this server has measured no L3
    read yet, as after a restart).  Then L3 still serves a new prompt (the read rate the
    scheduler learned is not poisoned by reads that brought nothing)."""
    env = checked
    prompt, cold, paths = _cold(env, seed=101)
    for p in paths:
        fb.flip_middle(p)
    corrupt = env.storage_counter("corrupt")
    r = _after_fault(env, prompt, cold)
    assert fb.cached(r)["storage"] == 0
    assert env.storage_counter("corrupt") > corrupt
    # L3 works afterwards: a new prompt is written, read back and gives its cold tokens
    prompt2, cold2, _ = _cold(env, seed=102)
    r2 = fb.complete(env.url, prompt2)
    fb.assert_same_tokens(r2, cold2)
    assert fb.cached(r2)["storage"] > 0, fb.cached(r2)


@pytest.mark.parametrize(
    ("damage", "seed"),
    [
        pytest.param(lambda paths: [fb.truncate_half(p) for p in paths], 201, id="truncated"),  # 1b
        pytest.param(lambda paths: [fb.truncate_zero(p) for p in paths], 202, id="zero_length"),  # 1c
        pytest.param(fb.rotate_contents, 203, id="other_keys_object"),  # 1d
    ],
)
def test_damaged_objects(checked, damage, seed):
    """1b truncated to half, 1c zero-length, 1d each object replaced by another key's
    (intact) object: counted corrupt, recomputed, the cold tokens."""
    env = checked
    prompt, cold, paths = _cold(env, seed=seed)
    damage(paths)
    corrupt = env.storage_counter("corrupt")
    r = _after_fault(env, prompt, cold)
    assert fb.cached(r)["storage"] == 0
    assert env.storage_counter("corrupt") > corrupt


# ------------------------------------------------------------------- 1e: the directory removed
def test_directory_removed_while_serving(checked):
    """1e: ``rm -rf`` of the storage directory while serving: the stored prompt is a miss
    (recomputed, cold tokens), a new prompt is served too (whether L3 comes back is the
    next test)."""
    env = checked
    prompt, cold, _ = _cold(env, seed=301)
    shutil.rmtree(env.storage_dir)
    r = _after_fault(env, prompt, cold)
    assert fb.cached(r)["storage"] == 0
    prompt2, cold2, _ = _cold(env, seed=302, stored=False)
    fb.assert_same_tokens(fb.complete(env.url, prompt2), cold2)


def test_directory_removed_l3_comes_back(checked):
    """1e, continued: after the directory was removed, L3 should work again (a cache
    directory wiped by an operator is recreated; the pages recomputed are written again and
    read back) instead of failing every write until the server restarts."""
    env = checked
    prompt, cold, _ = _cold(env, seed=311)
    shutil.rmtree(env.storage_dir)
    fb.assert_same_tokens(fb.complete(env.url, prompt), cold)  # a miss: recomputed, written again
    try:
        fb.wait_objects(env.storage_dir, PAGES, timeout=15)
    except AssertionError as exc:
        raise AssertionError(
            f"L3 stays off after its directory was removed: {exc}; storage_errors="
            f"{env.storage_counter('storage_errors')} (FileStorage.batch_set writes into the removed tmp/ dir)"
        ) from None
    fb.flush_local_tiers(env.url)
    r = fb.complete(env.url, prompt)
    fb.assert_same_tokens(r, cold)
    assert fb.cached(r)["storage"] == PAGES * 16, fb.cached(r)


# ------------------------------------------------------------------------ 1f: read-only store
def test_read_only_store_while_serving(checked):
    """1f: the store's file system goes read-only while serving (tmpfs ``remount,ro``; else
    EROFS injected).  Reads still serve (a corrupt object that cannot be deleted is a read
    error: counted, recomputed); writes fail (counted); every answer has the cold tokens."""
    env = checked
    prompt, cold, paths = _cold(env, seed=401)
    for p in paths[len(paths) // 2 :]:
        fb.flip_middle(p)  # some objects bad: their deletion fails on a read-only store
    if env.mounted:
        fb.remount(env.mount, "ro")
        with pytest.raises(OSError) as exc:
            open(os.path.join(env.storage_dir, "probe"), "wb")
        assert exc.value.errno == errno.EROFS
    else:
        env.fault.set_error = OSError(errno.EROFS, "Read-only file system (injected: tmpfs mounts not permitted)")
    r = _after_fault(env, prompt, cold)
    assert fb.cached(r)["storage"] < PAGES * 16
    errors = env.storage_counter("storage_errors")
    prompt2, cold2, _ = _cold(env, seed=402, stored=False)
    fb.wait_for(lambda: env.storage_counter("storage_errors") > errors, "the failed L3 writes are counted")
    r2 = fb.complete(env.url, prompt2)
    fb.assert_same_tokens(r2, cold2)
    assert fb.cached(r2)["storage"] == 0


# ------------------------------------------------------------------------------ 1g: disk full
def test_disk_full(checked):
    """1g: the store's file system is full (a filler file fills the tmpfs; else ENOSPC
    injected): writes fail (counted), requests are answered with the cold tokens; once
    space is freed, L3 is written and read again."""
    env = checked
    errors = env.storage_counter("storage_errors")
    if env.mounted:
        fb.fill_disk(env.mount)
    else:
        env.fault.set_error = OSError(errno.ENOSPC, "No space left on device (injected: tmpfs mounts not permitted)")
    prompt, cold, _ = _cold(env, seed=501, stored=False)
    fb.wait_for(lambda: env.storage_counter("storage_errors") > errors, "the failed L3 writes are counted")
    assert not [p for p in fb.object_paths(env.storage_dir)]  # nothing half-written is visible
    r = _after_fault(env, prompt, cold)
    assert fb.cached(r)["storage"] == 0
    # space again: the next recompute is written, then read back
    if env.mounted:
        os.unlink(os.path.join(env.mount, "filler.bin"))
    else:
        env.fault.set_error = None
    fb.flush_local_tiers(env.url)
    fb.assert_same_tokens(fb.complete(env.url, prompt), cold)
    fb.wait_objects(env.storage_dir, PAGES)
    fb.flush_local_tiers(env.url)
    r = fb.complete(env.url, prompt)
    fb.assert_same_tokens(r, cold)
    assert fb.cached(r)["storage"] > 0


# --------------------------------------------------------------------------- 1h: reads that hang
def test_reads_that_hang(checked):
    """1h: every L3 read hangs for 20 s (an injected slow backend over the file store): the
    request is answered, recomputed, within a bounded time with the cold tokens, and another
    request is not held up meanwhile."""
    env = checked
    prompt, cold, _ = _cold(env, seed=601)
    env.fault.hang_get_s = HANG_S
    result: dict[str, Any] = {}

    def ask() -> None:
        t0 = time.monotonic()
        result["r"] = fb.complete(env.url, prompt)
        result["s"] = time.monotonic() - t0

    thread = threading.Thread(target=ask)
    probes: list[tuple[float, float, int]] = []  # (sent at, seconds, status) of unrelated requests
    try:
        thread.start()
        assert env.fault.entered_get.wait(30), "the prefetch never read L3"
        t_read = time.monotonic()
        for i in range(6):  # unrelated requests (not in L3: they read nothing) while the read hangs
            if not thread.is_alive():
                break
            t0 = time.monotonic()
            other = fb.complete(env.url, _prompt(610 + i, 40), max_tokens=2)
            probes.append((round(t0 - t_read, 1), round(time.monotonic() - t0, 1), other.status_code))
            time.sleep(0.5)
        thread.join(HANG_S + 60)
        assert not thread.is_alive()
        fb.assert_same_tokens(result["r"], cold)
        assert all(status == 200 for _, _, status in probes), probes
        worst = max(s for _, s, _ in probes)
        assert result["s"] < HANG_BOUND_S and worst < HANG_BOUND_S, (
            f"a hung L3 read held the request {result['s']:.1f} s and unrelated requests up to {worst:.1f} s "
            f"(the read hangs {HANG_S:.0f} s; bound {HANG_BOUND_S:.0f} s); probes (sent s after the read began, "
            f"took s, status): {probes}"
        )
    finally:
        env.fault.release()
        thread.join(HANG_S + 60)


# -------------------------------------------------- 1a as the user meets it: strata-jax serve
def _serve_cmd(storage_dir: str, port: int, grpc_port: int) -> list[str]:
    exe = shutil.which("strata-jax")
    base = [exe] if exe else [sys.executable, "-m", "serving.cli"]
    return [
        *base,
        "serve",
        "--tiers",
        "L1+L2+L3",
        "--storage-dir",
        storage_dir,
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
    ]


def _serve(storage_dir: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port, grpc_port = fb.free_port(), fb.free_port()
    log = open(log_path, "ab")
    proc = subprocess.Popen(_serve_cmd(storage_dir, port, grpc_port), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("strata-jax serve did not become ready")


def _sigterm(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(120)


def test_corrupt_store_across_restart_subprocess(tmp_path):
    """1a, the exact user sequence: ``strata-jax serve --tiers L1+L2+L3 --storage-dir D``, a
    1,500-token completion, SIGTERM, 16 bytes flipped in the middle of every object under D,
    serve again over D, the same completion: 200 with the cold run's tokens, server up."""
    storage_dir, log_path = str(tmp_path / "l3"), str(tmp_path / "serve.log")
    prompt = _prompt(701, 1500)
    proc, url = _serve(storage_dir, log_path)
    try:
        cold = fb.complete(url, prompt, max_tokens=16)
        assert cold.status_code == 200, cold.text
    finally:
        assert _sigterm(proc) == 0
    paths = fb.object_paths(storage_dir)
    assert len(paths) >= 1500 // 16  # shutdown drained the writes
    for p in paths:
        fb.flip_middle(p)
    proc, url = _serve(storage_dir, log_path)
    try:
        r = fb.complete(url, prompt, max_tokens=16)
        fb.assert_same_tokens(r, fb.tokens_of(cold))
        assert fb.cached(r)["storage"] == 0
        fb.assert_same_tokens(fb.complete(url, prompt, max_tokens=16), fb.tokens_of(cold))
        stats = httpx.get(url + "/admin/cache_stats", timeout=30).json()
        assert stats["storage"]["corrupt"] >= 1, stats["storage"]
        fb.assert_alive(url)
    finally:
        code = _sigterm(proc)
    log = open(log_path, errors="replace").read()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "ZeroDivisionError" not in log, log[-5000:]
