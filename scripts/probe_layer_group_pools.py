"""Two layer groups under one layer scan: two pools picked by ``lax.cond`` vs one flat pool of rows.

    python scripts/probe_layer_group_pools.py

Issue 22's layer groups give the local (sliding-window) layers a smaller pool than the
global ones.  Under ``jax.lax.scan`` a layer must then write and read the pool of its
group.  This probe times one donated step of a 12-layer scan (every 6th layer global)
writing 8 tokens per layer, at three pool sizes:

* ``cond``: two pools in the carry, ``lax.cond`` on the layer's group picks which one;
* ``flat``: one array of rows ``[R, S, H, D]`` (each layer's K rows, then its V rows;
  local layers have fewer pages), a layer finds its rows at ``base[l] + page`` and its
  page table by group (``jnp.where``), no cond.

A step that updates its pools in place costs the same at every pool size.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, PAGE, HEADS, HEAD_DIM, TOKENS = 12, 16, 2, 64, 8
IS_LOCAL = np.array([(i + 1) % 6 != 0 for i in range(LAYERS)])


def _group_index() -> np.ndarray:
    out, counts = np.zeros(LAYERS, np.int32), [0, 0]
    for i, local in enumerate(IS_LOCAL):
        out[i] = counts[int(local)]
        counts[int(local)] += 1
    return out


def cond_step(pg, pl, x, pages_g, pages_l):
    def body(carry, vals):
        x, pg, pl = carry
        local, idx = vals
        kv = jnp.tanh(x)

        def write_local(pools):
            return pools[0], pools[1].at[idx, 0, pages_l, 0].set(kv)

        def write_global(pools):
            return pools[0].at[idx, 0, pages_g, 0].set(kv), pools[1]

        pg, pl = jax.lax.cond(local, write_local, write_global, (pg, pl))
        read = jax.lax.cond(local, lambda: pl[idx, 0, 0].sum(), lambda: pg[idx, 0, 0].sum())
        return (x + read * 1e-6, pg, pl), None

    (x, pg, pl), _ = jax.lax.scan(body, (x, pg, pl), (jnp.asarray(IS_LOCAL), jnp.asarray(_group_index())))
    return x, pg, pl


def flat_bases(global_pages: int, local_pages: int) -> tuple[np.ndarray, np.ndarray, int]:
    k_base, v_base, rows = [], [], 0
    for local in IS_LOCAL:
        pages = local_pages if local else global_pages
        k_base.append(rows)
        v_base.append(rows + pages)
        rows += 2 * pages
    return np.array(k_base, np.int32), np.array(v_base, np.int32), rows


def flat_step(pool, x, pages_g, pages_l, k_base, v_base):
    def body(carry, vals):
        x, pool = carry
        local, kb, vb = vals
        kv = jnp.tanh(x)
        pages = jnp.where(local, pages_l, pages_g)
        pool = pool.at[kb + pages, 0].set(kv).at[vb + pages, 0].set(kv)
        return (x + pool[kb + pages[0], 0].sum() * 1e-6, pool), None

    (x, pool), _ = jax.lax.scan(body, (x, pool), (jnp.asarray(IS_LOCAL), k_base, v_base))
    return x, pool


def _median_ms(step, state: list, repeats: int = 7) -> float:
    step(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(state)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    x = jnp.ones((TOKENS, HEADS, HEAD_DIM), jnp.float32)
    pages = jnp.arange(TOKENS, dtype=jnp.int32)
    n_global, n_local = int((~IS_LOCAL).sum()), int(IS_LOCAL.sum())
    cond_jit = jax.jit(cond_step, donate_argnums=(0, 1))
    flat_jit = jax.jit(flat_step, donate_argnums=0)
    print(f"{'pools MiB':>10} {'cond ms':>9} {'flat ms':>9}")
    for scale in (1, 4, 16):
        global_pages, local_pages = 256 * scale, 64 * scale
        shape = (PAGE, HEADS, HEAD_DIM)
        pools = [jnp.zeros((n_global, 2, global_pages, *shape)), jnp.zeros((n_local, 2, local_pages, *shape))]

        def run_cond(state: list) -> None:
            _, state[0], state[1] = cond_jit(state[0], state[1], x, pages, pages)
            jax.block_until_ready(state)

        k_base, v_base, rows = flat_bases(global_pages, local_pages)
        flat = [jnp.zeros((rows, *shape))]

        def run_flat(state: list, k_base=k_base, v_base=v_base) -> None:
            _, state[0] = flat_jit(state[0], x, pages, pages, jnp.asarray(k_base), jnp.asarray(v_base))
            jax.block_until_ready(state)

        mib = sum(p.nbytes for p in pools) / 2**20
        print(f"{mib:>10.0f} {_median_ms(run_cond, pools):>9.2f} {_median_ms(run_flat, flat):>9.2f}", flush=True)


if __name__ == "__main__":
    main()
