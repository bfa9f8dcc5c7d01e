"""``strata-jax bench attention``: ragged paged attention, Pallas kernel vs pure-JAX reference.

Two batches on the present platform, each timed for the kernel and the reference
side by side (interleaved repeats, median kept) and checked for agreement:

* ``decode``: ``--batch`` sequences of ``--context`` cached tokens, one new token each
  (``max_q_len=1``).  Reports achieved bandwidth = bytes the kernel must read (every
  sequence's K and V, plus q and out) / kernel time: on a GPU this is the HBM
  bandwidth decode attains.
* ``extend``: ``--extend-seqs`` sequences adding ``--extend-tokens`` tokens each on
  top of ``--context`` cached tokens, mixed with ``--batch`` decodes (a ragged batch).

On CPU the kernel runs in interpret mode (a correctness run, slow by design) and
default shapes are small; on CUDA/ROCm the compiled Triton kernel runs at
Llama-3.1-8B shapes.  ``--kernel`` overrides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

DESCRIPTION = "ragged paged attention: Pallas kernel vs pure-JAX reference (decode bandwidth on GPU)"

# (batch, context, extend_seqs, extend_tokens, q_heads, kv_heads, head_dim, dtype) per platform class.
_GPU_DEFAULTS = dict(
    batch=64, context=4096, extend_seqs=4, extend_tokens=512, q_heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"
)
_CPU_DEFAULTS = dict(
    batch=4, context=256, extend_seqs=2, extend_tokens=16, q_heads=8, kv_heads=2, head_dim=64, dtype="float32"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, help="decode sequences (default: 64 on GPU, 4 on CPU)")
    parser.add_argument("--context", type=int, help="cached tokens per sequence (default: 4096 on GPU, 256 on CPU)")
    parser.add_argument(
        "--extend-seqs", type=int, help="sequences extending in the ragged batch (default: 4 GPU / 2 CPU)"
    )
    parser.add_argument(
        "--extend-tokens", type=int, help="new tokens per extending sequence (default: 512 GPU / 16 CPU)"
    )
    parser.add_argument("--q-heads", type=int, help="query heads (default: 32 GPU / 8 CPU)")
    parser.add_argument("--kv-heads", type=int, help="KV heads (default: 8 GPU / 2 CPU)")
    parser.add_argument("--head-dim", type=int, help="head dim (default: 128 GPU / 64 CPU)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="dtype (default: bfloat16 GPU / float32 CPU)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    parser.add_argument("--soft-cap", type=float, default=None, help="logit soft-cap (default: none)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats (median kept; default: 10)")
    parser.add_argument(
        "--kernel",
        choices=["pallas", "interpret"],
        default=None,
        help="kernel implementation (default: pallas on CUDA/ROCm, interpret elsewhere)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")


def _resolve(args: argparse.Namespace, on_gpu: bool) -> dict:
    defaults = _GPU_DEFAULTS if on_gpu else _CPU_DEFAULTS
    shape: dict[str, Any] = {
        key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()
    }
    for key in ("batch", "context", "q_heads", "kv_heads", "head_dim"):
        if shape[key] <= 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be positive")
    if shape["q_heads"] % shape["kv_heads"]:
        raise SystemExit("--q-heads must be a multiple of --kv-heads")
    if args.page_size <= 0 or args.repeats <= 0:
        raise SystemExit("--page-size and --repeats must be positive")
    return shape


def _make_batch(rng, shape: dict, page_size: int, q_lens, ctx_lens):
    import jax.numpy as jnp
    import numpy as np

    q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
    seq_lens = q_lens + ctx_lens
    pages_per_seq = -(-seq_lens // page_size)
    num_pages = int(pages_per_seq.sum())
    max_pages = int(pages_per_seq.max())
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(seq_lens), max_pages), np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages_per_seq)])
    for b in range(len(seq_lens)):
        table[b, : pages_per_seq[b]] = perm[offsets[b] : offsets[b + 1]]
    dtype = jnp.dtype(shape["dtype"])
    kv_shape = (num_pages, page_size, shape["kv_heads"], shape["head_dim"])
    k = jnp.asarray(rng.standard_normal(kv_shape, dtype=np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(kv_shape, dtype=np.float32), dtype)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(
        rng.standard_normal((int(query_start[-1]), shape["q_heads"], shape["head_dim"]), dtype=np.float32), dtype
    )
    return (q, k, v, jnp.asarray(table), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(query_start))


def _time(fn, args, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def _scenario(batch_args, shape, args, kernel_name, max_q_len) -> dict:
    import functools

    import jax
    import numpy as np

    from pallas_kernels import dispatch

    scale = shape["head_dim"] ** -0.5
    kernel = jax.jit(
        functools.partial(
            dispatch.ragged_paged_attention,
            sm_scale=scale,
            soft_cap=args.soft_cap,
            max_q_len=max_q_len,
            backend=kernel_name,
        )
    )
    reference = jax.jit(
        functools.partial(dispatch.ragged_paged_attention, sm_scale=scale, soft_cap=args.soft_cap, backend="reference")
    )
    got, want = kernel(*batch_args), reference(*batch_args)  # compile + correctness
    err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    kernel_times, ref_times = [], []
    for _ in range(args.repeats):  # interleaved
        kernel_times += _time(kernel, batch_args, 1)
        ref_times += _time(reference, batch_args, 1)
    q, k, _, _, seq_lens, _ = batch_args
    itemsize = k.dtype.itemsize
    kv_bytes = int(np.sum(np.asarray(seq_lens))) * shape["kv_heads"] * shape["head_dim"] * 2 * itemsize
    io_bytes = 2 * q.size * itemsize
    kernel_s, ref_s = statistics.median(kernel_times), statistics.median(ref_times)
    return {
        "tokens": int(q.shape[0]),
        "sequences": int(seq_lens.shape[0]),
        "kv_tokens": int(np.sum(np.asarray(seq_lens))),
        "kernel_ms": 1e3 * kernel_s,
        "reference_ms": 1e3 * ref_s,
        "speedup_vs_reference": ref_s / kernel_s,
        "max_abs_err": err,
        "bytes_read": kv_bytes + io_bytes,
        "kernel_gbps": (kv_bytes + io_bytes) / kernel_s / 1e9,
        "reference_gbps": (kv_bytes + io_bytes) / ref_s / 1e9,
    }


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from pallas_kernels.dispatch import platform_name

    platform = platform_name()
    on_gpu = platform in ("cuda", "rocm")
    shape = _resolve(args, on_gpu)
    kernel_name = args.kernel or ("pallas" if on_gpu else "interpret")
    rng = np.random.default_rng(args.seed)
    report: dict = {"platform": platform, "kernel": kernel_name, "page_size": args.page_size, "shape": shape}
    decode = _make_batch(rng, shape, args.page_size, [1] * shape["batch"], [shape["context"]] * shape["batch"])
    report["decode"] = _scenario(decode, shape, args, kernel_name, max_q_len=1)
    ext_q = [shape["extend_tokens"]] * shape["extend_seqs"] + [1] * shape["batch"]
    ext_ctx = [shape["context"]] * (shape["extend_seqs"] + shape["batch"])
    if shape["extend_seqs"] > 0 and shape["extend_tokens"] > 0:
        extend = _make_batch(rng, shape, args.page_size, ext_q, ext_ctx)
        report["extend"] = _scenario(extend, shape, args, kernel_name, max_q_len=None)
    print(
        f"platform={platform} kernel={kernel_name} page_size={args.page_size} "
        f"{shape['q_heads']}q/{shape['kv_heads']}kv heads x {shape['head_dim']} {shape['dtype']}"
    )
    for name in ("decode", "extend"):
        if name in report:
            row = report[name]
            print(
                f"{name:>7}: {row['sequences']} seqs, {row['tokens']} new tokens, {row['kv_tokens']} KV tokens | "
                f"kernel {row['kernel_ms']:.3f} ms ({row['kernel_gbps']:.1f} GB/s) | reference "
                f"{row['reference_ms']:.3f} ms "
                f"({row['reference_gbps']:.1f} GB/s) | x{row['speedup_vs_reference']:.2f} | max|err| "
                f"{row['max_abs_err']:.2e}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0
