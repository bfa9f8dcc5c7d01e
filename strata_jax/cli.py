"""Command line of the engine: ``strata-jax generate``, ``demo``, ``info`` and ``bench NAME``.

The console script lives in ``serving.cli`` (which adds ``serve``) so that this
package never imports ``serving``.
"""

from __future__ import annotations

import argparse
import sys

from strata_jax.bench import BENCHMARKS, run_benchmark


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata-jax",
        description="Long-context LLM serving in JAX with hierarchical KV caching (GPU HBM / CPU DRAM / storage).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt (greedy by default)")
    from strata_jax.generate_cli import add_generate_arguments

    add_generate_arguments(gen)

    demo = sub.add_parser("demo", help="ask several questions about one long document: TTFT cold vs cached per tier")
    from strata_jax.demo import add_demo_arguments

    add_demo_arguments(demo)

    info = sub.add_parser("info", help="devices, memory kinds, versions, and the defaults and kernels chosen (here, on CUDA, on ROCm)")
    from strata_jax.info import add_info_arguments

    add_info_arguments(info)

    bench = sub.add_parser("bench", help="run a benchmark; `strata-jax bench NAME --help` lists its flags")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="flags of that benchmark")
    return parser


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        from strata_jax.generate_cli import run_generate

        return run_generate(args)
    if args.command == "demo":
        from strata_jax.demo import run_demo

        return run_demo(args)
    if args.command == "info":
        from strata_jax.info import run_info

        return run_info(args)
    if args.command == "bench":
        return run_benchmark(args.name, args.bench_args)
    raise SystemExit(f"unknown command {args.command!r}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return dispatch(args)
