"""``strata-jax bench moe``: one mixture-of-experts layer, the engine's grouped matmuls against
a dense matmul of the same FLOPs and against the per-expert loop they replace.

Why: ``models/moe.py`` runs the experts as ``jax.lax.ragged_dot`` over the ``T * k``
(token, expert) rows sorted by expert.  Whether that pays depends on how the platform
lowers ``ragged_dot``; the two yardsticks that say so are the same routed work done as
one plain matmul chain (what a perfect grouped GEMM would approach) and the dense-masked
loop a naive MoE runs (every token through every expert).  The issue's target: the grouped
path at >= 0.5x the FLOP/s of the dense chain.  On CPU, JAX expands ``ragged_dot`` into a
masked dense dot over every (row, expert) pair (docs/models.md, "Why ragged_dot"), so
there the ratios, not the absolute rates, are the result.

Per token count of ``--tokens``, on one random layer (``MoEBlock`` of a ``qwen3_moe``-like
config: ``--hidden``, ``--experts``, ``--top-k``, ``--intermediate``; ``--dtype``), x of
``T`` random rows, routed once by the block's own router (``moe.route``):

* **grouped**: the engine's code, ``MoEBlock.experts`` (``Experts.__call__``: three
  ``ragged_dot``s and the SiLU gate) on the ``T * k`` rows already sorted by expert with
  their group sizes -- the expert matmuls alone, as the block calls them;
* **dense**: the same FLOPs without routing: one ``[T*k, D] x [D, F]`` gate and up and one
  ``[T*k, F] x [F, D]`` down (expert 0's kernels for every row);
* **loop**: the dense-per-expert loop, masked: a ``lax.scan`` over the experts, each expert
  on *every* token, its output weighted by the token's routing weight for it (zero where
  the token did not pick it) and summed: ``E / k`` times the routed FLOPs;
* **block** (unless ``--no-block``): the whole ``MoEBlock.__call__`` (router, top-k, sort,
  grouped matmuls, unpermute, weighted sum), to show what the routing around the grouped
  matmuls costs.

Each path is jitted with the weights as arguments, run once (compile, warm-up, and the
outputs compared: the grouped rows, weighted and put back in token order, and the block
against the loop), then timed in interleaved rounds (one call of each path per round, so
a shared machine's load falls on all alike); the median and the minimum are kept.  A token
count stops after ``--time-limit`` seconds of rounds once it has two.  Reported per path:
**expert FLOP/s** = the routed work, ``6 * T * k * D * F`` FLOPs, over its time (the same
numerator for every path, so the ratios of FLOP/s are ratios of time); the ratios
grouped/dense (target >= 0.5) and grouped/loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # jax loads only when a path is built
    from strata_jax.models.grouped_mlp import Method as GroupedMethod

DESCRIPTION = "one MoE layer: the engine's ragged_dot experts vs a dense matmul of the same FLOPs vs a per-expert loop"

# The bar for the grouped path: this share of the dense chain's FLOP/s.
TARGET_GROUPED_VS_DENSE = 0.5
PATHS = ("grouped", "ragged_dot", "dense", "loop", "block")


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer: hidden size ``D``, ``E`` experts, ``k`` picked per token, expert width ``F``."""

    hidden: int = 1024
    experts: int = 32
    top_k: int = 4
    intermediate: int = 512
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("hidden", "experts", "top_k", "intermediate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")

    def expert_flops(self, tokens: int) -> int:
        """The routed work of ``tokens`` tokens: ``T * k`` rows through gate, up (``D x F``) and
        down (``F x D``), 2 FLOPs a multiply-add.  The numerator of every path's FLOP/s."""
        return 6 * tokens * self.top_k * self.hidden * self.intermediate


def moe_config(shape: LayerShape) -> Any:
    """A one-layer ``qwen3_moe``-like ``ModelConfig`` whose MLP is ``shape`` (renormalized top-k,
    no shared expert); only the MoE fields matter to the block."""
    from strata_jax.models.config import ModelConfig, MoEConfig

    return ModelConfig(
        model_type="qwen3_moe",
        vocab_size=32,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=shape.hidden,
        moe=MoEConfig(shape.experts, shape.top_k, shape.intermediate, norm_topk_prob=True),
    )


