"""Decode-step pieces on CPU, side by side in one run (SmolLM2-135M shapes, float32):

1. the layer matmuls of a 30-layer scan over stacked weights vs per-layer weights picked
   by a switch (``llama.LayerKernels``, ``layer_weights="per_layer"``), batch 1 and 16;
2. decode attention under a 30-layer scan, the native kernel (``pallas_kernels.native``)
   vs the block-causal XLA decode (``pallas_kernels.blocked``), ~2,000-token contexts:
   1, 4 and 16 rows on contiguous and on scattered pages, and 16 rows as 4 documents x 4
   questions (each document's pages shared by its 4 rows, the peer benchmark's shape).

    python scripts/bench_decode_kernels.py [--repeats 7]

Prints medians and ratios; the outputs of each pair are compared (max |diff|).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.blocked import blocked_paged_attention_pool
from strata_jax.models.llama import LayerKernels

LAYERS, HIDDEN, INTERMEDIATE, KV_WIDTH = 30, 576, 1536, 192
PAGES, PAGE, KV_HEADS, HEAD_DIM, Q_HEADS = 4096, 16, 3, 64, 9
CONTEXT = 2000


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def layer_matmuls(repeats: int, rng: np.random.Generator) -> None:
    shapes = {
        "q": (HIDDEN, HIDDEN),
        "k": (HIDDEN, KV_WIDTH),
        "v": (HIDDEN, KV_WIDTH),
        "o": (HIDDEN, HIDDEN),
        "gate": (HIDDEN, INTERMEDIATE),
        "up": (HIDDEN, INTERMEDIATE),
        "down": (INTERMEDIATE, HIDDEN),
    }
    stacked = {n: jnp.asarray(rng.standard_normal((LAYERS, *s), dtype=np.float32) * 0.02) for n, s in shapes.items()}
    per_layer = {n: tuple(jnp.array(a[i]) for i in range(LAYERS)) for n, a in stacked.items()}

    def layer(x, mm):
        attn = mm("q", x) + jnp.pad(mm("k", x) + mm("v", x), ((0, 0), (0, HIDDEN - KV_WIDTH)))
        x = x + mm("o", jnp.tanh(attn))
        return x + mm("down", jax.nn.silu(mm("gate", x)) * mm("up", x))

    @jax.jit
    def scan_stacked(x, weights):
        return jax.lax.scan(lambda x, w: (layer(x, lambda n, h: h @ w[n]), None), x, weights)[0]

    @jax.jit
    def scan_per_layer(x, weights):
        def body(x, i):
            return layer(x, lambda n, h: LayerKernels(i, weights[n]).matmul(h)), None

        return jax.lax.scan(body, x, jnp.arange(LAYERS))[0]

    for rows in (1, 16):
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), dtype=np.float32))
        a, b = scan_stacked(x, stacked), scan_per_layer(x, per_layer)
        t_stacked = median_ms(scan_stacked, x, stacked, repeats=repeats)
        t_per_layer = median_ms(scan_per_layer, x, per_layer, repeats=repeats)
        print(
            f"layer matmuls, {rows:2d} rows: stacked {t_stacked:6.1f} ms  per_layer {t_per_layer:6.1f} ms  "
            f"ratio {t_per_layer / t_stacked:.2f}  max|diff| {float(jnp.abs(a - b).max()):.1e}",
            flush=True,
        )


def decode_attention(repeats: int, rng: np.random.Generator) -> None:
    if not native.available():
        print(f"native decode attention: {native.status()}; skipped")
        return
    pool = jnp.asarray(rng.standard_normal((LAYERS, 2, PAGES, PAGE, KV_HEADS, HEAD_DIM), dtype=np.float32))
    width = -(-CONTEXT // PAGE) + 8

    def scan_of(attention):
        @jax.jit
        def run(q, pool, table, lens):
            starts = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)

            def body(acc, layer):
                return acc + attention(q, pool, layer, table, lens, starts, sm_scale=0.125)[0], None

            return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(LAYERS))[0]

        return run

    runs = {
        "native": scan_of(native.paged_decode_attention_pool),
        "xla": scan_of(partial(blocked_paged_attention_pool)),
    }
    cases = []
    for rows in (1, 4, 16):
        cases.append((f"{rows:2d} rows, contiguous", np.arange(rows * width).reshape(rows, width)))
        cases.append((f"{rows:2d} rows, scattered ", rng.permutation(PAGES)[: rows * width].reshape(rows, width)))
    docs = [rng.permutation(PAGES)[:width] for _ in range(4)]
    shared = np.stack([docs[i // 4].copy() for i in range(16)])
    shared[:, -10:] = rng.integers(0, PAGES, (16, 10))  # each question's own last pages
    cases.append(("16 rows, 4 docs x 4   ", shared))
    for name, table in cases:
        rows = table.shape[0]
        table = jnp.asarray(table, jnp.int32)
        lens = jnp.asarray(np.full(rows, CONTEXT, np.int32))
        q = jnp.asarray(rng.standard_normal((rows, Q_HEADS, HEAD_DIM), dtype=np.float32))
        outs = {k: fn(q, pool, table, lens) for k, fn in runs.items()}
        times = {k: median_ms(fn, q, pool, table, lens, repeats=repeats) for k, fn in runs.items()}
        print(
            f"decode attention, {name}: native {times['native']:6.1f} ms  xla {times['xla']:6.1f} ms  "
            f"ratio {times['native'] / times['xla']:.2f}  max|diff| "
            f"{float(jnp.abs(outs['native'] - outs['xla']).max()):.1e}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    layer_matmuls(args.repeats, rng)
    decode_attention(args.repeats, rng)


if __name__ == "__main__":
    main()
