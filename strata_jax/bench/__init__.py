"""Benchmarks behind ``strata-jax bench NAME``.

Each benchmark is a module exposing::

    DESCRIPTION: str                       # one line for ``--help``
    def add_arguments(parser) -> None      # its flags (every flag has help text)
    def run(args) -> int                   # exit status; writes --json PATH if given

Modules are imported only when their benchmark is run, so a missing optional
dependency of one benchmark never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

BENCHMARKS: dict[str, str] = {
    "transfer": "strata_jax.bench.transfer",
    "attention": "strata_jax.bench.attention",
    "multiturn": "strata_jax.bench.multiturn",
    "trace": "strata_jax.bench.trace",
    "match": "strata_jax.bench.match",
    "probe": "strata_jax.bench.probe",
    "serve": "strata_jax.bench.serve",
    "startup": "strata_jax.bench.startup",
    "tp": "strata_jax.bench.tp",
    "host": "strata_jax.bench.host",
    "structured": "strata_jax.bench.structured",
    "events": "strata_jax.bench.events",
    "prefill": "strata_jax.bench.prefill",
    "mixed": "strata_jax.bench.mixed",
    "prefill-hf": "strata_jax.bench.prefill_hf",
    "roofline": "strata_jax.bench.roofline",
    "twin": "strata_jax.bench.twin",
    "moe": "strata_jax.bench.moe",
    "spec": "strata_jax.bench.spec",
    "lora": "strata_jax.bench.lora",
    "lora-forms": "strata_jax.bench.lora_forms",
}


def load_benchmark(name: str) -> ModuleType:
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHMARKS))}")
    try:
        return importlib.import_module(BENCHMARKS[name])
    except ModuleNotFoundError as exc:
        if exc.name == BENCHMARKS[name]:
            raise SystemExit(f"benchmark {name!r} is not implemented in this build") from exc
        raise


def run_benchmark(name: str, argv: list[str]) -> int:
    module = load_benchmark(name)
    parser = argparse.ArgumentParser(prog=f"strata-jax bench {name}", description=module.DESCRIPTION)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)) or 0)
