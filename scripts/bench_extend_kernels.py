"""Extend (prefill) attention on CPU, side by side in one run: the native kernel
(``pallas_kernels.native.paged_extend_attention_pool``) vs the block-causal XLA attention
(``pallas_kernels.blocked``), under a scan over ``--layers`` layers, SmolLM2-135M shapes
(9 query heads, 3 KV heads, head_dim 64, float32, 16-token pages), each case twice: with a
row's pages in order (a fresh prompt) and scattered through the pool (after churn):

* a 512-token chunk at contexts 0 / 512 / 1,024 / 1,536 before it (a 2K prompt in 4 chunks);
* one 2,048-token chunk (``--max-batch-tokens 2048``);
* one 29-token question and three questions of 18-25 tokens over 1,952 cached tokens;
* a prompt's last 415 tokens beside the next prompt's first 97 (a packed step).

    python scripts/bench_extend_kernels.py [--repeats 5] [--layers 4]

Prints per-layer milliseconds (medians), the causal attention work's GFLOP/s, the ratio,
and the max |diff| of the two outputs.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.blocked import blocked_paged_attention_pool

PAGE, KV_HEADS, HEAD_DIM, Q_HEADS = 16, 3, 64, 9
CASES = (
    ("512 new, context 0", (512,), (0,)),
    ("512 new, context 512", (512,), (512,)),
    ("512 new, context 1024", (512,), (1024,)),
    ("512 new, context 1536", (512,), (1536,)),
    ("2048 new, context 0", (2048,), (0,)),
    ("29-token question over 1952", (29,), (1952,)),
    ("3 questions over 1952", (20, 25, 18), (1952, 1952, 1952)),
    ("415 + 97 (two prompts)", (415, 97), (1536, 0)),
)


def batch(rng: np.random.Generator, q_lens: tuple[int, ...], contexts: tuple[int, ...], layers: int, scattered: bool):
    """Queries, a pool, page tables (pages in order or scattered), KV lengths, query starts."""
    seq_lens = np.asarray(q_lens) + np.asarray(contexts)
    pages_needed = -(-seq_lens // PAGE)
    num_pages = int(pages_needed.sum()) + 1
    order = rng.permutation(num_pages) if scattered else np.arange(num_pages)
    width = int(pages_needed.max())
    table = np.zeros((len(q_lens), width), np.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[used : used + n]
        used += n
    pool = rng.standard_normal((layers, 2, num_pages, PAGE, KV_HEADS, HEAD_DIM), dtype=np.float32)
    q = rng.standard_normal((int(sum(q_lens)), Q_HEADS, HEAD_DIM), dtype=np.float32)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return tuple(jnp.asarray(a) for a in (q, pool, table, seq_lens.astype(np.int32), query_start))


def timed(fn, args, repeats: int) -> tuple[float, jax.Array]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case and kernel (median)")
    parser.add_argument("--layers", type=int, default=4, help="layers in the scan (each reads its own pool rows)")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"native kernels: {native.status()}")
    rng = np.random.default_rng(0)
    print(f"extend attention, {args.layers}-layer scan, per layer; native vs blocked XLA ({jax.default_backend()})")
    print("| case | pages | blocked ms | native ms | native / blocked | blocked GFLOP/s | native GFLOP/s | max diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, q_lens, contexts), scattered in ((case, s) for case in CASES for s in (False, True)):
        q, pool, table, seq_lens, query_start = batch(rng, q_lens, contexts, args.layers, scattered)
        results = {}
        for kernel in ("blocked", "native"):
            attend = blocked_paged_attention_pool if kernel == "blocked" else native.paged_extend_attention_pool

            def run(q, pool, attend=attend, table=table, seq_lens=seq_lens, query_start=query_start):
                def body(_, layer):
                    return None, attend(q, pool, layer, table, seq_lens, query_start, sm_scale=HEAD_DIM**-0.5)[0]

                return jax.lax.scan(body, None, jnp.arange(args.layers))[1]

            results[kernel] = timed(jax.jit(run), (q, pool), args.repeats)
        # causal work: QK^T and PV over the keys each new token sees
        flops = sum(4 * Q_HEADS * HEAD_DIM * (n * c + n * (n + 1) // 2) for n, c in zip(q_lens, contexts))
        (t_b, out_b), (t_n, out_n) = results["blocked"], results["native"]
        t_b, t_n = t_b / args.layers, t_n / args.layers
        diff = float(jnp.max(jnp.abs(out_b - out_n)))
        print(
            f"| {name} | {'scattered' if scattered else 'in order'} | {t_b * 1e3:.1f} | {t_n * 1e3:.1f} | "
            f"{t_n / t_b:.2f} | {flops / t_b / 1e9:.0f} | "
            f"{flops / t_n / 1e9:.0f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
