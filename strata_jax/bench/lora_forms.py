"""``strata-jax bench lora-forms``: three ways to add every token's own adapter to one projection.

One projection of ``--d-in`` x ``--d-out`` (default SmolLM2's gate_proj, 576 x 1536) over
``--tokens`` tokens spread round-robin over ``--slots`` adapters of rank ``--rank``, jitted,
each the median of ``--reps`` synchronous calls, side by side with the base product ``x @ W``:

* **dense** (the engine's mixed case, ``models/lora.py``): ``((x @ A) * mask) @ B`` with every
  slot's columns, ``A [in, S*R]``, the mask keeping each token's own;
* **segmented**: tokens sorted by adapter, two ``jax.lax.ragged_dot`` products over the groups
  (``A [S, in, R]``), the result scattered back to token order;
* **gathered** (BGMV-style): each token's ``A [in, R]`` and ``B [R, out]`` gathered, then a
  batched matrix-vector product per token.

All three must agree (checked); the ratios over the base product are what a mixed step pays
per projection for its adapters, which is why the engine uses the dense form
(docs/runtime.md, "LoRA in the step").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = "one projection's LoRA three ways (dense masked, segmented ragged_dot, gathered BGMV) vs the base matmul"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="16,512", help="comma-separated token counts (default 16,512)")
    parser.add_argument("--d-in", type=int, default=576, help="input features (default 576)")
    parser.add_argument("--d-out", type=int, default=1536, help="output features (default 1536)")
    parser.add_argument("--slots", type=int, default=4, help="adapters the tokens spread over (default 4)")
    parser.add_argument("--rank", type=int, default=16, help="their rank (default 16)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per form (default 20)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def forms(slots: int, rank: int) -> dict[str, Callable[..., Any]]:
    """The jitted forms: ``f(x, w, a_stacked, b_stacked, slot) -> [T, out]``; ``a_stacked [S, in, R]``,
    ``b_stacked [S, R, out]``, ``slot [T]`` each token's adapter."""
    import jax
    import jax.numpy as jnp

    def base(x, w, a, b, slot):
        return x @ w

    def dense(x, w, a, b, slot):
        a_cols = jnp.transpose(a, (1, 0, 2)).reshape(a.shape[1], slots * rank)
        b_rows = b.reshape(slots * rank, b.shape[2])
        column_slot = jnp.arange(slots * rank) // rank
        low = jnp.where(slot[:, None] == column_slot[None, :], x @ a_cols, 0.0)
        return x @ w + low @ b_rows

    def segmented(x, w, a, b, slot):
        order = jnp.argsort(slot, stable=True)
        sizes = jnp.bincount(slot, length=slots).astype(jnp.int32)
        low = jax.lax.ragged_dot(x[order], a, sizes)
        delta = jax.lax.ragged_dot(low, b, sizes)
        return x @ w + jnp.zeros_like(delta).at[order].set(delta)

    def gathered(x, w, a, b, slot):
        low = jnp.einsum("td,tdr->tr", x, a[slot])
        return x @ w + jnp.einsum("tr,tro->to", low, b[slot])

    return {
        name: jax.jit(f)
        for name, f in (("base", base), ("dense", dense), ("segmented", segmented), ("gathered", gathered))
    }


def _median_s(f: Callable[..., Any], args: tuple, reps: int) -> float:
    f(*args).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 0.02, (args.d_in, args.d_out)), jnp.float32)
    a = jnp.asarray(rng.normal(0, 0.02, (args.slots, args.d_in, args.rank)), jnp.float32)
    b = jnp.asarray(rng.normal(0, 0.02, (args.slots, args.rank, args.d_out)), jnp.float32)
    fns = forms(args.slots, args.rank)
    result: dict[str, Any] = {
        "d_in": args.d_in,
        "d_out": args.d_out,
        "slots": args.slots,
        "rank": args.rank,
        "runs": {},
    }
    for tokens in [int(t) for t in args.tokens.split(",") if t.strip()]:
        x = jnp.asarray(rng.normal(0, 1, (tokens, args.d_in)), jnp.float32)
        slot = jnp.asarray(np.arange(tokens) % args.slots, jnp.int32)
        call = (x, w, a, b, slot)
        want = np.asarray(fns["dense"](*call))
        for name in ("segmented", "gathered"):
            got = np.asarray(fns[name](*call))
            if not np.allclose(got, want, atol=1e-4, rtol=1e-4):
                raise SystemExit(f"{name} disagrees with dense at {tokens} tokens: {np.abs(got - want).max()}")
        seconds = {name: _median_s(f, call, args.reps) for name, f in fns.items()}
        ratios = {name: seconds[name] / seconds["base"] for name in ("dense", "segmented", "gathered")}
        result["runs"][tokens] = {"seconds": seconds, "ratio_over_base": ratios}
        print(
            f"{tokens} tokens over {args.slots} adapters: base {seconds['base'] * 1e6:.0f} us; "
            + ", ".join(f"{n} {seconds[n] * 1e6:.0f} us ({ratios[n]:.2f}x)" for n in ratios)
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
