"""The command line, in one place: ``strata-jax generate``, ``demo``, ``info``, ``convert``,
``simulate`` and ``bench NAME`` (one module per command: ``generate.py``, ``demo.py``,
``info.py``, ``simulate.py``; benchmarks in ``strata_jax.bench``).

The console script is ``serving.cli`` (which adds ``serve``), so that ``strata_jax``
never imports ``serving``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from strata_jax.bench import BENCHMARKS, run_benchmark


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata-jax",
        description="Long-context LLM serving in JAX with hierarchical KV caching (GPU HBM / CPU DRAM / storage).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt (greedy by default)")
    from strata_jax.cli.generate import add_generate_arguments

    add_generate_arguments(gen)

    demo = sub.add_parser("demo", help="ask several questions about one long document: TTFT cold vs cached per tier")
    from strata_jax.cli.demo import add_demo_arguments

    add_demo_arguments(demo)

    info = sub.add_parser(
        "info", help="devices, memory kinds, versions, and the defaults and kernels chosen (here, on CUDA, on ROCm)"
    )
    from strata_jax.cli.info import add_info_arguments

    add_info_arguments(info)

    convert = sub.add_parser(
        "convert", help="write the Hugging Face folder equivalent to a GGUF file (needs the gguf extra)"
    )
    convert.add_argument("gguf_file", help="the .gguf file (llama, mistral, qwen2 or qwen3 architecture)")
    convert.add_argument("out_dir", help="output folder (created; must be empty if it exists)")
    convert.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the dequantized weights in model.safetensors (default float32)",
    )

    simulate = sub.add_parser(
        "simulate", help="TTFT vs throughput of several systems on a simulated machine (H200, GH200, ...)"
    )
    from strata_jax.cli.simulate import add_simulate_arguments

    add_simulate_arguments(simulate)

    bench = sub.add_parser("bench", help="run a benchmark; `strata-jax bench NAME --help` lists its flags")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="flags of that benchmark")
    return parser


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        from strata_jax.cli.generate import run_generate

        return run_generate(args)
    if args.command == "demo":
        from strata_jax.cli.demo import run_demo

        return run_demo(args)
    if args.command == "info":
        from strata_jax.cli.info import run_info

        return run_info(args)
    if args.command == "convert":
        from strata_jax.models.gguf_model import convert_gguf

        out = convert_gguf(args.gguf_file, args.out_dir, dtype=args.dtype)
        print(f"wrote {out}: config.json, model.safetensors, tokenizer files, generation_config.json")
        return 0
    if args.command == "simulate":
        from strata_jax.cli.simulate import run_simulate

        return run_simulate(args)
    if args.command == "bench":
        return run_benchmark(args.name, args.bench_args)
    raise SystemExit(f"unknown command {args.command!r}")


def run_reporting_model_errors(command: Callable[[], int], prog: str = "strata-jax") -> int:
    """Run a command; a model that cannot be loaded (bad file, unsupported config) is one clear
    line on stderr and exit status 2, never a traceback."""
    from strata_jax.models.config import ModelConfigError

    try:
        return command()
    except ValueError as exc:
        # A WeightLoadError can only come from a loaded weights module: importing it here
        # would import jax (~2 s) for commands that never touch weights (simulate).
        weights = sys.modules.get("strata_jax.models.weights")
        if not isinstance(exc, ModelConfigError) and (weights is None or not isinstance(exc, weights.WeightLoadError)):
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_reporting_model_errors(lambda: dispatch(args))