def make_block(shape: LayerShape, seed: int = 0) -> Any:
    """The engine's ``MoEBlock`` with random weights (std ``hidden ** -0.5``: activations of
    order one, so the outputs' agreement is measured on numbers of a sensible size)."""
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.models.moe import MoEBlock

    return MoEBlock(moe_config(shape), jnp.dtype(shape.dtype), nnx.Rngs(params=seed), std=shape.hidden**-0.5)


@dataclass(frozen=True)
class Routed:
    """``x`` routed by the block's router, in the forms each path takes: the rows sorted by expert
    with ``group_sizes`` (grouped), ``slot`` / ``weights`` to put the grouped rows back
    (``combine``), and the dense ``[E, T]`` routing weights, zero where not picked (loop)."""

    x: Any  # [T, D]
    rows: Any  # [T*k, D], sorted by expert
    group_sizes: Any  # [E] int32
    slot: np.ndarray  # [T*k]: the sorted row of assignment token * k + pick
    weights: np.ndarray  # [T, k] float32
    dense_weights: Any  # [E, T] float32


def route_tokens(block: Any, x: Any) -> Routed:
    """Route ``x`` with ``moe.route`` on the block's router and sort the assignments by expert
    (stable), as ``MoEBlock.__call__`` does, so the grouped path sees the rows the engine's
    would."""
    import jax
    import jax.numpy as jnp

    from strata_jax.models.moe import route

    k, e = block.top_k, block.num_experts
    weights, experts = jax.jit(lambda x: route(block.gate(x), k, block.norm_topk_prob))(x)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    order_np = np.asarray(order)
    slot = np.empty_like(order_np)
    slot[order_np] = np.arange(order_np.shape[0])
    tokens = x.shape[0]
    dense = np.zeros((tokens, e), np.float32)
    np.put_along_axis(dense, np.asarray(experts), np.asarray(weights, np.float32), axis=-1)
    return Routed(
        x=x,
        rows=x[order // k],
        group_sizes=group_sizes,
        slot=slot,
        weights=np.asarray(weights, np.float32),
        dense_weights=jnp.asarray(dense.T),
    )


def combine(grouped_out: Any, routed: Routed) -> np.ndarray:
    """The grouped path's ``[T*k, D]`` rows back in token order, weighted and summed per token
    (float32 numpy): the layer output, to compare with the loop's."""
    out = np.asarray(grouped_out, np.float32)[routed.slot]
    tokens, k = routed.weights.shape
    return np.einsum("tkd,tk->td", out.reshape(tokens, k, -1), routed.weights)


def expert_kernels(block: Any) -> tuple[Any, Any, Any]:
    """The block's ``[E, D, F]`` gate and up and ``[E, F, D]`` down kernels."""
    experts = block.experts
    return (
        experts.gate_proj.kernel.get_value(),
        experts.up_proj.kernel.get_value(),
        experts.down_proj.kernel.get_value(),
    )


def grouped_path(block: Any, method: GroupedMethod = "auto") -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted fn, its leading args): ``fn(*lead, rows, group_sizes)`` calls the engine's
    ``Experts`` on rows sorted by expert, computed by ``method`` (``grouped_mlp``; "auto": the
    platform's).  The weights travel as arguments, as the engine's step passes them, so XLA
    cannot fold them into constants."""
    import jax
    from flax import nnx

    from strata_jax.models import grouped_mlp

    graphdef, state = nnx.split(block.experts)

    def grouped(state: Any, rows: Any, sizes: Any) -> Any:
        with grouped_mlp.use_method(method):  # read while tracing
            return nnx.merge(graphdef, state)(rows, sizes)

    return jax.jit(grouped), (state,)


def block_path(block: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted fn, its leading args): ``fn(*lead, x)`` is the whole ``MoEBlock.__call__``."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(block)
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)), (state,)


def dense_path(block: Any, act_name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted fn, its leading args): ``fn(*lead, rows)`` is ``down(act(rows @ gate) * (rows @ up))``
    with expert 0's kernels for every row: the routed FLOPs as one plain matmul chain."""
    import jax

    from strata_jax.models.llama import activation

    act = activation(act_name)
    gate, up, down = (kernel[0] for kernel in expert_kernels(block))

    def dense(gate: Any, up: Any, down: Any, rows: Any) -> Any:
        return (act(rows @ gate) * (rows @ up)) @ down

    return jax.jit(dense), (gate, up, down)


def loop_path(block: Any, act_name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(jitted fn, its leading args): ``fn(*lead, x, dense_weights)``: a ``lax.scan`` over the
    experts, each on every token, weighted by ``dense_weights[e]`` (0 where not picked),
    accumulated in float32: the dense-masked MoE, ``E / k`` times the routed FLOPs."""
    import jax
    import jax.numpy as jnp

    from strata_jax.models.llama import activation

    act = activation(act_name)

    def loop(gate: Any, up: Any, down: Any, x: Any, dense_weights: Any) -> Any:
        def one_expert(y: Any, expert: tuple[Any, Any, Any, Any]) -> tuple[Any, None]:
            g, u, d, w = expert
            out = (act(x @ g) * (x @ u)) @ d
            return y + w[:, None] * out.astype(jnp.float32), None

        y0 = jnp.zeros(x.shape, jnp.float32)
        y, _ = jax.lax.scan(one_expert, y0, (gate, up, down, dense_weights))
        return y.astype(x.dtype)

    return jax.jit(loop), expert_kernels(block)


def _rel_err(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (float32): an error independent of the outputs' scale."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))


def _timed(call: Callable[[], Any]) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def measure_point(
    block: Any,
    shape: LayerShape,
    tokens: int,
    *,
    repeats: int,
    time_limit_s: float,
    with_block: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Time every path at ``tokens`` tokens (interleaved rounds, see the module doc) and compare
    their outputs.  Returns the row of the report: milliseconds (median, min, every run),
    expert GFLOP/s per path, the ratios and the relative errors."""
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(seed + tokens).normal(size=(tokens, shape.hidden)), jnp.dtype(shape.dtype))
    routed = route_tokens(block, x)
    act_name = block.experts.act_name
    fns: dict[str, Callable[[], Any]] = {}
    grouped, lead = grouped_path(block)
    fns["grouped"] = lambda: grouped(*lead, routed.rows, routed.group_sizes)
    ragged, rlead = grouped_path(block, "ragged_dot")
    fns["ragged_dot"] = lambda: ragged(*rlead, routed.rows, routed.group_sizes)
    dense, dlead = dense_path(block, act_name)
    fns["dense"] = lambda: dense(*dlead, routed.rows)
    loop, llead = loop_path(block, act_name)
    fns["loop"] = lambda: loop(*llead, routed.x, routed.dense_weights)
    if with_block:
        whole, blead = block_path(block)
        fns["block"] = lambda: whole(*blead, routed.x)
    outputs: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    for name, fn in fns.items():  # compile + warm up, and keep the outputs to compare
        start = time.perf_counter()
        outputs[name] = np.asarray(fn())
        compile_s[name] = time.perf_counter() - start
    reference = outputs["loop"]
    errors = {
        "grouped_vs_loop": _rel_err(combine(outputs["grouped"], routed), reference),
        "ragged_dot_vs_loop": _rel_err(combine(outputs["ragged_dot"], routed), reference),
    }
    if with_block:
        errors["block_vs_loop"] = _rel_err(outputs["block"], reference)
    runs: dict[str, list[float]] = {name: [] for name in fns}
    started = time.perf_counter()
    for round_ in range(repeats):
        if round_ >= 2 and time.perf_counter() - started > time_limit_s:
            break
        for name, fn in fns.items():
            runs[name].append(_timed(fn))
    flops = shape.expert_flops(tokens)
    picked = int(np.count_nonzero(np.asarray(routed.group_sizes)))
    expert_bytes = 3 * shape.hidden * shape.intermediate * jnp.dtype(shape.dtype).itemsize
    median = {name: statistics.median(times) for name, times in runs.items()}
    row: dict[str, Any] = {
        "tokens": tokens,
        "assignments": tokens * shape.top_k,
        "expert_flops": flops,
        "loop_executed_flops": flops * shape.experts // shape.top_k,
        "group_sizes": [int(g) for g in np.asarray(routed.group_sizes)],
        "rounds": len(runs["grouped"]),
        "first_call_s": compile_s,
        "ms": {
            name: {"median": 1e3 * median[name], "min": 1e3 * min(times), "runs": [1e3 * t for t in times]}
            for name, times in runs.items()
        },
        "expert_gflops": {name: flops / median[name] / 1e9 for name in runs},
        # decode-sized batches are bound by the expert weights they read, not by FLOPs: the
        # grouped path reads each picked expert's kernels, the dense chain one expert's
        "experts_read": picked,
        "weight_gb_per_s": {
            "grouped": picked * expert_bytes / median["grouped"] / 1e9,
            "dense": expert_bytes / median["dense"] / 1e9,
        },
        "ratios": {
            "grouped_vs_dense": median["dense"] / median["grouped"],
            "grouped_vs_loop": median["loop"] / median["grouped"],
            "grouped_vs_ragged_dot": median["ragged_dot"] / median["grouped"],
        },
        "rel_err": errors,
    }
    if with_block:
        row["ratios"]["block_vs_loop"] = median["loop"] / median["block"]
    return row


def run_layer_bench(
    shape: LayerShape,
    tokens: Sequence[int],
    *,
    repeats: int = 5,
    time_limit_s: float = 20.0,
    with_block: bool = True,
    seed: int = 0,
    deadline: float | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole report: the device, the shape, one ``measure_point`` row per token count (in
    order).  ``deadline`` (a ``time.perf_counter()`` value): token counts after the first not
    started by then are listed under ``skipped`` (the GPU check's time box); the first always
    runs, so a late start (a loaded machine, a slow engine phase) still yields one measured
    row.  ``on_point`` sees the report after every row (to save what was measured so far)."""
    import jax

    from strata_jax.models import grouped_mlp

    device = jax.devices()[0]
    report: dict[str, Any] = {
        "device": {"platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__},
        "grouped_method": grouped_mlp.resolve_method(),
        "shape": asdict(shape),
        "repeats": repeats,
        "time_limit_s": time_limit_s,
        "target_grouped_vs_dense": TARGET_GROUPED_VS_DENSE,
        "loop": "masked: lax.scan over the experts, each on every token, weighted (0 where not picked)",
        "points": [],
        "skipped": [],
    }
    block = make_block(shape, seed)
    for count in tokens:
        if deadline is not None and report["points"] and time.perf_counter() > deadline:
            report["skipped"].append(count)
            continue
        report["points"].append(
            measure_point(
                block, shape, count, repeats=repeats, time_limit_s=time_limit_s, with_block=with_block, seed=seed
            )
        )
        if on_point is not None:
            on_point(report)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The table a human reads: ms and expert GFLOP/s per path, the ratios, the errors."""
    s, d = report["shape"], report["device"]
    with_block = any("block" in p["ms"] for p in report["points"])
    lines = [
        f"MoE layer: hidden {s['hidden']}, {s['experts']} experts, top-{s['top_k']}, expert width "
        f"{s['intermediate']}, {s['dtype']} on {d['device_kind']} ({d['platform']}), jax {d['jax']}",
        "expert FLOPs = 6 x tokens x top-k x hidden x width (the routed work; the loop executes "
        f"{s['experts']}/{s['top_k']} = {s['experts'] / s['top_k']:.1f}x that); median of interleaved rounds",
        f"grouped: the engine's Experts on rows sorted by expert ({report.get('grouped_method', '?')} here) | "
        "ragged_dot: the same with jax.lax.ragged_dot | dense: one matmul chain, same FLOPs | "
        "loop: every expert on every token, masked" + (" | block: the whole MoEBlock" if with_block else ""),
    ]
    header = "tokens | grouped ms | ragged_dot ms | dense ms | loop ms" + (" | block ms" if with_block else "")
    header += " | GFLOP/s grouped / ragged_dot / dense / loop" + (" / block" if with_block else "")
    header += " | grouped/dense | grouped/loop | grouped/ragged_dot | rel err grouped, ragged_dot, block vs loop"
    header += " | experts read, weight GB/s grouped / dense | rounds"
    lines.append(header)
    for p in report["points"]:
        ms, gf, r, e = p["ms"], p["expert_gflops"], p["ratios"], p["rel_err"]
        names = [n for n in PATHS if n in ms]
        cells = [f"{p['tokens']:>6}"] + [f"{ms[n]['median']:.3f}" for n in names]
        cells.append(" / ".join(f"{gf[n]:.1f}" for n in names))
        cells.append(f"{r['grouped_vs_dense']:.3f}x")
        cells.append(f"{r['grouped_vs_loop']:.2f}x")
        cells.append(f"{r['grouped_vs_ragged_dot']:.2f}x")
        keys = ("grouped_vs_loop", "ragged_dot_vs_loop", "block_vs_loop")
        cells.append(", ".join(f"{e[k]:.1e}" for k in keys if k in e))
        wb = p["weight_gb_per_s"]
        cells.append(f"{p['experts_read']}, {wb['grouped']:.1f} / {wb['dense']:.1f}")
        cells.append(str(p["rounds"]))
        lines.append(" | ".join(cells))
    if report["points"]:
        worst = min(p["ratios"]["grouped_vs_dense"] for p in report["points"])
        verdict = "meets" if worst >= report["target_grouped_vs_dense"] else "misses"
        lines.append(
            f"grouped/dense at worst {worst:.3f}x: {verdict} the target of >= "
            f"{report['target_grouped_vs_dense']}x the dense chain's FLOP/s"
        )
    if report["skipped"]:
        lines.append(f"skipped (out of time): tokens {report['skipped']}")
    return "\n".join(lines)


def parse_tokens(text: str) -> list[int]:
    """``"1,16,128"`` -> ``[1, 16, 128]``; every count positive."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise SystemExit(f"--tokens takes comma-separated integers, got {text!r}") from exc
    if not counts or min(counts) <= 0:
        raise SystemExit(f"--tokens needs positive token counts, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LayerShape()
    parser.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden size D (default: {d.hidden})")
    parser.add_argument("--experts", type=int, default=d.experts, help=f"routed experts E (default: {d.experts})")
    parser.add_argument("--top-k", type=int, default=d.top_k, help=f"experts picked per token k (default: {d.top_k})")
    parser.add_argument(
        "--intermediate", type=int, default=d.intermediate, help=f"expert width F (default: {d.intermediate})"
    )
    parser.add_argument(
        "--tokens",
        default="1,16,128,512,2048",
        help="comma-separated token counts T, one row each (default: 1,16,128,512,2048)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=d.dtype,
        help=f"weights and activations dtype (default: {d.dtype})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds per token count, one call of each path a round (default: 5)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=20.0,
        help="seconds of timed rounds per token count after which no new round starts, once two ran (default: 20)",
    )
    parser.add_argument(
        "--no-block",
        action="store_true",
        help="skip the whole-MoEBlock path (router, sort and combine around the grouped matmuls)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    try:
        shape = LayerShape(args.hidden, args.experts, args.top_k, args.intermediate, args.dtype)
    except ValueError as exc:
        raise SystemExit(f"bad layer shape: {exc}") from exc
    if args.repeats < 2 or args.time_limit <= 0:
        raise SystemExit("--repeats must be at least 2 and --time-limit positive")
    tokens = parse_tokens(args.tokens)

    def save(report: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)

    report = run_layer_bench(
        shape,
        tokens,
        repeats=args.repeats,
        time_limit_s=args.time_limit,
        with_block=not args.no_block,
        seed=args.seed,
        on_point=save,
    )
    save(report)
    print(format_report(report))
    return 0
