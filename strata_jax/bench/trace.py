"""``strata-jax bench trace``: replay a Mooncake-format JSONL trace through the cache.

Each line: ``{"timestamp", "input_length", "output_length", "hash_ids"}``; every
hash id names a 512-token block (equal ids = equal block *and* equal prefix).
Block ``h`` gets the token ids ``h*512 + 0 .. h*512 + 511`` (deterministic,
distinct across blocks); the prompt is the blocks concatenated and cut to
``input_length`` (the last block is ``input_length`` minus the full blocks).
Requests are replayed in file order, one at a time; only prompts are cached
(the trace's outputs are not part of any later prompt's token ids).

``ideal_hit_rate``: prefix hit rate of an infinite cache at the same page size,
computed independently (a set of page-prefix keys).  ``--sweep`` replays the
trace once per L1 size to show hit rate against capacity.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from strata_jax.bench.multiturn import add_cache_arguments, build_controller, cleanup_temp_storage

DESCRIPTION = "replay a Mooncake JSONL trace: hit rate vs the infinite-cache ideal (optionally per capacity)"
BLOCK = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        required=True,
        help="Mooncake-format JSONL file (e.g. ../shared/data/mooncake/conversation_trace.jsonl)",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests (default: all)")
    parser.add_argument(
        "--sweep",
        default=None,
        help="comma-separated L1 sizes as fractions of the trace's unique tokens, e.g. 0.05,0.1,0.25,1 (replaces "
        "--device-tokens)",
    )
    add_cache_arguments(parser)


def load_trace(path: str, limit: int | None = None) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


def prompt_tokens(req: dict) -> tuple[int, ...]:
    ids = np.asarray(req["hash_ids"], dtype=np.int64)
    if len(ids) == 0:
        return ()
    toks = (ids[:, None] * BLOCK + np.arange(BLOCK, dtype=np.int64)[None, :]).reshape(-1)
    return tuple(toks[: req["input_length"]].tolist())


def ideal_hit_rate(prompts: list[tuple[int, ...]], page_size: int) -> tuple[float, int]:
    """(hit rate of an infinite page-granular prefix cache, unique cached tokens)."""
    seen: set[int] = set()
    hit = total = 0
    for p in prompts:
        total += len(p)
        key = 0
        matching = True
        for i in range(len(p) // page_size):
            key = hash((key, p[i * page_size : (i + 1) * page_size]))
            if matching and key in seen:
                hit += page_size
            else:
                matching = False
                seen.add(key)
    return hit / max(total, 1), len(seen) * page_size


def replay(args: argparse.Namespace, prompts: list[tuple[int, ...]], device_tokens: int) -> dict:
    from strata_jax.cache.replay import CacheReplayer

    ctl = build_controller(args, device_tokens)
    rep = CacheReplayer(ctl, verify=args.verify)
    total = dev = host = sto = unfit = 0
    for i, p in enumerate(prompts):
        res = rep.serve(p, (), "", request_id=i)
        total += res.prompt_tokens
        dev += res.device
        host += res.host
        sto += res.storage
        unfit += not res.fit
    ctl.close()
    cleanup_temp_storage()
    return {
        "device_tokens": device_tokens,
        "hit_rate": (dev + host + sto) / max(total, 1),
        "device": dev / max(total, 1),
        "host": host / max(total, 1),
        "storage": sto / max(total, 1),
        "unfit_requests": unfit,
    }


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    reqs = load_trace(args.trace, args.limit)
    prompts = [prompt_tokens(r) for r in reqs]
    ideal, unique_tokens = ideal_hit_rate(prompts, args.page_size)
    longest = max((len(p) for p in prompts), default=0)
    print(
        f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {unique_tokens} unique cached tokens, ideal "
        f"hit rate {ideal:.4f}"
    )
    if args.sweep:
        sizes = [max(int(float(x) * unique_tokens), longest + args.page_size) for x in args.sweep.split(",")]
    else:
        sizes = [args.device_tokens or unique_tokens + longest + args.page_size]
    results = []
    for size in sizes:
        res = replay(args, prompts, size)
        results.append(res)
        print(
            f"L1 {size:>10} tokens ({size / max(unique_tokens, 1):6.3f} of unique): hit {res['hit_rate']:.4f} "
            f"(device {res['device']:.4f} host {res['host']:.4f} storage {res['storage']:.4f})"
        )
    out = {
        "requests": len(prompts),
        "hit_rate": results[-1]["hit_rate"],
        "ideal_hit_rate": ideal,
        "unique_tokens": unique_tokens,
        "sweep": results,
        "seconds": time.perf_counter() - t0,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    print(f"done in {out['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
