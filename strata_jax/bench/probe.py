"""``strata-jax bench probe``: what L3 lookups cost a scheduling round with a long queue.

Every round the scheduler re-matches each waiting request (``max_lookahead``, 1024 by
default), and with L3 on each match asks the backend which of the prompt's pages
it holds.  This builds a bookkeeping controller over the chosen backend, queues
``--waiting`` prompts of ``--prompt-tokens`` tokens (none cached, the common case
for a queue), and times whole rounds of matches with the probe memo off
(``storage_probe_ttl_s=0``) and on (``--ttl``), side by side.

``--storage redis`` needs a server: ``--storage-url``, or ``--start-redis`` to run
a private ``redis-server`` on a free port for the benchmark.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np

DESCRIPTION = "L3 lookup cost of one scheduling round over a long waiting queue (probe memo off vs on)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", choices=["file", "redis"], default="file", help="L3 backend (default file)")
    parser.add_argument("--storage-url", default=None, help="Redis server URL for --storage redis")
    parser.add_argument("--start-redis", action="store_true", help="start a private redis-server for the run")
    parser.add_argument("--waiting", type=int, default=500, help="waiting requests re-matched per round (default 500)")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length (default 4096)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--ttl", type=float, default=0.5, help="storage_probe_ttl_s of the memo run (default 0.5)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per setting (median kept; default 10)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")


def run(args: argparse.Namespace) -> int:
    from strata_jax.cache.config import CacheConfig
    from strata_jax.cache.controller import CacheController
    from strata_jax.cache.storage import StorageError
    from strata_jax.cache.storage_redis import start_local_server

    if args.waiting <= 0 or args.prompt_tokens < args.page_size or args.rounds <= 0 or args.ttl <= 0:
        raise SystemExit("--waiting, --rounds and --ttl must be positive and --prompt-tokens at least one page")
    workdir = tempfile.mkdtemp(prefix="strata-probe-")
    server = None
    url = args.storage_url
    if args.storage == "redis" and url is None:
        if not args.start_redis:
            raise SystemExit("--storage redis needs --storage-url or --start-redis")
        try:
            server, url = start_local_server(workdir)
        except StorageError as exc:
            raise SystemExit(f"--start-redis: {exc}") from None
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 50_000, args.prompt_tokens).tolist() for _ in range(args.waiting)]
        result: dict = {"storage": args.storage, "waiting": args.waiting, "prompt_tokens": args.prompt_tokens}
        for label, ttl in (("memo_off", 0.0), ("memo_on", args.ttl)):
            config = CacheConfig(
                page_size=args.page_size,
                device_pages=64,
                tiers="L1+L2+L3",
                storage_backend=args.storage,
                storage_dir=workdir,
                storage_url=url or CacheConfig.storage_url,
                storage_probe_ttl_s=ttl,
            )
            ctl = CacheController.simulated(config)
            for p in prompts:  # first round: hashes the prompts (memoized for both settings)
                ctl.match_prefix(p, "", touch=False)
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for p in prompts:
                    ctl.match_prefix(p, "", touch=False)
                times.append(time.perf_counter() - start)
            ctl.close()
            result[f"{label}_round_ms"] = 1e3 * statistics.median(times)
        result["memo_speedup"] = result["memo_off_round_ms"] / result["memo_on_round_ms"]
        print(
            f"{args.storage}: {args.waiting} waiting {args.prompt_tokens}-token requests, one round of matches: "
            f"{result['memo_off_round_ms']:.1f} ms without the probe memo, {result['memo_on_round_ms']:.1f} ms with it "
            f"(ttl {args.ttl} s; x{result['memo_speedup']:.1f})"
        )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
