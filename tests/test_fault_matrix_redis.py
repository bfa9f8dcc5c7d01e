"""Fault matrix, L3 on Redis: a real ``redis-server`` (started by the module in a temp dir,
on a fixed port so that it can be killed and started again where the engine expects it)
under the real server (tiny engine, tiers L1+L2+L3), its backend wrapped in
``fault_backends.FaultBackend`` (``fault-redis``; a pass-through unless a test holds a read
or a write open, the window in which it kills the Redis server: "mid-prefetch",
"mid-backup").  The wrong-password row runs ``strata-jax serve`` as the user would.

Every test: each request 200 (no 5xx), the prompt's tokens equal its cold run's on the same
server, no leaked page, ``/health`` 200 and a further request afterwards.  Skipped without
``redis-server``.
"""

from __future__ import annotations

import shutil
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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        shutil.which("redis-server") is None, reason="redis-server is not installed (apt-get install redis-server)"
    ),
]

PROMPT_TOKENS = 600
PAGES = PROMPT_TOKENS // 16
PREFIX = "strata-jax:kv:"
MAXMEMORY = ("--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru")


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return fb.random_prompt(seed, n)


@dataclass
class Env:
    srv: Any
    url: str
    engine: Any
    redis: fb.RedisProc
    fault: fb.FaultBackend
    baseline_used: int

    def keys(self) -> int:
        try:
            return sum(1 for n in self.redis.client().scan_iter(match=PREFIX + "*") if not n.endswith(b"store-auth"))
        except Exception:  # noqa: BLE001 - down
            return 0

    def wait_keys(self, at_least: int, timeout: float = 30.0) -> None:
        fb.wait_for(lambda: self.keys() >= at_least, f"Redis holds {at_least} objects (has {self.keys()})", timeout)

    def storage_errors(self) -> int:
        return self.engine.cache_stats()["transfers"]["storage_errors"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    if not real_engine_available():
        pytest.skip("needs the real engine")
    redis = fb.RedisProc(str(tmp_path_factory.mktemp("redis")), *MAXMEMORY)
    mp = pytest.MonkeyPatch()
    built = fb.register_fault_backend(mp, "fault-redis", "redis")
    try:
        srv = start_server(
            max_waiting=64,
            max_running=8,
            max_context_tokens=2048,
            device_tokens=8192,
            tiers="L1+L2+L3",
            storage_backend="fault-redis",
            storage_url=redis.url,
        )
    except BaseException:
        mp.undo()
        redis.stop()
        raise
    engine = srv.frontend.engine()
    wait_idle(engine)
    engine.flush_cache("all")
    env = Env(srv, srv.http_url, engine, redis, built[-1], engine.cache_stats()["device_pool"]["used_pages"])
    yield env
    env.fault.release()
    srv.stop(30.0)
    mp.undo()
    redis.stop()


@pytest.fixture()
def checked(env):
    errors = fb.server_errors(env.srv)
    try:
        yield env
    finally:
        env.fault.reset()
        if env.redis.proc is None:
            env.redis.start()
        client = env.redis.client()
        client.config_set("maxmemory", "256mb")
        client.config_set("maxmemory-policy", "allkeys-lru")
    assert fb.server_errors(env.srv) == errors, "a request ended as a server error (5xx)"
    fb.assert_alive(env.url)
    assert_no_leaks(env.engine, env.baseline_used)


def _cold(env: Env, seed: int, *, stored: bool = True) -> tuple[list[int], dict]:
    prompt = _prompt(seed)
    r = fb.complete(env.url, prompt)
    assert r.status_code == 200, r.text
    assert fb.cached(r) == {"device": 0, "host": 0, "storage": 0}
    if stored:
        env.wait_keys(PAGES)
    fb.flush_local_tiers(env.url)
    return prompt, fb.tokens_of(r)


def _l3_serves_again(env: Env, seed: int) -> None:
    """A new prompt is written to the (restarted) Redis and read back: the backend reconnected."""
    prompt, cold = _cold(env, seed)
    r = fb.complete(env.url, prompt)
    fb.assert_same_tokens(r, cold)
    assert fb.cached(r)["storage"] > 0, f"L3 did not serve after the restart: {fb.cached(r)}"


# ---------------------------------------------------------------- 2a: killed mid-prefetch
def test_killed_mid_prefetch_then_restarted(checked):
    env = checked
    prompt, cold = _cold(env, seed=1001)
    env.fault.hang_get_s = 60.0  # hold the prefetch's read open ...
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", fb.complete(env.url, prompt)))
    thread.start()
    try:
        assert env.fault.entered_get.wait(30), "the prefetch never read L3"
        env.redis.kill()  # ... SIGKILL the Redis server under it ...
        env.fault.release()  # ... and let the read go on to the dead server
        thread.join(120)
    finally:
        env.fault.release()
        thread.join(120)
    r = result["r"]
    fb.assert_same_tokens(r, cold)
    assert fb.cached(r)["storage"] == 0
    assert env.storage_errors() > 0
    # while Redis is down: served as misses
    fb.flush_local_tiers(env.url)
    fb.assert_same_tokens(fb.complete(env.url, prompt), cold)
    env.redis.start()  # the same port, empty (no persistence)
    fb.flush_local_tiers(env.url)
    fb.assert_same_tokens(fb.complete(env.url, prompt), cold)
    _l3_serves_again(env, seed=1002)


# ------------------------------------------------------------------ 2b: killed mid-backup
def test_killed_mid_backup_then_restarted(checked):
    env = checked
    env.fault.hang_set_s = 60.0  # hold the L3 write open ...
    prompt = _prompt(1101)
    r = fb.complete(env.url, prompt)  # the cold run: its pages go L1 -> L2 -> L3
    assert r.status_code == 200 and fb.cached(r) == {"device": 0, "host": 0, "storage": 0}, r.text
    cold = fb.tokens_of(r)
    errors = env.storage_errors()
    try:
        assert env.fault.entered_set.wait(30), "the pages were never written to L3"
        env.redis.kill()  # ... SIGKILL the Redis server under it ...
    finally:
        env.fault.release()  # ... the write goes on to the dead server
    fb.wait_for(lambda: env.storage_errors() > errors, "the failed write is counted")
    fb.assert_same_tokens(fb.complete(env.url, prompt), cold)  # from L1
    fb.flush_local_tiers(env.url)
    r = fb.complete(env.url, prompt)  # Redis down: a probe error is no hit
    fb.assert_same_tokens(r, cold)
    assert fb.cached(r)["storage"] == 0
    # an operator clearing L3 while Redis is down: 503 naming the store (L3 cannot be cleared), the server serves on
    flush = httpx.post(env.url + "/admin/flush_cache", json={"tier": "storage"}, timeout=60)
    assert flush.status_code == 503 and flush.json()["error"]["code"] == "storage_unavailable", flush.text
    assert "L3 storage is unavailable" in flush.json()["error"]["message"], flush.text
    env.redis.start()
    _l3_serves_again(env, seed=1102)


# ----------------------------------------------------------------------- 2c: maxmemory
@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_maxmemory_reached(checked, policy):
    """Redis at ``maxmemory 2mb`` (one prompt's objects are 2.4 MB): with ``allkeys-lru`` it
    evicts (a chain missing its head is no hit), with ``noeviction`` it refuses writes
    (OOM errors, counted); requests are answered with their cold tokens either way."""
    env = checked
    client = env.redis.client()
    client.config_set("maxmemory-policy", policy)
    client.config_set("maxmemory", "2mb")
    evicted = int(client.info("stats")["evicted_keys"])
    errors = env.storage_errors()
    prompts = []
    for seed in (1201, 1202, 1203):
        prompts.append(_cold(env, seed, stored=False))
    env.engine.check_accounting()  # drains the writes
    fb.flush_local_tiers(env.url)
    for prompt, cold in prompts:
        fb.assert_same_tokens(fb.complete(env.url, prompt), cold)
    stats = client.info("stats")
    if policy == "allkeys-lru":
        assert int(stats["evicted_keys"]) > evicted, stats
    else:
        assert env.storage_errors() > errors
    assert int(client.info("memory")["used_memory"]) <= 3 << 20


# ------------------------------------------------------------------- 2d: wrong password
def _serve_cmd(url: str) -> list[str]:
    exe = shutil.which("strata-jax")
    base = [exe] if exe else [sys.executable, "-m", "serving.cli"]
    return [
        *base,
        "serve",
        "--tiers",
        "L1+L2+L3",
        "--storage-backend",
        "redis",
        "--storage-url",
        url,
        "--port",
        str(fb.free_port()),
        "--grpc-port",
        str(fb.free_port()),
    ]


def test_wrong_password_at_startup(tmp_path):
    """``requirepass`` set, ``--storage-url`` with a wrong password: ``strata-jax serve`` stops
    at start-up (exit code != 0, within seconds, before warm-up) naming the cause
    (authentication), and does not write the password it was given into its log."""
    redis = fb.RedisProc(str(tmp_path), "--requirepass", "right-pass-123")
    secret = "wrong-pass-456"
    try:
        t0 = time.monotonic()
        proc = subprocess.run(
            _serve_cmd(f"redis://:{secret}@127.0.0.1:{redis.port}/0"),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        took = time.monotonic() - t0
        # without a password at all: the same clear start-up error (checked on the backend: same path)
        from strata_jax.cache.storage import StorageError
        from strata_jax.cache.storage_redis import RedisStorage

        with pytest.raises(StorageError, match="(?i)auth"):
            RedisStorage.from_url(redis.url, timeout_s=2.0)
    finally:
        redis.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert took < 120, took
    assert "invalid username-password pair" in out or "WRONGPASS" in out, out[-3000:]
    leaked = [line[:300] for line in out.splitlines() if secret in line]
    assert not leaked, f"the Redis password is written to the log: {leaked}"
