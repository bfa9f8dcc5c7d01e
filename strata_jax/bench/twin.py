"""``strata-jax bench twin``: the simulator checked against the real engine, on this machine.

One request trace (LooGLE-style: documents and their questions, Poisson arrivals at each
rate, one warm-up pass over the documents first) runs through

* the real engine, in this process and in real time, with tiers L1+L2+L3 (a file L3), and
* the simulator (the same scheduler, tree and controller over ``SimCostModel``) with a
  profile of this machine taken from the engine itself (``measure_steps``: extend and
  decode step costs through its own requests; ``engine_profile``: those mapped onto the
  profile's constants, with the L2->L1 and L3 rates the engine learned in a calibration
  pass of the trace) and the engine's own settings: page size, L1 and L2 sizes, prefill
  chunk, scheduler configuration, the model's shape and dtypes, the measured host path
  per step (``sim/host_model.json``); ``--profile`` gives another profile instead,

and prints both side by side per rate: mean and p90 TTFT, output tokens per second, hit
tokens per tier, deferrals.  A TTFT or throughput that differs by more than
``--tolerance`` (default 20%) is flagged; the exit status is 1 if any is.

Both sides start each rate from empty tiers (the engine's are flushed), then run the
warm-up pass (unmeasured, every document once), then the measured questions.  Documents
are synthetic token runs (only equality matters to the cache); with ``--data-dir`` (or
``../shared/data``) their count of questions and question lengths follow LooGLE's
documents, their lengths are ``--doc-tokens`` (scaled to what this CPU prefills in
seconds).  Where the two disagree, docs/study.md ("The simulator against the engine")
says which constant or missing effect causes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DESCRIPTION = "the simulator against the real engine on this machine: one trace, both, side by side"

TIERS = ("device", "host", "storage")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model: tiny, a HF folder or a GGUF file (default tiny)")
    parser.add_argument("--rates", default="0.2,0.5,1", help="arrival rates in requests/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=24, help="measured requests per rate (default 24)")
    parser.add_argument("--docs", type=int, default=4, help="documents in the trace (default 4)")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document (default 1024)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument(
        "--distance", default="max", choices=("min", "shuffle", "max"), help="question order (default max)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument(
        "--device-docs",
        type=float,
        default=1.5,
        help="L1 size in documents (default 1.5: the trace needs L2 and L3)",
    )
    parser.add_argument("--host-docs", type=float, default=2.5, help="L2 size in documents (default 2.5)")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="the engine's prefill chunk (default 512)")
    parser.add_argument(
        "--policy", default="strata", choices=("strata", "fifo"), help="the engine's scheduler policy (default strata)"
    )
    parser.add_argument(
        "--kv-layer-groups",
        action="store_true",
        help="window-aware tiers for a model with sliding-window layers (e.g. Gemma 3): the engine's "
        "kv_layer_groups at local ratio 1, the simulator's window-sized loads (default off)",
    )
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--data-dir", default=None, help="LooGLE data (default: ../shared/data when present)")
    parser.add_argument(
        "--profile",
        default=None,
        help="hardware profile (h200, gh200 or a JSON) for the simulator (default: this machine, from the "
        "engine's own steps in a calibration pass)",
    )
    parser.add_argument("--tolerance", type=float, default=0.2, help="flag relative differences above (default 0.2)")
    parser.add_argument("--json", default=None, help="write every number to this file")


def trace(args: argparse.Namespace, rate: float) -> list[Any]:
    """The requests of one rate: the same documents and questions at every rate."""
    from strata_jax.sim.workloads import find_data_dir, loogle, loogle_shape

    try:
        data_shape = loogle_shape(find_data_dir(args.data_dir))
    except FileNotFoundError:
        if args.data_dir is not None:
            raise
        data_shape = [(0, 4, 24)]  # no LooGLE data: 4 questions of ~24 tokens per document
    shape = [(args.doc_tokens, questions, q_tokens) for _, questions, q_tokens in data_shape]
    return loogle(
        num_requests=args.num_requests,
        rate=rate,
        seed=args.seed,
        docs=args.docs,
        distance=args.distance,
        output_len=args.output_tokens,
        warmup=True,
        shape=shape[: args.docs],
    )


def fit_vocabulary(requests: list[Any], vocab: int) -> list[Any]:
    """The trace's ids (fresh runs from 1 up) hashed into ``[1, vocab)`` when they reach it:
    both sides get the same prompts, and two different pages of ids stay different (a page
    of 16 hashed ids colliding with another is vanishingly unlikely)."""
    if max(max(r.prompt) for r in requests) < vocab:
        return requests
    return [dataclasses.replace(r, prompt=[1 + (t * 2654435761) % (vocab - 1) for t in r.prompt]) for r in requests]


# ---------------------------------------------------------------------- the real engine
def run_engine(engine: Any, requests: list[Any], timeout_s: float = 1800.0) -> dict[str, Any]:
    """``requests`` through ``engine`` in real time: the warm-up ones at once and drained,
    then the measured ones at their arrival times.  Its tiers are flushed first."""
    engine.flush_cache("all")
    _submit_all(engine, [r for r in requests if r.warmup], timed=False, timeout_s=timeout_s)
    before = engine.cache_stats()
    done = _submit_all(engine, [r for r in requests if not r.warmup], timed=True, timeout_s=timeout_s)
    after = engine.cache_stats()
    ttft = sorted(d["ttft_s"] for d in done)
    first = min(d["arrival_s"] for d in done)
    span = max(1e-9, max(d["finished_s"] for d in done) - first)
    return {
        "ttft_mean": sum(ttft) / len(ttft),
        "ttft_p90": _quantile(ttft, 0.9),
        "output_tps": sum(d["tokens"] for d in done) / span,
        "throughput_rps": len(done) / span,
        "hit_tokens": {t: after["hit_tokens"].get(t, 0) - before["hit_tokens"].get(t, 0) for t in TIERS},
        "deferrals": after["deferrals"] - before["deferrals"],
        "finished": len(done),
        "late_submits": sum(1 for d in done if d["late_s"] > 0.05),
        # each measured question in arrival order: its TTFT and what each tier gave it
        "per_request": [
            {"arrival_s": d["arrival_s"], "ttft_s": d["ttft_s"], "cached_tokens": d["cached_tokens"]}
            for d in sorted(done, key=lambda d: d["arrival_s"])
        ],
    }


def _submit_all(engine: Any, requests: list[Any], *, timed: bool, timeout_s: float) -> list[dict[str, Any]]:
    from strata_jax.api import SamplingParams
    from strata_jax.engine.sinks import CallbackSink

    lock = threading.Lock()
    all_done = threading.Event()
    done: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def finisher(arrival: float, late: float) -> CallbackSink:
        def on_chunk(chunk: Any) -> None:
            if chunk.finished:
                with lock:
                    done.append(
                        {
                            "arrival_s": arrival,
                            "late_s": late,
                            "ttft_s": chunk.ttft_s,
                            "latency_s": chunk.latency_s,
                            "tokens": chunk.completion_tokens,
                            "finished_s": time.perf_counter() - t0,
                            "cached_tokens": dict(chunk.cached_tokens),
                        }
                    )
                    if len(done) + len(errors) == len(requests):
                        all_done.set()

        def on_error(exc: BaseException) -> None:
            with lock:
                errors.append(exc)
                all_done.set()

        return CallbackSink(on_chunk, on_error)

    for r in sorted(requests, key=lambda r: r.arrival_s) if timed else requests:
        late = 0.0
        if timed:
            wait = r.arrival_s - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            late = max(0.0, -wait)
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        engine.submit(list(r.prompt), params, sink=finisher(r.arrival_s if timed else 0.0, late))
    if not all_done.wait(timeout_s):
        raise TimeoutError(f"the engine finished {len(done)} of {len(requests)} requests in {timeout_s:.0f} s")
    if errors:
        raise RuntimeError(f"a request failed in the engine: {errors[0]!r}") from errors[0]
    return done


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)] if values else 0.0


# ---------------------------------------------------------------------- the simulator
def engine_sim_setup(engine: Any, profile: Any) -> tuple[Any, Any, dict[str, Any]]:
    """The simulator set up as ``engine`` runs: (SimSetup, SystemSpec, scheduler overrides)."""
    from strata_jax.cache.pools import numpy_dtype
    from strata_jax.scheduler.config import SchedulerConfig
    from strata_jax.sim.host_model import load_host_model
    from strata_jax.sim.model_spec import ModelSpec
    from strata_jax.sim.runner import SimSetup
    from strata_jax.sim.systems import SYSTEMS

    settings = engine.settings
    cache = settings.cache
    spec = ModelSpec(
        engine.model_name,
        engine.model_config,
        tp=1,
        kv_dtype_bytes=numpy_dtype(settings.platform.kv_dtype).itemsize,
        weight_dtype_bytes=numpy_dtype(settings.platform.dtype).itemsize,
    )
    ps = cache.page_size
    setup = SimSetup(
        model=spec,
        profile=profile,
        page_size=ps,
        device_tokens=engine.ctl.device_alloc.num_pages * ps,
        host_tokens=engine.ctl.host_alloc.num_pages * ps,
        write_policy=cache.write_policy,
        max_batch_tokens=settings.scheduler.max_batch_tokens,
        host=load_host_model("measured"),
        pipeline=engine.config.pipeline,
        tier_format=cache.kv_tier_format,
        # layer groups at local ratio 1: L1 and L2 keep every layer of a page (share 1), and a
        # load moves only the windows a reuse needs
        window_loads=settings.layer_groups is not None,
        cached_share=1.0 if settings.layer_groups is not None else None,
        # but an L3 read moves whole pages: the engine's L3 objects hold every layer (docs/models.md);
        # charging the window's share of their bytes made each Gemma question's L3 read ~2x too fast
        storage_window_reads=False,
    )
    # The engine loads a step's pages before it computes (no layer-wise overlap on this path).
    system = dataclasses.replace(SYSTEMS["strata"], name="engine", tiers=cache.tiers, layerwise=False)
    overrides = {
        f.name: getattr(settings.scheduler, f.name)
        for f in dataclasses.fields(SchedulerConfig)
        if f.name not in ("max_waiting",)
    }
    return setup, system, overrides


def run_sim(requests: list[Any], setup: Any, system: Any, overrides: dict[str, Any], rate: float) -> dict[str, Any]:
    from strata_jax.sim.runner import simulate

    r = simulate(requests, system, setup, rate, scheduler_overrides=overrides)
    return {
        "ttft_mean": r.ttft_mean,
        "ttft_p90": r.extra["ttft_p90"],
        "output_tps": r.output_tps,
        "throughput_rps": r.throughput_rps,
        "hit_tokens": {t: r.extra["hit_tokens"].get(t, 0) for t in TIERS},
        "deferrals": r.extra["deferrals"],
        "finished": r.finished,
        "per_request": r.per_request,
    }


def measure_steps(engine: Any, chunk: int, first_id: int) -> dict[str, tuple[float, ...]]:
    """The engine's step costs on this machine, measured through its own requests:

    * extend: TTFT of ``chunk`` new tokens on a cached prefix of 0, ``chunk`` and 2 ``chunk``
      tokens (the prefix computed just before, so it is in L1), and of short prompts (16 and
      64 tokens cold, 16 on a ``chunk``-token prefix: a question's shape, whose time is mostly
      the intercept ``a``; with the long points alone ``a`` came out 0.05 s in one calibration
      and 0.10 s in the next, and the simulated TTFT of every question moved with it);
      least squares of ``a + b new + c pairs`` (``pairs`` = ``new (ctx + new / 2)``);
    * decode: per-token time after the first of 1 and 8 requests decoding together;
      ``a + b rows``.

    Token ids are fresh runs from ``first_id`` (never cached before).  Best of three runs each
    (two for the ``chunk``-token points).
    """
    import numpy as np

    from strata_jax.sim.workloads import SimRequest

    ids = itertools.count(first_id)
    vocab = engine.vocab_size

    def fresh(n: int) -> list[int]:
        return [1 + (next(ids) * 2654435761) % (vocab - 1) for _ in range(n)]  # as fit_vocabulary

    def ttft(prompt: list[int], output: int = 1) -> tuple[float, float]:
        (d,) = _submit_all(engine, [SimRequest(prompt, output)], timed=False, timeout_s=600)
        return d["ttft_s"], d["latency_s"]

    pool = engine.limits.kv_pages
    room = min(engine.max_context_tokens, pool * engine.page_size if pool else 1 << 30) - 2 * engine.page_size
    short = min(16, chunk)
    points = [(short, 0), (min(64, chunk), 0), (short, chunk), (chunk, 0), (chunk, chunk), (chunk, 2 * chunk)]
    points = [(new, ctx) for new, ctx in points if new + ctx <= room]
    if (chunk, chunk) not in points:  # (c, the attention term, needs a chunk on a chunk of context)
        raise SystemExit(
            f"calibration needs 2 x --max-batch-tokens ({2 * chunk}) tokens of context; L1 and the "
            f"context limit leave {room}"
        )
    rows, times = [], []
    for new, ctx in points:
        best = math.inf
        for _ in range(2 if new == chunk else 3):
            prefix = fresh(ctx)
            if ctx:
                ttft(prefix)  # now cached in L1
            best = min(best, ttft(prefix + fresh(new))[0])
        rows.append((1.0, float(new), new * (ctx + new / 2.0)))
        times.append(best)
    (a, b, c), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    if b <= 0:
        # The short points make the per-token cost identifiable, and on a model whose tokens are
        # lost in noise (the tests' tiny one on a loaded machine) it can come out negative: fit as
        # before them, from the 64-token and chunk-sized points, where it is not told apart from a.
        keep = [i for i, (new, _) in enumerate(points) if new != short or short == min(64, chunk)]
        (a, b, c), *_ = np.linalg.lstsq(np.array(rows)[keep], np.array(times)[keep], rcond=None)
    decode = []
    for batch in (1, 8):
        out = 17
        reqs = [SimRequest(fresh(64), out) for _ in range(batch)]
        done = _submit_all(engine, reqs, timed=False, timeout_s=600)
        decode.append(sorted((d["latency_s"] - d["ttft_s"]) / (out - 1) for d in done)[len(done) // 2])
    db = (decode[1] - decode[0]) / 7
    return {"extend": (float(a), float(b), float(c)), "decode": (decode[0] - db, db)}


def engine_profile(engine: Any, spec: Any, base: Any, storage_dir: str, steps: dict[str, tuple[float, ...]]) -> Any:
    """A profile of this machine as the engine runs on it: its measured step costs
    (``measure_steps``) mapped onto ``SimCostModel``'s constants, the L2->L1 and L3 read
    rates the engine learned while serving the calibration pass, and its L3 write rate.

    extend ``a + b new + c pairs`` -> ``extend_overhead_s = a`` (no shared step overhead),
    matmul rate ``2 body params / b``, attention rate ``4 layers heads head_dim / c``;
    decode ``da + db rows`` -> the memory rate that reads the weights in ``da`` and
    ``decode_row_s = db`` (on this CPU a row costs more than its FLOPs at the matmul rate).
    """
    cost = engine.scheduler.cost
    a, b, c = steps["extend"]
    da, db = steps["decode"]
    if b <= 0 or da <= 0:
        raise RuntimeError(f"the measured step costs make no sense: extend {a, b, c}, decode {da, db}")
    cfg = spec.config
    matmul = 2.0 * spec.body_params / b
    # The profile holds attention at most at the matmul rate; c <= 0 (no measurable cost per
    # attended pair: a model whose attention is lost in noise) is charged that rate too.
    attention = min(matmul, 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim / c) if c > 0 else matmul
    read_bps, write_bps = storage_rates(engine, storage_dir)
    return dataclasses.replace(
        base,
        name="this machine, from the engine's own steps",
        matmul_flops_per_s=matmul,
        matmul_efficiency=1.0,
        attention_efficiency=attention / matmul,
        # the weights a one-row step reads (a mixture-of-experts model's active ones; the experts
        # more rows pick are in the per-row cost db): all of a dense model's
        hbm_bytes_per_s=spec.step_weight_bytes(1) / da,
        hbm_efficiency=1.0,
        step_overhead_s=0.0,
        extend_overhead_s=max(0.0, a),
        decode_row_s=max(0.0, db),
        link_peak_bytes_per_s=cost.link_bytes_per_s,
        coalesced_efficiency=1.0,
        naive_copy_overhead_s=0.0,
        transfer_overhead_s=cost.transfer_overhead_s,
        storage_read_bytes_per_s=cost.storage_bytes_per_s,
        storage_write_bytes_per_s=write_bps,
        notes=(
            f"bench twin: extend {a:.4g} s + {b:.4g} s/token + {c:.4g} s/pair, decode {da:.4g} s + {db:.4g} s/row "
            f"(measured through the engine's requests); L2->L1 {cost.link_bytes_per_s / 1e9:.2f} GB/s and L3 read "
            f"{cost.storage_bytes_per_s / 1e9:.2f} GB/s as the engine learned them in the calibration pass (file "
            f"backend alone: read {read_bps / 1e9:.2f}, write {write_bps / 1e9:.2f} GB/s). Kept from "
            f"'{base.name}': the rest."
        ),
    )


def storage_rates(engine: Any, storage_dir: str, pages: int = 64) -> tuple[float, float]:
    """Bytes/s of the engine's L3 backend (its codec included) writing then reading
    ``pages`` pages of the engine's page size, 16 per batch as the controller moves them."""
    import hashlib

    import numpy as np

    from strata_jax.cache.storage_file import FileStorage

    page_bytes = engine.ctl.page_bytes
    backend = FileStorage(str(Path(storage_dir) / "calibrate"))
    payloads = [np.random.default_rng(i).bytes(page_bytes) for i in range(pages)]
    keys = [hashlib.sha256(f"twin-calibrate-{i}".encode()).digest() for i in range(pages)]
    batches = [slice(i, i + 16) for i in range(0, pages, 16)]
    t = time.perf_counter()
    for b in batches:
        backend.batch_set(keys[b], payloads[b])
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    for b in batches:
        got = backend.batch_get(keys[b])
        if any(g is None for g in got):
            raise RuntimeError("the L3 calibration read back fewer pages than it wrote")
    read_s = time.perf_counter() - t
    backend.clear()
    return pages * page_bytes / read_s, pages * page_bytes / write_s


