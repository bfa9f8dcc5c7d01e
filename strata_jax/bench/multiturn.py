"""``strata-jax bench multiturn``: hit rate of the multi-turn chat workload (SGLang HiCache bench shape).

``--clients`` conversations, ``--rounds`` turns each, with a barrier between
rounds: in round r client c sends its whole history plus ``--request-length``
new random tokens and gets ``--output-length`` tokens back; the next turn's
prompt contains both.  Token ids are random (``--seed``), so only the
conversation's own history can hit.  Clients are served in the same order every
round (the cyclic pattern on which LRU collapses once the working set exceeds a
tier).  ``--no-model``: bookkeeping only (transfer cost ignored); without it the
controller moves real arrays with synthetic KV (``--verify`` checks every hit
bit-exactly) — the transformer itself is not run.

Reuse ceiling of round r (0-based): r(T+O) / ((r+1)T + rO).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from strata_jax.cache.config import PREFETCH_POLICIES, TIERS, WRITE_POLICIES, CacheConfig

DESCRIPTION = "multi-turn chat workload: per-round prefix hit rate and the tier that served it"


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Cache-shape flags shared by the multiturn and trace benchmarks."""
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument("--device-tokens", type=int, default=None, help="L1 capacity in tokens")
    parser.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 pages per L1 page (default 2.0)")
    parser.add_argument("--tiers", choices=TIERS, default="L1+L2", help="cache tiers in use (default L1+L2)")
    parser.add_argument(
        "--write-policy", choices=WRITE_POLICIES, default="write_through", help="when L1 pages are backed up to L2"
    )
    parser.add_argument(
        "--write-through-threshold", type=int, default=2, help="hits before a backup under write_through_selective"
    )
    parser.add_argument(
        "--prefetch-policy",
        choices=PREFETCH_POLICIES,
        default="wait_complete",
        help="L3 prefetch stop policy (default wait_complete: hit rates independent of timing)",
    )
    parser.add_argument(
        "--storage",
        choices=["memory", "file", "redis"],
        default=None,
        help="L3 backend (default: memory with --no-model, file otherwise)",
    )
    parser.add_argument(
        "--storage-dir", default=None, help="directory of the file backend (default: a fresh temporary directory)"
    )
    parser.add_argument(
        "--storage-capacity-bytes", type=int, default=1 << 62, help="L3 capacity in bytes (default: unlimited)"
    )
    parser.add_argument(
        "--no-model", action="store_true", help="bookkeeping only: no KV arrays, transfers cost nothing"
    )
    parser.add_argument(
        "--layers", type=int, default=2, help="synthetic KV layout without --no-model: layers (default 2)"
    )
    parser.add_argument("--kv-heads", type=int, default=2, help="synthetic KV layout: KV heads (default 2)")
    parser.add_argument("--head-dim", type=int, default=16, help="synthetic KV layout: head dim (default 16)")
    parser.add_argument(
        "--verify", action="store_true", help="without --no-model: check every cached prefix bit-exactly"
    )
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")


_TEMP_DIRS: list[str] = []  # storage dirs this process created; removed by cleanup_temp_storage()


def cleanup_temp_storage() -> None:
    """Delete the temporary L3 directories created for benchmark runs."""
    import shutil

    while _TEMP_DIRS:
        shutil.rmtree(_TEMP_DIRS.pop(), ignore_errors=True)


