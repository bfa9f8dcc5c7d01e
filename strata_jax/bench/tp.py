"""``strata-jax bench tp``: step time of the tensor-parallel runner, tp 1 vs tp N, side by side.

Builds one ``ModelRunner`` per (tp, embedding/LM-head placement) on the same random
weights and times a decode step (``--batch`` sequences of ``--context`` cached tokens)
and an extend step (``--extend`` new tokens), interleaving the variants so machine
noise hits them alike; the median of ``--repeats`` is kept.  Greedy tokens of every
variant are checked against tp 1.

On CPU the "devices" are XLA host devices sharing the same cores
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``): tp cannot be faster there,
the numbers show the overhead of the collectives and of the per-shard programs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

DESCRIPTION = "tensor parallel step time: tp 1 vs tp N (and vocab-parallel vs replicated embedding/LM head)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tp sizes to compare (default: 1 2)")
    parser.add_argument(
        "--vocab-parallel", action="store_true", help="also time each tp > 1 with a vocab-parallel embedding/LM head"
    )
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--intermediate", type=int, default=2816, help="MLP size (default 2816)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--batch", type=int, default=8, help="decode sequences (default 8)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence (default 256)")
    parser.add_argument("--extend", type=int, default=128, help="tokens of the extend step (default 128)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant (default 20)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def _variants(args: argparse.Namespace) -> list[tuple[int, bool]]:
    out = []
    for tp in args.tp:
        out.append((tp, False))
        if tp > 1 and args.vocab_parallel:
            out.append((tp, True))
    return out


def run(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from strata_jax.models.config import ModelConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput
    from strata_jax.runtime.sharding import make_mesh

    if max(args.tp) > jax.device_count():
        raise SystemExit(
            f"--tp {max(args.tp)} needs {max(args.tp)} devices, {jax.device_count()} visible "
            "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    config = ModelConfig(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4 * (args.context + args.extend),
    )
    page = 16
    pages_per_seq = -(-(args.context + 1) // page)
    rconf = RunnerConfig(
        page_size=page,
        num_device_pages=args.batch * pages_per_seq + -(-args.extend // page) + 1,
        max_batch_tokens=max(args.extend, args.batch + 1),
        max_batch_size=args.batch,
        max_context_tokens=args.context + args.extend + 1,
    )
    runners = {}
    for tp, vocab_parallel in _variants(args):
        mesh = make_mesh(tp) if tp > 1 else None
        runners[(tp, vocab_parallel)] = ModelRunner(
            random_model(config, seed=0), rconf, mesh=mesh, vocab_parallel=vocab_parallel
        )
    rng = np.random.default_rng(0)
    decode = [
        SeqInput([int(rng.integers(args.vocab))], args.context, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)))
        for i in range(args.batch)
    ]
    base = args.batch * pages_per_seq
    extend = [
        SeqInput(
            rng.integers(args.vocab, size=args.extend).tolist(), 0, list(range(base, base + -(-args.extend // page)))
        )
    ]
    times: dict[tuple, dict[str, list[float]]] = {k: {"decode": [], "extend": []} for k in runners}
    tokens: dict[tuple, list[int]] = {}
    for key, runner in runners.items():  # compile and check agreement
        runner.step(extend)
        tokens[key] = runner.step(decode).next_tokens.tolist()
    for _ in range(args.repeats):
        for key, runner in runners.items():
            for name, seqs in (("decode", decode), ("extend", extend)):
                t0 = time.perf_counter()
                runner.step(seqs)
                times[key][name].append(time.perf_counter() - t0)
    reference = tokens[(1, False)] if (1, False) in tokens else next(iter(tokens.values()))
    rows = []
    for (tp, vp), t in times.items():
        rows.append(
            {
                "tp": tp,
                "vocab_parallel": vp,
                "decode_ms": statistics.median(t["decode"]) * 1e3,
                "extend_ms": statistics.median(t["extend"]) * 1e3,
                "same_tokens_as_first": tokens[(tp, vp)] == reference,
            }
        )
    first = rows[0]
    print(
        f"platform={jax.devices()[0].platform} devices={jax.device_count()} model: {args.layers}L hidden {args.hidden} "
        f"{args.heads}/{args.kv_heads} heads vocab {args.vocab}; decode batch {args.batch} @ {args.context} ctx; "
        f"extend {args.extend}"
    )
    for r in rows:
        print(
            f"tp={r['tp']} {'vocab-parallel' if r['vocab_parallel'] else 'replicated   '} "
            f"decode {r['decode_ms']:8.2f} ms/step ({r['decode_ms'] / first['decode_ms']:.2f}x)  "
            f"extend {r['extend_ms']:8.2f} ms ({r['extend_ms'] / first['extend_ms']:.2f}x)  "
            f"tokens {'match' if r['same_tokens_as_first'] else 'DIFFER'}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    return 0 if all(r["same_tokens_as_first"] for r in rows) else 1