# ---------------------------------------------------------------------- side by side
def differs(engine_value: float, sim_value: float, tolerance: float) -> bool:
    if engine_value == sim_value:
        return False
    return abs(sim_value - engine_value) > tolerance * max(abs(engine_value), 1e-12)


def print_table(rows: list[dict[str, Any]], tolerance: float) -> int:
    flagged = 0
    print(
        f"{'rate':>5}  {'side':<6} {'TTFT mean':>10} {'TTFT p90':>9} {'out tok/s':>10} "
        f"{'hit L1':>7} {'hit L2':>7} {'hit L3':>7} {'defer':>6}"
    )
    for row in rows:
        e, s = row["engine"], row["sim"]
        for side, m in (("engine", e), ("sim", s)):
            h = m["hit_tokens"]
            print(
                f"{row['rate']:>5g}  {side:<6} {m['ttft_mean']:>9.3f}s {m['ttft_p90']:>8.3f}s {m['output_tps']:>10.1f} "
                f"{h['device']:>7} {h['host']:>7} {h['storage']:>7} {m['deferrals']:>6}"
            )
        bad = [k for k in ("ttft_mean", "ttft_p90", "output_tps") if differs(e[k], s[k], tolerance)]
        ratio = ", ".join(f"{k} sim/engine {s[k] / e[k]:.2f}" for k in ("ttft_mean", "output_tps") if e[k])
        print(f"{'':>5}  {'':<6} {ratio}" + (f"  DIFFERS: {', '.join(bad)}" if bad else ""))
        flagged += bool(bad)
    return flagged


