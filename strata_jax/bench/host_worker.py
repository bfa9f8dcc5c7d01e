"""The measuring half of ``strata-jax bench host``: runs in a fresh interpreter against
whichever checkout is on ``PYTHONPATH`` (this file is executed by path, not imported
from that checkout), so one run can measure the commit before and this one side by side.

It uses only what both sides have: ``strata_jax.sim.runner.build_core`` (the engine
core on the simulator's executor), ``Engine``/``EngineConfig`` with ``start=False``
driven one ``step()`` at a time, ``plan_log`` (what each step ran), the executor's
``span`` (phase timers) and ``model_runner._host_copy`` (where the host waits for the
device).  Prints one JSON object on stdout.

Host time of a step = its wall time minus the time spent blocked on the device
(``_host_copy``: waiting for a step's outputs and copying them); it is everything
the engine thread does: schedule, tree and controller, packing, dispatch, output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path


def _admit(core, tracked) -> None:
    submit = getattr(core, "admit", None) or core._admit  # the commit before had no public method
    submit(tracked)


def _live(core) -> bool:
    live = getattr(core, "has_live_requests", None)
    return live() if live is not None else bool(core._tracked)  # the commit before


def _decode_rows(record) -> int:
    """Rows of a step that ran a decode batch only (0 for a step with any prefill)."""
    return 0 if record.prefill else len(record.decode)


def _summary(per_batch: dict[int, list[float]]) -> dict[int, float]:
    return {b: statistics.median(v) for b, v in per_batch.items() if v}


def run_sim(batches: list[int], prompt_tokens: int, output_tokens: int, profile: str, model: str) -> dict:
    """(a) scheduler, tree, controller and engine core on the simulator's executor."""
    from strata_jax.api import SamplingParams
    from strata_jax.sim.model_spec import load_model_spec
    from strata_jax.sim.profile import load_profile
    from strata_jax.sim.runner import SimSetup, build_core
    from strata_jax.sim.systems import SYSTEMS

    try:
        from strata_jax.engine.requests import TrackedRequest
    except ImportError:  # the commit before the engine package
        from strata_jax.engine_requests import TrackedRequest

    out: dict = {}
    for batch in batches:
        setup = SimSetup(model=load_model_spec(model), profile=load_profile(profile))
        core, executor, _ = build_core(
            SYSTEMS["strata"], setup, token_for=lambda rid, i: 1 << 40 | i, next_arrival=lambda: None
        )
        core.plan_log = []
        for i in range(batch):
            prompt = [i * prompt_tokens + j + 1 for j in range(prompt_tokens)]  # no two prompts share a page
            tracked = TrackedRequest(
                request_id=f"r{i}",
                prompt_ids=prompt,
                namespace="",
                params=SamplingParams(max_tokens=output_tokens, ignore_eos=True),
                sink=_NullSink(),
                detok=None,
                submitted_at=0.0,
            )
            _admit(core, tracked)
        host: list[float] = []
        device: list[float] = []
        while _live(core):
            decode_before = executor.stats.decode_s
            t0 = time.perf_counter()
            core.step()
            wall = time.perf_counter() - t0
            rows = _decode_rows(core.plan_log[-1]) if core.plan_log else 0
            if rows == batch:
                host.append(wall)
                device.append(executor.stats.decode_s - decode_before)
        out[batch] = {
            "steps": len(host),
            "host_ms": 1e3 * statistics.median(host) if host else None,
            "device_ms": 1e3 * statistics.median(device) if device else None,
        }
    return out


class _NullSink:
    final_only = True

    def push(self, chunk) -> None:
        pass

    def fail(self, exc) -> None:
        raise RuntimeError(f"a benchmark request failed: {exc}") from exc


@contextmanager
def _timed_phases(core, totals: dict[str, float]):
    """Accumulate the wall time of every span the engine core opens, by name (outermost only)."""
    executor = core.executor
    original = executor.span
    depth = [0]

    @contextmanager
    def span(name):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            with original(name):
                yield
        finally:
            depth[0] -= 1
            totals[name] += time.perf_counter() - t0

    executor.span = span
    try:
        yield
    finally:
        executor.span = original