def build_controller(args: argparse.Namespace, device_tokens: int):
    """A controller shaped by the shared flags (and a temporary storage dir when none is given)."""
    import tempfile

    from strata_jax.cache.controller import CacheController

    storage = args.storage or ("memory" if args.no_model else "file")
    storage_dir = args.storage_dir
    if storage == "file" and storage_dir is None and args.tiers == "L1+L2+L3":
        storage_dir = tempfile.mkdtemp(prefix="strata-kv-bench-")
        _TEMP_DIRS.append(storage_dir)
    cfg = cache_config(args, device_tokens, storage, storage_dir)
    if args.no_model:  # no KV layout: a controller that keeps the books and moves no bytes
        return CacheController.simulated(cfg)
    from pallas_kernels.layout import KVLayout

    return CacheController.on_device(cfg, KVLayout(args.layers, args.kv_heads, args.head_dim, args.page_size))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16, help="concurrent conversations (default 16)")
    parser.add_argument("--rounds", type=int, default=20, help="turns per conversation (default 20)")
    parser.add_argument("--request-length", type=int, default=1024, help="new prompt tokens per turn, T (default 1024)")
    parser.add_argument("--output-length", type=int, default=16, help="generated tokens per turn, O (default 16)")
    parser.add_argument(
        "--device-rounds",
        type=float,
        default=4.0,
        help="when --device-tokens is not given: L1 = this many rounds of all clients' history, k*clients*(T+O) "
        "(default 4)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random token ids seed (default 0)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=32000,
        help="token ids are drawn from [0, vocab) (default 32000; capped at the model's vocabulary with --model)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="run through the Engine with this model ('tiny' or a local HF folder): real prefill/decode, all clients "
        "of a round submitted at once",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=512, help="with --model: new tokens per prefill step (default 512)"
    )
    add_cache_arguments(parser)


def ceiling(r: int, t: int, o: int) -> float:
    return r * (t + o) / ((r + 1) * t + r * o)


def cache_config(
    args: argparse.Namespace, device_tokens: int, storage_backend: str, storage_dir: str | None
) -> CacheConfig:
    """The cache shaped by the shared flags (L1 size, backend and directory resolved by the caller)."""
    return CacheConfig(
        page_size=args.page_size,
        device_tokens=device_tokens,
        hicache_ratio=args.hicache_ratio,
        tiers=args.tiers,
        write_policy=args.write_policy,
        write_through_threshold=args.write_through_threshold,
        prefetch_policy=args.prefetch_policy,
        prefetch_min_tokens=0,
        storage_backend=storage_backend,
        storage_dir=storage_dir,
        storage_capacity_bytes=args.storage_capacity_bytes,
    )


def run_with_engine(args: argparse.Namespace, device_tokens: int) -> dict:
    """Every round: submit all clients' turns at once to a real Engine, wait, record per-tier hits."""
    import tempfile

    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine
    from strata_jax.engine.config import EngineConfig

    t, o = args.request_length, args.output_length
    storage_dir = args.storage_dir
    if storage_dir is None and args.tiers == "L1+L2+L3":
        storage_dir = tempfile.mkdtemp(prefix="strata-kv-bench-")
        _TEMP_DIRS.append(storage_dir)
    context = args.rounds * (t + o) + args.page_size
    engine = Engine(
        EngineConfig(
            model=args.model,
            cache=cache_config(args, device_tokens, args.storage or "file", storage_dir),
            max_context_tokens=context,
            max_batch_tokens=args.max_batch_tokens,
            show_progress=False,
        )
    )
    vocab = min(args.vocab, engine.vocab_size)
    rng = np.random.default_rng(args.seed)
    histories: list[list[int]] = [[] for _ in range(args.clients)]
    params = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
    rounds = []
    total_prompt = total_cached = 0
    try:
        for r in range(args.rounds):
            prompts = [h + rng.integers(0, vocab, t).tolist() for h in histories]
            outs = engine.generate(prompts, params)
            n = sum(len(p) for p in prompts)
            tiers = {k: sum(out.cached_tokens.get(k, 0) for out in outs) for k in ("device", "host", "storage")}
            hit = sum(tiers.values()) / n
            rounds.append(
                {
                    "round": r,
                    "hit_rate": hit,
                    **{k: v / n for k, v in tiers.items()},
                    "ceiling": ceiling(r, t, o),
                    "unfit_requests": 0,
                }
            )
            total_prompt += n
            total_cached += sum(tiers.values())
            histories = [p + list(out.token_ids) for p, out in zip(prompts, outs)]
            print(
                f"{r:>5} {hit:7.3f} {tiers['device'] / n:7.3f} {tiers['host'] / n:7.3f} {tiers['storage'] / n:7.3f} "
                f"{ceiling(r, t, o):7.3f}"
            )
        stats = engine.cache_stats()
    finally:
        engine.shutdown()
        cleanup_temp_storage()
    return {"rounds": rounds, "hit_rate": total_cached / max(total_prompt, 1), "engine_cache_stats": stats}