def run(args: argparse.Namespace) -> int:
    from strata_jax.engine import Engine, EngineConfig
    from strata_jax.sim.profile import load_profile

    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise SystemExit(f"--rates must be positive numbers, got {args.rates!r}")
    for name in ("num_requests", "docs", "doc_tokens", "output_tokens", "page_size", "max_batch_tokens"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    with tempfile.TemporaryDirectory(prefix="strata-twin-") as storage_dir:
        doc_pages = -(-args.doc_tokens // args.page_size)
        device_tokens = max(2 * args.max_batch_tokens, int(args.device_docs * doc_pages) * args.page_size)
        config = EngineConfig(
            model=args.model,
            tiers="L1+L2+L3",
            storage_dir=storage_dir,
            page_size=args.page_size,
            device_tokens=device_tokens,
            hicache_ratio=max(0.01, args.host_docs * doc_pages * args.page_size / device_tokens),
            max_batch_tokens=args.max_batch_tokens,
            policy=args.policy,
            max_context_tokens=args.doc_tokens + 256 + args.output_tokens,
            kv_layer_groups=args.kv_layer_groups,
            show_progress=False,
        )
        print(f"starting the engine ({args.model}) ...", flush=True)
        engine = Engine(config)
        try:
            base = load_profile(args.profile or "h200")
            setup, system, overrides = engine_sim_setup(engine, base)
            windows = {  # what --kv-layer-groups turned on, on each side
                "engine_moves_windows": engine.ctl.windows.moves,
                "sim_window_loads": setup.window_loads,
                "sim_storage_window_reads": setup.storage_window_reads,
                "sim_cached_share": setup.cached_share,
            }
            if args.profile:
                profile = base
            else:
                print("calibration: step costs, then a pass of the first rate's trace (not reported) ...", flush=True)
                steps = measure_steps(engine, args.max_batch_tokens, first_id=1 << 20)
                run_engine(engine, fit_vocabulary(trace(args, rates[0]), engine.vocab_size))
                profile = engine_profile(engine, setup.model, base, storage_dir, steps)
            setup = dataclasses.replace(setup, profile=profile)
            print(
                f"{engine.model_name}: L1 {setup.device_tokens} tokens, L2 {setup.host_tokens} tokens, L3 file; "
                f"page {setup.page_size}, chunk {setup.max_batch_tokens}; profile: {profile.name}",
                flush=True,
            )
            rows = []
            for rate in rates:
                requests = fit_vocabulary(trace(args, rate), engine.vocab_size)
                print(f"rate {rate:g}: engine ...", flush=True)
                e = run_engine(engine, requests)
                print(f"rate {rate:g}: simulator ...", flush=True)
                s = run_sim(requests, setup, system, overrides, rate)
                rows.append({"rate": rate, "engine": e, "sim": s})
        finally:
            engine.shutdown()
    print()
    flagged = print_table(rows, args.tolerance)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "profile": dataclasses.asdict(profile),
                    "args": vars(args),
                    "windows": windows,
                    "rows": rows,
                    "flagged": flagged,
                },
                indent=1,
                default=str,
            )
        )
    return 1 if flagged else 0
