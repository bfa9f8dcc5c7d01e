"""``strata-jax simulate``: TTFT-vs-throughput curves of several systems on a simulated machine.

Runs each ``--systems`` entry at each ``--rates`` entry (requests/s; for
``mooncake`` the trace's speed-up factor) over the same workload, prints a table
and an ablation table (sustained rate at ``--ttft-target``), and optionally writes
``--json`` and ``--plot``.  ``--calibrate PATH`` instead measures this machine and
writes a profile.  See docs/study.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from strata_jax.cache.config import KV_TIER_FORMATS
from strata_jax.choices import choose
from strata_jax.sim import workloads as W
from strata_jax.sim.host_model import load_host_model
from strata_jax.sim.model_spec import BUILTIN_MODELS, load_model_spec
from strata_jax.sim.profile import available_profiles, load_profile
from strata_jax.sim.runner import RunResult, SimSetup, simulate
from strata_jax.sim.systems import SYSTEMS, get_system


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=W.WORKLOADS, default="loogle", help="request stream (default loogle)")
    p.add_argument(
        "--model",
        default="llama-3.1-8b",
        help=f"{' | '.join(BUILTIN_MODELS)} or a config.json path (default llama-3.1-8b)",
    )
    p.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel degree for a config.json model (built-ins carry theirs)"
    )
    p.add_argument(
        "--profile",
        default="h200",
        help=f"hardware profile: {' | '.join(available_profiles())} or a JSON path (default h200)",
    )
    p.add_argument(
        "--systems",
        default="hicache,strata",
        help=f"comma-separated, from: {', '.join(SYSTEMS)} (default hicache,strata)",
    )
    p.add_argument(
        "--rates",
        default="1,2,4,8",
        help="comma-separated request rates in req/s (mooncake: speed-up factors); inf = all at t=0",
    )
    p.add_argument("--num-requests", type=int, default=1000, help="requests per run (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache-distance",
        choices=W.CACHE_DISTANCES,
        default="max",
        help="loogle: order of a document's questions (default max)",
    )
    p.add_argument(
        "--warmup",
        action="store_true",
        help="loogle: first compute every document once (unmeasured, all at t=0), so the measured stream meets "
        "the cache of a long-running server instead of a cold one",
    )
    p.add_argument(
        "--docs",
        type=int,
        default=100,
        help="loogle: number of documents (default 100: more than L1 holds, less than L2)",
    )
    p.add_argument(
        "--output-len", type=int, default=None, help="output tokens per request (default: 32 loogle, 64 multiturn)"
    )
    p.add_argument(
        "--data-dir", default=None, help="where loogle/ and mooncake/ live (default ../shared/data next to the repo)"
    )
    p.add_argument(
        "--trace", default=None, help="mooncake trace JSONL (default <data-dir>/mooncake/conversation_trace.jsonl)"
    )
    p.add_argument("--page-size", type=int, default=32, help="KV page size in tokens (default 32, as in Strata)")
    p.add_argument(
        "--device-kv-tokens",
        type=int,
        default=None,
        help="L1 size in tokens (default: HBM left after weights; taken as given with --loads window)",
    )
    p.add_argument(
        "--host-kv-tokens",
        type=int,
        default=None,
        help="L2 size in tokens (default: the profile's host_kv_bytes; taken as given with --loads window)",
    )
    p.add_argument(
        "--write-policy", choices=("write_through", "write_through_selective", "write_back"), default="write_through"
    )
    p.add_argument(
        "--kv-tier-format",
        default="full",
        help="format of L2/L3 pages: full (bf16, default), fp8 or int8 (8-bit values + a float32 scale per page, "
        "layer, "
        "K/V and KV head); loads and storage reads move, and L2 holds, the smaller pages; comma-separated to compare "
        "several side by side (e.g. full,fp8)",
    )
    p.add_argument(
        "--loads",
        default="full",
        help="a model with sliding-window layers: full (default: every layer's pages in every tier and on every load) "
        "or window (a window-aware hierarchy: loads and storage reads move the full-attention layers' pages and of "
        "each "
        "windowed layer only the pages its window reaches, and L1/L2 hold, per cached sequence, only the window before "
        "its end of the windowed layers, so they fit more tokens); comma-separated to compare side by side "
        "(full,window)",
    )
    p.add_argument(
        "--host-model",
        default="measured",
        help="the engine's host time per step: 'measured' (default: the model bench host fitted on this engine, "
        "sim/host_model.json), 'none' (free) or a JSON path",
    )
    p.add_argument(
        "--serial",
        action="store_true",
        help="simulate the serial engine loop (the host path between steps, not overlapped with the device)",
    )
    p.add_argument(
        "--ttft-target", type=float, default=2.0, help="mean TTFT for the sustained-rate table, seconds (default 2)"
    )
    p.add_argument("--json", default=None, help="write the runs as JSON here")
    p.add_argument("--plot", default=None, help="write a TTFT-vs-throughput PNG here (needs the sim extra: matplotlib)")
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="PATH",
        help="measure this machine and write a profile JSON to PATH (needs jax)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _requests(args: argparse.Namespace, rate: float) -> list[W.SimRequest]:
    n = args.num_requests
    if args.workload == "loogle":
        return W.loogle(
            num_requests=n,
            rate=rate,
            seed=args.seed,
            data_dir=W.find_data_dir(args.data_dir),
            docs=args.docs,
            distance=args.cache_distance,
            output_len=args.output_len or 32,
            warmup=args.warmup,
        )
    if args.warmup:
        raise ValueError(f"--warmup applies to the loogle workload, not {args.workload}")
    if args.workload == "multiturn":
        return W.multiturn(num_requests=n, rate=rate, seed=args.seed, output_len=args.output_len or 64)
    if args.workload == "mooncake":
        trace = (
            Path(args.trace) if args.trace else W.find_data_dir(args.data_dir) / "mooncake" / "conversation_trace.jsonl"
        )
        return W.mooncake(num_requests=n, path=trace, speedup=rate, max_output=args.output_len)
    return W.sharegpt(num_requests=n, rate=rate, seed=args.seed)


def _variant_of(system_name: str, options: list[str]) -> str:
    """The option of a (possibly ``[option]``-suffixed) system name."""
    if len(options) == 1:
        return options[0]
    return system_name.rsplit("[", 1)[1].rstrip("]")


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--rates: not a list of numbers: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit("--rates must be positive numbers")
    return rates


def run_simulate(args: argparse.Namespace) -> int:
    """Bad input (an unknown system, profile or model; missing data) is one line on stderr, exit 2."""
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:  # ProfileError is a ValueError
        print(f"strata-jax simulate: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.calibrate:
        from strata_jax.sim.calibrate import calibrate

        profile = calibrate(base=load_profile(args.profile), progress=not args.no_progress)
        Path(args.calibrate).write_text(profile.to_json() + "\n")
        print(f"wrote {args.calibrate}")
        return 0
    if args.num_requests < 1:
        raise SystemExit("--num-requests must be >= 1")
    if args.plot:  # say so before simulating, not after
        try:
            import matplotlib  # noqa: F401 - imported only to check that the sim extra is installed
        except ImportError:
            raise SystemExit(
                "strata-jax simulate: --plot needs the sim extra (matplotlib): pip install 'strata-jax[sim]'"
            ) from None
    systems = [get_system(s.strip()) for s in args.systems.split(",") if s.strip()]
    rates = _parse_rates(args.rates)
    formats = [f.strip() for f in args.kv_tier_format.split(",") if f.strip()]
    if not formats or any(f not in ("full", "fp8", "int8") for f in formats):
        raise ValueError(f"--kv-tier-format takes full, fp8 and/or int8 (comma-separated), got {args.kv_tier_format!r}")
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads or any(x not in ("full", "window") for x in loads):
        raise ValueError(f"--loads takes full and/or window (comma-separated), got {args.loads!r}")
    if len(formats) > 1 and len(loads) > 1:
        raise ValueError(
            "compare either several --kv-tier-format values or several --loads values in one run, not both"
        )
    setup = SimSetup(
        model=load_model_spec(args.model, args.tp),
        profile=load_profile(args.profile),
        page_size=args.page_size,
        device_tokens=args.device_kv_tokens,
        host_tokens=args.host_kv_tokens,
        write_policy=args.write_policy,
        host=load_host_model(args.host_model),
        pipeline=not args.serial,
    )
    variants = formats if len(formats) > 1 else loads
    if len(variants) > 1:  # each system once per format (or loads), named system[format]
        systems = [dataclasses.replace(s, name=f"{s.name}[{v}]") for v in variants for s in systems]
    if "window" in loads and not setup.model.config.layer_windows:
        raise ValueError(f"--loads window needs a model with sliding-window layers; {setup.model.name} has none")
    setups = {
        s.name: dataclasses.replace(
            setup,
            tier_format=choose(_variant_of(s.name, formats), KV_TIER_FORMATS, "--kv-tier-format"),
            window_loads=_variant_of(s.name, loads) == "window",
        )
        for s in systems
    }
    wall0, cpu0 = time.perf_counter(), time.process_time()
    runs: list[RunResult] = []
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(systems) * len(rates) * args.num_requests, unit="req", desc="simulating", file=sys.stderr)
    for system in systems:
        for rate in rates:
            requests = _requests(args, math.inf if rate == math.inf else rate)
            if bar is not None:
                bar.set_postfix_str(f"{system.name} @ {rate:g}")
            runs.append(
                simulate(requests, system, setups[system.name], rate, progress=bar.update if bar is not None else None)
            )
    if bar is not None:
        bar.close()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    from strata_jax.sim.report import ablation_table, plot, table

    by_system: dict[str, list[RunResult]] = {}
    for r in runs:
        by_system.setdefault(r.system, []).append(r)
    warm = ", after a warm-up pass over the documents" if args.warmup else ""
    fmt = f", L2/L3 format {'/'.join(formats)}" if formats != ["full"] else ""
    fmt += f", loads {'/'.join(loads)}" if loads != ["full"] else ""
    print(
        f"{args.workload} on {setup.profile.name}, {setup.model.name} (tp={setup.model.tp}), {args.num_requests} "
        f"requests per run{warm}{fmt}"
    )
    print(table(runs))
    shown: set[bool] = set()
    for r in (
        runs if "window" in loads else ()
    ):  # the capacity of each kind of hierarchy (the workload's, not the rate's)
        window = setups[r.system].window_loads
        if window not in shown:
            shown.add(window)
            print(
                f"{'window' if window else 'full'} loads: a cached page holds {r.extra['cached_share']:.3f} of a full "
                f"page's bytes; L1 {r.extra['l1_tokens']:,} tokens, L2 {r.extra['l2_tokens']:,} tokens"
            )
    print()
    print(ablation_table(by_system, args.ttft_target, baseline=systems[0].name))
    print(f"\nwall {wall:.1f} s (CPU {cpu:.1f} s)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"runs": [r.row() for r in runs], "wall_s": wall, "cpu_s": cpu}, indent=2) + "\n"
        )
    if args.plot:
        plot(
            by_system,
            Path(args.plot),
            f"{args.workload}{' (after warm-up)' if args.warmup else ''}, {setup.model.name}, {setup.profile.name}",
        )
    return 0