def run(args: argparse.Namespace) -> int:
    from strata_jax.cache.replay import CacheReplayer

    if args.model is not None:
        t, o = args.request_length, args.output_length
        device_tokens = args.device_tokens or int(args.device_rounds * args.clients * (t + o))
        start = time.perf_counter()
        print(f"engine with model {args.model!r}: L1 {device_tokens} tokens, tiers {args.tiers}, {args.write_policy}")
        print(f"{'round':>5} {'hit':>7} {'device':>7} {'host':>7} {'storage':>7} {'ceiling':>7}")
        result = run_with_engine(args, device_tokens)
        result["seconds"] = time.perf_counter() - start
        result["config"] = {k: v for k, v in vars(args).items() if k != "json"} | {"device_tokens": device_tokens}
        print(f"overall hit rate {result['hit_rate']:.4f}; {result['seconds']:.1f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return 0

    t, o = args.request_length, args.output_length
    device_tokens = args.device_tokens or int(args.device_rounds * args.clients * (t + o))
    ctl = build_controller(args, device_tokens)
    replayer = CacheReplayer(ctl, verify=args.verify)
    rng = np.random.default_rng(args.seed)
    histories: list[tuple[int, ...]] = [() for _ in range(args.clients)]
    rounds = []
    total_prompt = total_cached = 0
    start = time.perf_counter()
    print(
        f"L1 {device_tokens} tokens ({device_tokens / (args.clients * (t + o)):.2f} rounds of all histories), "
        f"L2 {ctl.host_alloc.num_pages * args.page_size} tokens, tiers {args.tiers}, {args.write_policy}"
    )
    print(f"{'round':>5} {'hit':>7} {'device':>7} {'host':>7} {'storage':>7} {'ceiling':>7} {'unfit':>5}")
    for r in range(args.rounds):
        prompt_tok = dev = host = sto = unfit = 0
        for c in range(args.clients):
            new = tuple(rng.integers(0, args.vocab, t).tolist())
            out = tuple(rng.integers(0, args.vocab, o).tolist())
            prompt = histories[c] + new
            res = replayer.serve(prompt, out, "", request_id=(c, r))
            prompt_tok += res.prompt_tokens
            dev += res.device
            host += res.host
            sto += res.storage
            unfit += not res.fit
            histories[c] = prompt + out
        hit = (dev + host + sto) / prompt_tok
        rounds.append(
            {
                "round": r,
                "hit_rate": hit,
                "device": dev / prompt_tok,
                "host": host / prompt_tok,
                "storage": sto / prompt_tok,
                "ceiling": ceiling(r, t, o),
                "unfit_requests": unfit,
            }
        )
        total_prompt += prompt_tok
        total_cached += dev + host + sto
        print(
            f"{r:>5} {hit:7.3f} {dev / prompt_tok:7.3f} {host / prompt_tok:7.3f} {sto / prompt_tok:7.3f} "
            f"{ceiling(r, t, o):7.3f} {unfit:>5}"
        )
    elapsed = time.perf_counter() - start
    result = {
        "rounds": rounds,
        "hit_rate": total_cached / total_prompt,
        "seconds": elapsed,
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {"device_tokens": device_tokens},
        "verified_pages": replayer.verified_pages,
        "controller": {k: v for k, v in ctl.stats().items() if k != "storage"},
    }
    print(f"overall hit rate {result['hit_rate']:.4f}; {elapsed:.1f} s")
    ctl.close()
    cleanup_temp_storage()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
