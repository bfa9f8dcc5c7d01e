"""``strata-jax bench serve``: drive the engine in-process with a workload and report
TTFT percentiles, throughput, recomputed tokens, per-tier hits, deferrals and
compilations after warm-up, for each (policy, tiers, rate) combination, side by side."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from strata_jax.api import SamplingParams, StreamChunk
from strata_jax.bench import workloads
from strata_jax.bench.workloads import BenchRequest
from strata_jax.cache.config import TIERS, Tiers
from strata_jax.choices import choose
from strata_jax.workload_data import poisson

DESCRIPTION = "serving benchmark: the engine under a workload, per policy / tiers / arrival rate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=("loogle", "multiturn", "trace", "sharegpt"),
        default="loogle",
        help="request stream (default loogle)",
    )
    parser.add_argument("--model", default="tiny", help="'tiny' or a local HF folder (default tiny)")
    parser.add_argument(
        "--policy", default="strata", help="scheduler policies, comma-separated: strata,fifo (default strata)"
    )
    parser.add_argument(
        "--tiers", default="L1+L2", help="cache tiers, comma-separated among L1, L1+L2, L1+L2+L3 (default L1+L2)"
    )
    parser.add_argument("--device-tokens", type=int, default=8192, help="L1 capacity in tokens (default 8192)")
    parser.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size as a multiple of L1 (default 2)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    parser.add_argument(
        "--doc-tokens", type=int, default=2048, help="LooGLE: truncate each document to N tokens (default 2048)"
    )
    parser.add_argument(
        "--questions-per-doc", type=int, default=4, help="LooGLE: questions per document arriving together (default 4)"
    )
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default 16)")
    parser.add_argument("--num-requests", type=int, default=40, help="requests per run (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    rates = parser.add_mutually_exclusive_group()
    rates.add_argument(
        "--rate", type=float, default=float("inf"), help="Poisson arrival rate, req/s; inf = all at once (default)"
    )
    rates.add_argument("--rates", default=None, help="sweep of rates, comma-separated, e.g. 0.5,1,2")
    parser.add_argument("--clients", type=int, default=4, help="multiturn: concurrent clients (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="multiturn: turns per client (default 5)")
    parser.add_argument("--request-length", type=int, default=256, help="multiturn: new tokens per turn (default 256)")
    parser.add_argument(
        "--trace", type=Path, default=None, help="trace: Mooncake JSONL file (default: shared conversation trace)"
    )
    parser.add_argument(
        "--max-input-tokens", type=int, default=4096, help="trace: truncate inputs to this many tokens (default 4096)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="trace: multiply timestamps by this (default 1.0)"
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=512, help="engine prefill token budget per step (default 512)"
    )
    parser.add_argument("--max-batch-size", type=int, default=8, help="engine sequences per step (default 8)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=workloads.DEFAULT_DATA_DIR,
        help="folder with loogle/ and mooncake/ (default ../shared/data)",
    )
    parser.add_argument(
        "--pool-scaling", action="store_true", help="also time a decode step with a 4x larger device pool"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON to this path")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def build_requests(args: argparse.Namespace, engine) -> list[BenchRequest]:
    vocab = min(engine.vocab_size, 256) if engine.model_name == "tiny" else engine.vocab_size
    if args.workload == "loogle":
        if engine.tokenizer is None:
            raise SystemExit("the loogle workload needs a model with a tokenizer")
        return workloads.loogle(
            engine.tokenizer.encode,
            data_dir=args.data_dir,
            doc_tokens=args.doc_tokens,
            num_requests=args.num_requests,
            output_len=args.output_len,
            seed=args.seed,
            questions_per_doc=args.questions_per_doc,
        )
    if args.workload == "multiturn":
        return workloads.multiturn(
            vocab,
            clients=args.clients,
            rounds=args.rounds,
            request_length=args.request_length,
            output_len=args.output_len,
            seed=args.seed,
        )
    if args.workload == "trace":
        path = args.trace or args.data_dir / "mooncake" / "conversation_trace.jsonl"
        return workloads.mooncake_trace(
            vocab,
            path=path,
            num_requests=args.num_requests,
            max_input_tokens=args.max_input_tokens,
            output_len=args.output_len,
            time_scale=args.time_scale,
        )
    return workloads.short_prompts(vocab, num_requests=args.num_requests, output_len=args.output_len, seed=args.seed)


class _Run:
    """Submits requests at their arrival times (dependent turns when their parent ends) and records timings."""

    def __init__(self, engine, requests: list[BenchRequest]):
        self.engine = engine
        self.requests = requests
        self.children: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            if r.depends_on is not None:
                self.children.setdefault(r.depends_on, []).append(i)
        self.prompts: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {i: [] for i in range(len(requests))}
        self.submitted: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.errors: list[str] = []
        self.all_done = threading.Event()
        self.lock = threading.Lock()

    def _submit(self, i: int) -> None:
        from strata_jax.engine.sinks import CallbackSink

        r = self.requests[i]
        prompt = r.prompt_ids
        if r.depends_on is not None:
            parent = r.depends_on
            prompt = self.prompts[parent] + self.outputs[parent] + r.prompt_ids
        self.prompts[i] = prompt
        self.submitted[i] = time.perf_counter()

        def on_chunk(chunk: StreamChunk, i: int = i) -> None:
            now = time.perf_counter()
            self.first.setdefault(i, now)
            self.outputs[i].extend(chunk.token_ids)
            if chunk.finished:
                self._finish(i, now)

        def on_error(exc: BaseException, i: int = i) -> None:
            self.errors.append(f"request {i}: {exc}")
            self._finish(i, time.perf_counter())

        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        self.engine.submit(prompt, params, sink=CallbackSink(on_chunk, on_error))

    def _finish(self, i: int, now: float) -> None:
        with self.lock:
            self.done[i] = now
            finished_all = len(self.done) == len(self.requests)
        for child in self.children.get(i, ()):
            self._submit(child)
        if finished_all:
            self.all_done.set()

    def execute(self, timeout_s: float) -> float:
        start = time.perf_counter()
        roots = sorted(
            (i for i, r in enumerate(self.requests) if r.depends_on is None), key=lambda i: self.requests[i].arrival_s
        )
        for i in roots:
            delay = start + self.requests[i].arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self._submit(i)
        if not self.all_done.wait(timeout_s):
            raise SystemExit(
                f"run did not finish within {timeout_s:.0f} s ({len(self.done)}/{len(self.requests)} done)"
            )
        return max(self.done.values()) - start


def run_one(args: argparse.Namespace, policy: str, tiers: Tiers, rate: float, cache_dir: str) -> dict:
    from strata_jax.engine import Engine, EngineConfig

    config = EngineConfig(
        model=args.model,
        policy=policy,
        tiers=tiers,
        device_tokens=args.device_tokens,
        hicache_ratio=args.hicache_ratio,
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_size=args.max_batch_size,
        compilation_cache_dir=cache_dir,
        show_progress=False,
        storage_dir=tempfile.mkdtemp(prefix="strata-bench-kv-"),
        prefetch_min_tokens=0,
    )
    engine = Engine(config)
    try:
        requests = build_requests(args, engine)
        if args.workload != "trace":
            poisson(requests, rate, args.seed)
        run = _Run(engine, requests)
        makespan = run.execute(timeout_s=3600)
        stats = engine.cache_stats()
    finally:
        engine.shutdown()
    ttfts = [run.first[i] - run.submitted[i] for i in run.first]
    out_tokens = sum(len(v) for v in run.outputs.values())
    in_tokens = sum(len(p) for p in run.prompts.values())
    return {
        "policy": policy,
        "tiers": tiers,
        "rate": rate if rate != float("inf") else "inf",
        "requests": len(requests),
        "errors": run.errors,
        "makespan_s": makespan,
        "ttft_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "output_tps": out_tokens / makespan,
        "input_tps": in_tokens / makespan,
        "recomputed_tokens": stats["recomputed_tokens"],
        "hit_tokens": stats["hit_tokens"],
        "deferrals": stats["deferrals"],
        "compiles_after_warmup": stats["compiles_after_warmup"],
    }


def decode_pool_scaling(args: argparse.Namespace) -> dict:
    """Median decode-step time with a device pool of P and of 4P pages (same batch)."""
    from strata_jax.models.loader import load_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

    loaded = load_model(args.model, show_progress=False)
    pages = args.device_tokens // args.page_size
    times = []
    for num_pages in (pages, 4 * pages):
        runner = ModelRunner(
            loaded.model,
            RunnerConfig(
                page_size=args.page_size,
                num_device_pages=num_pages,
                max_batch_tokens=args.max_batch_tokens,
                max_batch_size=args.max_batch_size,
                max_context_tokens=4096,
            ),
        )
        context = 1024
        seqs = [SeqInput([5], context, list(range(b * 80, b * 80 + context // args.page_size + 1))) for b in range(4)]
        runner.step(seqs)
        samples = []
        for _ in range(20):
            t = time.perf_counter()
            runner.step(seqs)
            samples.append(time.perf_counter() - t)
        times.append(statistics.median(samples))
    return {"pages": [pages, 4 * pages], "decode_step_s": times, "ratio": times[1] / times[0]}


def run(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    tiers_list = [choose(t.strip(), TIERS, "--tiers") for t in args.tiers.split(",") if t.strip()]
    cache_dir = tempfile.mkdtemp(prefix="strata-bench-xla-")
    runs = []
    for rate in rates:
        for tiers in tiers_list:
            for policy in policies:
                result = run_one(args, policy, tiers, rate, cache_dir)
                runs.append(result)
                print(
                    f"{policy:>6} {tiers:<9} rate={result['rate']!s:<5} ttft mean {result['ttft_mean']:.3f}s p90 "
                    f"{result['ttft_p90']:.3f}s "
                    f"out {result['output_tps']:.1f} tok/s in {result['input_tps']:.0f} tok/s recomputed "
                    f"{result['recomputed_tokens']} "
                    f"hits {result['hit_tokens']} deferrals {result['deferrals']} compiles after warm-up "
                    f"{result['compiles_after_warmup']}",
                    flush=True,
                )
    report: dict = {"workload": args.workload, "runs": runs}
    if args.pool_scaling:
        report["decode_pool_scaling"] = decode_pool_scaling(args)
        print(f"decode step with 4x pool: {report['decode_pool_scaling']['ratio']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if not any(r["errors"] for r in runs) else 1
