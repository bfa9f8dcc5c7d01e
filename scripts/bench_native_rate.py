"""The native CPU attention kernels against the machine's matmul rate, in one process:
each case alternates a 768^3 float32 matmul (best of 5) with the kernel (best of 2), and
the median of the pairs' ratios is printed, so a machine whose speed drifts (a shared
host) moves both sides of each ratio together.

* ``extend`` cases (``smollm2@3584`` ...): 512 new tokens after the context, one layer,
  GFLOP/s of causal work (QK^T and PV of the keys each token sees) over the matmul's.
  Heads: SmolLM2 (9 query, 3 KV, head_dim 64), Gemma 3 270M (4 query, 1 KV, head_dim 256).
* ``decode`` cases (``shared@8`` ...): that many rows over a 3,500-token document with a
  40-token tail each, the document's pages shared by every row (``shared``) or each row's
  own (``own``); SmolLM2's heads; milliseconds per call (best of 5).

    python scripts/bench_native_rate.py [--tree PATH] [--rounds 5] [--layers 30] \
        smollm2@3584 smollm2@7680 gemma3@15872 gemma3@32256 shared@8 shared@32 own@8

``--tree`` imports ``pallas_kernels`` from another checkout (a worktree of the commit
before: ``git worktree add /tmp/before HEAD~1``), to run both side by side in alternation.
The kernels are built for each tree's sources (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

HEADS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}
PAGE = 16


def best(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def extend_case(native, jax, jnp, name: str, context: int, layers: int = 1, chunk: int = 512):
    """One call: the chunk's attention in each of ``layers`` layers of one pool, in a scan as
    the model runs it (with one layer the pool stays in the CPU's caches between calls; with
    a model's depth it does not, as in the engine)."""
    q_heads, kv_heads, head_dim = HEADS[name]
    rng = np.random.default_rng(0)
    total = context + chunk
    pages = total // PAGE + 2
    shape = (layers, 2, pages, PAGE, kv_heads, head_dim)
    pool = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    table = jnp.asarray(rng.permutation(pages)[None, : -(-total // PAGE)], jnp.int32)
    q = jnp.asarray(rng.standard_normal((chunk, q_heads, head_dim)).astype(np.float32))
    starts, lens = jnp.asarray([0, chunk], jnp.int32), jnp.asarray([total], jnp.int32)

    def all_layers(q, pool):
        def body(acc, layer):
            out = native.paged_extend_attention_pool(q, pool, layer, table, lens, starts, sm_scale=head_dim**-0.5)[0]
            return acc + out, None

        return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(layers, dtype=jnp.int32))[0]

    fn = jax.jit(all_layers)
    flops = 4.0 * sum(context + i + 1 for i in range(chunk)) * q_heads * head_dim * layers
    return (lambda: fn(q, pool).block_until_ready()), flops


def decode_case(native, jax, jnp, shared: bool, rows: int, document: int = 3500, tail: int = 40):
    q_heads, kv_heads, head_dim = HEADS["smollm2"]
    rng = np.random.default_rng(0)
    doc_pages, tail_pages = document // PAGE, -(-tail // PAGE)
    pages = (doc_pages if shared else doc_pages * rows) + tail_pages * rows + 2
    pool = jnp.asarray(rng.standard_normal((1, 2, pages, PAGE, kv_heads, head_dim)).astype(np.float32))
    order = iter(rng.permutation(pages).tolist())
    table = np.zeros((rows, doc_pages + tail_pages + 1), np.int32)
    shared_pages = [next(order) for _ in range(doc_pages)] if shared else None
    for row in range(rows):
        table[row, :doc_pages] = shared_pages if shared else [next(order) for _ in range(doc_pages)]
        table[row, doc_pages : doc_pages + tail_pages] = [next(order) for _ in range(tail_pages)]
    lens = jnp.full((rows,), doc_pages * PAGE + tail, jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, q_heads, head_dim)).astype(np.float32))
    starts, pages_of = jnp.arange(rows + 1, dtype=jnp.int32), jnp.asarray(table)
    fn = jax.jit(
        lambda q, pool: native.paged_decode_attention_pool(q, pool, 0, pages_of, lens, starts, sm_scale=0.125)[0]
    )
    return lambda: fn(q, pool).block_until_ready()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "cases", nargs="+", help="extend: smollm2@CONTEXT, gemma3@CONTEXT; decode: shared@ROWS, own@ROWS"
    )
    parser.add_argument("--tree", help="import pallas_kernels from this checkout")
    parser.add_argument("--rounds", type=int, default=5, help="matmul/kernel pairs per case (median; default 5)")
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="extend cases: layers of the pool, each attended once per call (default 1: the pool stays in the "
        "caches; 30, SmolLM2's depth: it does not, as in the engine)",
    )
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import jax
    import jax.numpy as jnp

    from pallas_kernels import native

    if not native.available():
        print(f"native kernels: {native.status()}")
        return 1
    size = 768
    a = jnp.asarray(np.random.default_rng(1).random((size, size)), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    matmul_flops = 2.0 * size**3
    print(f"native kernels: {native.status()}")
    for case in args.cases:
        kind, _, number = case.partition("@")
        if kind in HEADS:
            call, flops = extend_case(native, jax, jnp, kind, int(number), args.layers)
            call()
            ratios, times = [], []
            for _ in range(args.rounds):
                m = best(lambda: matmul(a).block_until_ready(), 5)
                t = best(call, 2)
                ratios.append((flops / t) / (matmul_flops / m))
                times.append(t)
            rate = 100 * statistics.median(ratios)
            print(f"extend {case}: {rate:.0f}% of the matmul rate, {1e3 * min(times):.1f} ms")
        elif kind in ("shared", "own"):
            call = decode_case(native, jax, jnp, kind == "shared", int(number))
            call()
            times = [best(call, 5) for _ in range(args.rounds)]
            print(f"decode {case}: {1e3 * min(times):.2f} ms (median {1e3 * statistics.median(times):.2f})")
        else:
            parser.error(f"unknown case {case!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