def run_real(
    batches: list[int],
    layers: int,
    width: int,
    prompt_tokens: int,
    output_tokens: int,
    pipeline: str | None,
    mixed: bool = False,
    model: str | None = None,
) -> dict:
    """(b) the real engine (JaxExecutor) on a small random model (or ``model``), one step at a time.

    Per decode step of the full batch: host time (wall minus time blocked on the device)
    and, where the engine counts them (this tree), the dispatches that found the device
    with nothing queued and the idle time before them: the gap between decode programs.
    """
    import numpy as np

    import strata_jax.runtime.model_runner as model_runner
    from strata_jax.api import SamplingParams
    from strata_jax.bench.startup import write_random_model
    from strata_jax.engine import Engine, EngineConfig

    waits = [0.0]
    original_copy = model_runner._host_copy

    def timed_copy(x):
        t0 = time.perf_counter()
        try:
            return original_copy(x)
        finally:
            waits[0] += time.perf_counter() - t0

    model_runner._host_copy = timed_copy
    heads = max(1, width // 64)
    shape = {
        "vocab_size": 512,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": width // heads,
    }
    out: dict = {}
    samples: list[tuple[int, int, int, float]] = []  # (decode rows, prefill rows, prefill tokens, host s) of every step
    with tempfile.TemporaryDirectory() as tmp:
        folder = model or str(write_random_model(Path(tmp) / "m", layers, width=shape))
        top = max(batches)
        kwargs = dict(
            model=folder,
            warmup=True,
            show_progress=False,
            max_batch_size=top,
            max_batch_tokens=4 * top * 8,
            device_tokens=top * (prompt_tokens + output_tokens + 32) * 2,
            max_context_tokens=prompt_tokens + output_tokens + 16,
            page_size=16,
            compilation_cache_dir=None,
        )
        if pipeline is not None:
            kwargs["pipeline"] = pipeline == "on"
        import inspect

        extra = {"output_thread": True} if "output_thread" in inspect.signature(Engine).parameters else {}
        engine = Engine(EngineConfig(**kwargs), start=False, **extra)  # outputs delivered as when serving
        core = getattr(engine, "core", engine)
        vocab = engine.vocab_size
        rng = np.random.default_rng(0)
        for batch in batches:
            core.plan_log = []
            params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
            for _ in range(batch):
                n = prompt_tokens if not mixed else int(rng.integers(prompt_tokens // 4, prompt_tokens + 1))
                engine.submit(rng.integers(3, min(vocab, 20000), size=n).tolist(), params)
            if hasattr(engine, "core"):  # this tree: a public step drains the inbox itself
                step, drain = engine.step, lambda: None
            else:  # the commit before: the engine was its core
                step, drain = core.step, engine._drain_inbox
            drain()
            phases_per_step: list[dict[str, float]] = []
            host: list[float] = []
            wait: list[float] = []
            executor = getattr(engine, "executor", None)
            device = getattr(executor, "device", None)
            idle: list[tuple[int, float]] = []  # per counted step: (idle dispatches, idle seconds) it added
            pending = getattr(core, "has_pending_step", lambda: False)
            first = True
            while first or _live(core) or pending():  # the first step admits what the inbox holds
                first = False
                totals: dict[str, float] = defaultdict(float)
                waits[0] = 0.0
                before = (device.idle_dispatches, device.idle_s) if device is not None else None
                with _timed_phases(core, totals):
                    t0 = time.perf_counter()
                    step()
                    wall = time.perf_counter() - t0
                drain()
                record = core.plan_log[-1] if core.plan_log else None
                rows = _decode_rows(record) if record is not None else 0
                if record is not None and (record.prefill or record.decode):
                    samples.append(
                        (
                            len(record.decode),
                            len(record.prefill),
                            sum(e - s for _, s, e in record.prefill),
                            wall - waits[0],
                        )
                    )
                if rows == batch:
                    host.append(wall - waits[0])
                    wait.append(waits[0])
                    phases_per_step.append(dict(totals))
                    if before is not None:
                        idle.append((device.idle_dispatches - before[0], device.idle_s - before[1]))
            names = sorted({k for p in phases_per_step for k in p})
            out[batch] = {
                "steps": len(host),
                "host_ms": 1e3 * statistics.median(host) if host else None,
                "device_wait_ms": 1e3 * statistics.median(wait) if wait else None,
                "phases_ms": {n: 1e3 * statistics.median([p.get(n, 0.0) for p in phases_per_step]) for n in names},
                "host_us_per_request": 1e6 * statistics.median(host) / batch if host else None,
            }
            if device is not None:  # the decode steps of the full batch only (not the prefills before)
                out[batch]["device_dispatches"] = len(idle)
                out[batch]["device_idle_dispatches"] = sum(n for n, _ in idle)
                out[batch]["device_idle_ms_per_step"] = 1e3 * sum(s for _, s in idle) / max(1, len(idle))
        engine.shutdown()
    out["samples"] = samples
    return out


def run_decode(
    model: str, batch: int, prompt_tokens: int, output_tokens: int, pipeline: str | None, repeats: int
) -> dict:
    """Decode throughput of a real model at ``batch`` concurrent requests (the threaded engine, as served)."""
    import numpy as np

    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    kwargs = dict(
        model=model,
        show_progress=False,
        max_batch_size=batch,
        max_batch_tokens=max(512, 2 * batch),
        device_tokens=max(8192, batch * (prompt_tokens + output_tokens) * 2),
        max_context_tokens=prompt_tokens + output_tokens + 16,
        tiers="L1",
    )
    if pipeline is not None:
        kwargs["pipeline"] = pipeline == "on"
    engine = Engine(EngineConfig(**kwargs))
    vocab = engine.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        prompts = [rng.integers(100, min(vocab, 20000), size=prompt_tokens).tolist() for _ in range(batch)]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        last_first = max(o.ttft_s for o in outs)  # from here on every request decodes
        decode_s = max(o.latency_s for o in outs) - last_first
        rates.append({"tok_per_s": batch * (output_tokens - 1) / decode_s, "wall_s": wall, "decode_s": decode_s})
    stats = engine.cache_stats()
    engine.shutdown()
    out = {"runs": rates, "tok_per_s": statistics.median(r["tok_per_s"] for r in rates)}
    if "device_dispatches" in stats:
        out["device_dispatches"] = stats["device_dispatches"]
        out["device_idle_dispatches"] = stats["device_idle_dispatches"]
        out["device_idle_s"] = stats["device_idle_s"]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("sim", "real", "decode"), required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--output-tokens", type=int, required=True)
    p.add_argument("--profile", default="h200")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--pipeline", choices=("on", "off"), default=None)
    p.add_argument("--mixed", action="store_true", help="prompt lengths drawn from [prompt_tokens/4, prompt_tokens]")
    p.add_argument("--real-model", default=None, help="real part: this model instead of a random one")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.part == "decode":
        result = run_decode(
            args.model, int(args.batches), args.prompt_tokens, args.output_tokens, args.pipeline, args.repeats
        )
    elif args.part == "sim":
        result = run_sim(batches, args.prompt_tokens, args.output_tokens, args.profile, args.model)
    else:
        result = run_real(
            batches,
            args.layers,
            args.width,
            args.prompt_tokens,
            args.output_tokens,
            args.pipeline,
            args.mixed,
            args.real_model,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
