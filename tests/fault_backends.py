"""Test-only fault injection for the fault-matrix tests (tests/test_fault_*.py).

Nothing here is production code: faults are injected by registering a wrapping backend
under a new name in ``strata_jax.cache.storage.STORAGE_BACKENDS`` for the test's process
(``register_fault_backend``, through ``pytest.MonkeyPatch``), by damaging the objects of a
real file store on disk, by mounting a tmpfs (disk full, read-only remount), or by
killing and restarting a real ``redis-server``.  Plus the checks every fault test makes
through the HTTP face: status codes, the cold run's tokens, the server alive.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from strata_jax.cache import storage as storage_mod
from strata_jax.cache.storage import StorageBackend, StorageStats


# ---------------------------------------------------------------------------------- backend
class FaultBackend(StorageBackend):
    """Wraps a real backend; each operation can be made to hang or raise on demand.

    * ``hang_get_s`` / ``hang_set_s``: ``batch_get`` / ``batch_set`` first wait that long
      (or until ``release()``), then call the real backend: a slow store (NFS, an
      overloaded Redis), or a window in which the test kills the real server.
    * ``get_error`` / ``set_error`` / ``exists_error``: an exception to raise instead of
      calling the real backend (e.g. ``OSError(errno.ENOSPC, ...)``).
    * ``entered_get`` / ``entered_set``: set when a call started (the test waits on them
      to act "mid-prefetch" / "mid-backup").
    """

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.name = f"fault-{inner.name}"
        self.hang_get_s = 0.0
        self.hang_set_s = 0.0
        self.get_error: BaseException | None = None
        self.set_error: BaseException | None = None
        self.exists_error: BaseException | None = None
        self.entered_get = threading.Event()
        self.entered_set = threading.Event()
        self._release = threading.Event()
        self.calls = {"exists": 0, "get": 0, "set": 0, "hung": 0}

    def reset(self) -> None:
        self.hang_get_s = self.hang_set_s = 0.0
        self.get_error = self.set_error = self.exists_error = None
        self.release()
        self.entered_get.clear()
        self.entered_set.clear()
        self._release = threading.Event()

    def release(self) -> None:
        """End every hang now (the hung calls go on to the real backend)."""
        self._release.set()

    def _hang(self, seconds: float) -> None:
        if seconds > 0:
            self.calls["hung"] += 1
            self._release.wait(seconds)

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        self.calls["exists"] += 1
        if self.exists_error is not None:
            raise self.exists_error
        return self.inner.batch_exists(keys)

    def read_object(self, key: bytes) -> bytes | None:
        return self.inner.read_object(key)

    def write_object(self, key: bytes, blob: bytes) -> None:
        self.inner.write_object(key, blob)

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.calls["get"] += 1
        self.entered_get.set()
        self._hang(self.hang_get_s)
        if self.get_error is not None:
            raise self.get_error
        return self.inner.batch_get(keys)

    def batch_set(self, keys: Sequence[bytes], payloads: Sequence[bytes | memoryview]) -> int:
        self.calls["set"] += 1
        self.entered_set.set()
        self._hang(self.hang_set_s)
        if self.set_error is not None:
            raise self.set_error
        return self.inner.batch_set(keys, payloads)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> StorageStats:
        return self.inner.stats()

    def close(self) -> None:
        self.release()
        self.inner.close()


def register_fault_backend(monkeypatch: Any, name: str, inner: str) -> list[FaultBackend]:
    """Register ``name`` in ``STORAGE_BACKENDS``: the backend ``inner`` (``file``, ``redis``)
    wrapped in a ``FaultBackend``.  Returns the list the wrappers built are appended to."""
    built: list[FaultBackend] = []
    make_inner = storage_mod.STORAGE_BACKENDS[inner]

    def factory(config: Any) -> StorageBackend:
        wrapper = FaultBackend(make_inner(config))
        built.append(wrapper)
        return wrapper

    monkeypatch.setitem(storage_mod.STORAGE_BACKENDS, name, factory)
    return built


# ------------------------------------------------------------------------------- file store
def random_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def object_paths(storage_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(storage_dir, "objects", "*", "*.kv")))


def wait_objects(storage_dir: str, at_least: int, timeout: float = 60.0) -> list[str]:
    """Wait until the store holds ``at_least`` objects and their number is stable."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        paths = object_paths(storage_dir)
        if len(paths) >= at_least and len(paths) == last:
            return paths
        last = len(paths)
        time.sleep(0.3)
    raise AssertionError(f"{storage_dir}: {len(object_paths(storage_dir))} objects, wanted {at_least}")


