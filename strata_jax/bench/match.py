"""``strata-jax bench match``: speed of ``match_prefix`` on a large tree (pure Python, no jax).

Builds a tree holding ``--tree-tokens`` tokens (default 10M) at ``--page-size``
(default 16): conversations of ``--prompt-tokens`` tokens (default 128K) grown in
``--turn-tokens`` turns (default 4096, so a history is a path of many nodes), with
side branches.  Then matches ``--queries`` prompts of ``--prompt-tokens`` tokens,
each sharing a random-length prefix with a stored conversation (the last node is
split, as in real use), passed as a ``list[int]`` the way the engine does.
Reports the median and p90 time of one match (target: <= 20 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from strata_jax.cache.radix_tree import HiRadixTree

DESCRIPTION = "match_prefix speed: long prompt against a tree of ~10M tokens"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree-tokens", type=int, default=10_000_000, help="tokens held by the tree (default 10M)")
    parser.add_argument("--prompt-tokens", type=int, default=128 * 1024, help="prompt length (default 131072)")
    parser.add_argument(
        "--turn-tokens", type=int, default=4096, help="tokens added per insert when building (default 4096)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--queries", type=int, default=30, help="prompts to match (default 30)")
    parser.add_argument(
        "--target-ms", type=float, default=20.0, help="pass/fail threshold for the median (default 20 ms)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    ps = args.page_size
    tree = HiRadixTree(ps)
    next_page = 0
    convs: list[list[int]] = []
    held = 0
    t0 = time.perf_counter()
    while held < args.tree_tokens:
        conv = rng.integers(0, 128_000, args.prompt_tokens).tolist()
        if convs and rng.random() < 0.5:  # a branch: shares a prefix with an earlier conversation
            base = convs[int(rng.integers(len(convs)))]
            cut = int(rng.integers(1, len(base) // ps)) * ps
            conv[:cut] = base[:cut]
        for end in range(args.turn_tokens, len(conv) + 1, args.turn_tokens):
            n = end // ps
            pages = list(range(next_page, next_page + n))
            tree.insert(conv[:end], "", device_pages=pages)
            next_page += n  # ids are only labels here; unused ones are simply skipped
        held = tree.device_pages * ps
        convs.append(conv)
    build_s = time.perf_counter() - t0
    nodes = sum(1 for _ in tree.iter_nodes())
    times = []
    matched = []
    for _ in range(args.queries):
        base = convs[int(rng.integers(len(convs)))]
        keep = int(rng.integers(len(base) // 2, len(base)))
        prompt = base[:keep] + rng.integers(0, 128_000, args.prompt_tokens - keep).tolist()
        s = time.perf_counter()
        m = tree.match_prefix(prompt)
        times.append(time.perf_counter() - s)
        matched.append(m.device_tokens)
    med = statistics.median(times) * 1e3
    p90 = sorted(times)[int(0.9 * (len(times) - 1))] * 1e3
    ok = med <= args.target_ms
    print(f"tree: {tree.device_pages * ps} tokens in {nodes} nodes (built in {build_s:.1f} s)")
    print(
        f"match_prefix of {args.prompt_tokens} tokens: median {med:.2f} ms, p90 {p90:.2f} ms, "
        f"mean matched {statistics.mean(matched):.0f} tokens; target {args.target_ms} ms: {'PASS' if ok else 'FAIL'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tree_tokens": tree.device_pages * ps,
                    "nodes": nodes,
                    "median_ms": med,
                    "p90_ms": p90,
                    "mean_matched_tokens": statistics.mean(matched),
                    "target_ms": args.target_ms,
                    "pass": ok,
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                },
                f,
                indent=1,
            )
    return 0 if ok else 1