def flip_middle(path: str, n: int = 16) -> None:
    """Invert ``n`` bytes in the middle of the file (what a bad sector or a bit-rot does)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(max(0, size // 2 - n // 2))
        data = f.read(n)
        f.seek(max(0, size // 2 - n // 2))
        f.write(bytes(b ^ 0xFF for b in data))


def truncate_half(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def truncate_zero(path: str) -> None:
    os.truncate(path, 0)


def rotate_contents(paths: Sequence[str]) -> None:
    """Each object's file gets the bytes of the next key's object (a whole, intact object
    under the wrong key: a mixed-up copy, an rsync gone wrong)."""
    blobs = [open(p, "rb").read() for p in paths]
    for i, p in enumerate(paths):
        with open(p, "wb") as f:
            f.write(blobs[(i + 1) % len(blobs)])


def mount_tmpfs(path: str, size: str) -> bool:
    """Mount a tmpfs of ``size`` at ``path``; False where this sandbox does not allow it."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, check=False
    )
    return proc.returncode == 0


def remount(path: str, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True, capture_output=True)


def umount(path: str) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill_disk(directory: str) -> str:
    """Write a file in ``directory`` until the file system is full (ENOSPC); returns its path."""
    path = os.path.join(directory, "filler.bin")
    chunk = b"\0" * (1 << 16)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    try:  # fill the last partial chunk too
        with open(path, "ab") as f:
            while True:
                f.write(b"\0" * 512)
                f.flush()
    except OSError:
        pass
    return path


# ------------------------------------------------------------------------------------ redis
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProc:
    """A private ``redis-server`` on a fixed loopback port that the test can kill and
    start again on the same port (no persistence: a restart comes back empty)."""

    def __init__(self, workdir: str, *args: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.args = args
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL (a crash, an OOM kill): no goodbye to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def client(self, password: str | None = None) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=password, socket_timeout=5)


# -------------------------------------------------------------------------------- HTTP checks
def complete(
    base_url: str, prompt: list[int] | str, *, max_tokens: int = 12, timeout: float = 180.0, **extra: Any
) -> httpx.Response:
    """A greedy completion with per-token logprobs (the tiny model's byte tokenizer prints
    several tokens as U+FFFD, so the text alone does not pin the tokens)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        **extra,
    }
    return httpx.post(base_url + "/v1/completions", json=body, timeout=timeout)


def tokens_of(response: httpx.Response) -> dict[str, Any]:
    """What a greedy completion's tokens are pinned by: the text, each token, its logprob
    and the top-5 alternatives' logprobs."""
    choice = response.json()["choices"][0]
    lp = choice["logprobs"]
    return {
        "text": choice["text"],
        "tokens": lp["tokens"],
        "logprobs": lp["token_logprobs"],
        "top": [sorted(t.values(), reverse=True) for t in lp["top_logprobs"]],
    }


def assert_same_tokens(got: httpx.Response, cold: dict[str, Any], tol: float = 2e-3) -> None:
    assert got.status_code == 200, (got.status_code, got.text[:2000])
    mine = tokens_of(got)
    assert mine["text"] == cold["text"] and mine["tokens"] == cold["tokens"], (mine["tokens"], cold["tokens"])
    assert len(mine["logprobs"]) == len(cold["logprobs"])
    for a, b in zip(mine["logprobs"], cold["logprobs"]):
        assert abs(a - b) <= tol, (mine["logprobs"], cold["logprobs"])
    for a, b in zip(mine["top"], cold["top"]):
        assert len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b)), (mine["top"], cold["top"])


def cached(response: httpx.Response) -> dict[str, int]:
    return response.json()["usage"]["cached_tokens_per_tier"]


def flush_local_tiers(base_url: str) -> None:
    """L1 and L2 dropped through the admin route, as an operator would (L3 is kept)."""
    for tier in ("device", "host"):
        r = httpx.post(base_url + "/admin/flush_cache", json={"tier": tier}, timeout=120)
        assert r.status_code == 200, r.text


def assert_alive(base_url: str, prompt: list[int] | None = None) -> None:
    """``/health`` 200 and a further request works."""
    r = httpx.get(base_url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    r = complete(base_url, prompt or [5, 6, 7, 8, 9, 10, 11, 12, 13], max_tokens=4)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text[:1000]


def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)


def server_errors(srv: Any) -> float:
    """Requests that ended as server errors (HTTP 5xx / gRPC INTERNAL) so far."""
    registry = srv.frontend.metrics.registry
    return sum(
        registry.get_sample_value("strata_requests_total", {"api": api, "status": "error"}) or 0.0
        for api in ("http", "grpc")
    )
