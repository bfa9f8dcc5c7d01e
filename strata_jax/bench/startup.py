"""``strata-jax bench startup``: time to ready (import, load, warm-up, first token) and
programs compiled, cold (empty compilation cache) and warm, per model.

Models: random Llama models of one width at several depths (``--layers 2,8,16,32``,
written once as Hugging Face folders with safetensors, so loading is the real path)
and any ``--model`` folder.  Each start is a fresh Python process (nothing warm in
memory) running ``Engine(EngineConfig(model=...))`` with the serve defaults (batch
budget, buckets, compilation cache ``auto``) and generating one token; its
``XDG_CACHE_HOME`` is a fresh directory for the cold start and the same one again for
the warm start, so the default cache location is what is measured.  Columns: XLA
programs handed to XLA (``progs``), compiled and read from XLA's cache (``hits``), and
step programs read back whole from the executable cache (``reused``: these never
reach XLA; ``runtime/executable_cache.py``).

``--checkout DIR`` runs the starts against another checkout of the project (e.g. a
``git worktree`` of an older commit) for side-by-side comparisons; the child code
uses only ``Engine``/``EngineConfig`` and JAX's own compile events, so it works there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DESCRIPTION = "start-up benchmark: time to ready and programs compiled, cold and warm, per model depth"

# Model widths (Llama architecture); the default is SmolLM2-135M's, the real model.
WIDTHS = {
    "smollm2-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
    },
    "llama-3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
WIDTH = WIDTHS["smollm2-135m"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers",
        default="2,8,16,32",
        help="depths of the random models, comma-separated; '' for none (default 2,8,16,32)",
    )
    parser.add_argument("--model", action="append", default=[], help="also measure this HF folder (repeatable)")
    parser.add_argument("--modes", default="cold,warm", help="cold, warm or both (default cold,warm)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=None, help="engine max_batch_tokens (default: serve's default)"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="engine max_batch_size (default: serve's default)"
    )
    parser.add_argument(
        "--device-tokens",
        type=int,
        default=None,
        help="L1 capacity in tokens (default: serve's default, which on CPU is 65536 tokens: GBs at 32 layers)",
    )
    parser.add_argument(
        "--scan-layers",
        choices=("default", "true", "false"),
        default="default",
        help="EngineConfig.scan_layers (default: the engine's)",
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        default=None,
        help="run the starts against this checkout (PYTHONPATH) instead of this one",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where random models and caches go (default: a temp dir, removed)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="starts per model and mode (each cold start with a fresh cache); ratios use the medians (default 1)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one start may take (default 1800)")
    parser.add_argument(
        "--step-times",
        default=None,
        metavar="LAYERS",
        help="instead: time decode and extend steps with layers under scan vs the unrolled loop, "
        "side by side in one process, for these depths (comma-separated, e.g. 8,32)",
    )
    parser.add_argument(
        "--width",
        choices=sorted(WIDTHS),
        default="smollm2-135m",
        help="--step-times: model width (default smollm2-135m)",
    )
    parser.add_argument(
        "--step-reps", type=int, default=20, help="--step-times: timed repetitions per step kind (default 20)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON to this path")


def write_random_model(folder: Path, num_layers: int, *, seed: int = 0, width: dict = WIDTH) -> Path:
    """A random Llama HF folder (config.json + one float32 model.safetensors), no tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, i, d = width["hidden_size"], width["intermediate_size"], width["head_dim"]
    q, kv = width["num_attention_heads"] * d, width["num_key_value_heads"] * d
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **width,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(width["vocab_size"], h), "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        tensors.update(
            {
                p + "input_layernorm.weight": np.ones(h, np.float32),
                p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                p + "self_attn.q_proj.weight": normal(q, h),
                p + "self_attn.k_proj.weight": normal(kv, h),
                p + "self_attn.v_proj.weight": normal(kv, h),
                p + "self_attn.o_proj.weight": normal(h, q),
                p + "mlp.gate_proj.weight": normal(i, h),
                p + "mlp.up_proj.weight": normal(i, h),
                p + "mlp.down_proj.weight": normal(h, i),
            }
        )
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# Runs in a fresh interpreter (``python -c``) against whichever checkout is on PYTHONPATH;
# prints one JSON line.  Uses only Engine/EngineConfig and JAX's compile events.
CHILD = r"""
import json, os, sys, threading, time
spawn = float(os.environ["STRATA_BENCH_SPAWN"])
t0 = time.time()
events = {"requests": 0, "hits": 0, "compile_s": 0.0}
marks = {}
def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0
peak = {"window": None, "base": 0, "peak": 0}
def sample():
    while True:
        if peak["window"] == "load":
            peak["peak"] = max(peak["peak"], rss_anon())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
import jax
def on_duration(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        events["requests"] += 1; events["compile_s"] += seconds
def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from strata_jax.engine import Engine, EngineConfig
from strata_jax.api import SamplingParams
t_import = time.time()
class Progress:
    def phase(self, name):
        marks.setdefault(name, time.time())
        if name == "loading model":
            peak["base"] = peak["peak"] = rss_anon(); peak["window"] = "load"
        elif peak["window"] == "load":
            peak["window"] = None
    def programs(self, done, total):
        marks["programs_total"] = total
kwargs = json.loads(os.environ["STRATA_BENCH_ENGINE"])
config = EngineConfig(**kwargs)
try:
    engine = Engine(config, on_progress=Progress())
except TypeError:  # an older engine without start-up progress
    engine = Engine(config)
t_engine = time.time()
out = engine.generate([[3, 4, 5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=1))
t_first = time.time()
runner = engine.runner
programs = len(getattr(runner, "program_shapes", ())) or None
engine.shutdown()
import numpy as np
weights = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(runner.state))
result = {
    "interpreter_s": t0 - spawn, "import_s": t_import - t0,
    "load_s": (marks["allocating KV pools"] - marks["loading model"]) if "allocating KV pools" in marks else None,
    "warmup_s": (t_engine - marks["compiling"]) if "compiling" in marks else None,
    "engine_s": t_engine - t_import, "first_token_s": t_first - t_engine, "ready_s": t_first - spawn,
    "xla_programs": events["requests"], "xla_compiled": events["requests"] - events["hits"],
    "xla_cache_hits": events["hits"],
    "xla_compile_s": events["compile_s"], "step_programs": programs, "jit_programs": runner.compile_count,
    "executables_reused": getattr(engine, "executables_reused", None),
    "weights_bytes": weights,
    "load_peak_anon_bytes": (peak["peak"] - peak["base"]) if "allocating KV pools" in marks else None,
    "tokens": list(out[0].token_ids),
}
print("STRATA_BENCH_RESULT " + json.dumps(result))
"""


def engine_kwargs(args: argparse.Namespace, model: str) -> dict:
    kwargs: dict = {"model": model, "show_progress": False}
    for name in ("max_batch_tokens", "max_batch_size", "device_tokens"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.scan_layers != "default":
        kwargs["scan_layers"] = args.scan_layers == "true"
    return kwargs


def start_once(args: argparse.Namespace, model: str, xdg_cache: Path) -> dict:
    """One start in a fresh process; returns its timings."""
    env = dict(os.environ)
    checkout = args.checkout.resolve() if args.checkout else Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(checkout) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["XDG_CACHE_HOME"] = str(xdg_cache)
    env["STRATA_BENCH_ENGINE"] = json.dumps(engine_kwargs(args, model))
    env["STRATA_BENCH_SPAWN"] = repr(time.time())
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        cwd=str(xdg_cache.parent),
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("STRATA_BENCH_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"start of {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':<14}{'mode':<6}{'ready s':>9}{'import':>8}{'load':>7}{'warmup':>8}{'1st tok':>8}"
        f"{'progs':>7}{'compiled':>9}{'hits':>6}{'reused':>7}{'load peak/weights':>19}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = None if r.get("load_peak_anon_bytes") is None else r["load_peak_anon_bytes"] / r["weights_bytes"]
        print(
            f"{r['name']:<14}{r['mode']:<6}{r['ready_s']:>9.1f}{r['import_s']:>8.1f}{_fmt(r['load_s']):>7}{_fmt(r['warmup_s']):>8}"
            f"{r['first_token_s']:>8.2f}{r['xla_programs']:>7}{r['xla_compiled']:>9}{r['xla_cache_hits']:>6}"
            f"{_fmt(r.get('executables_reused'), 'd'):>7}{_fmt(ratio, '.2f'):>19}"
        )


def ratios(rows: list[dict]) -> dict:
    """The issue's ratios from one run: deep/shallow cold, warm/cold per model (medians over repeats)."""
    import statistics

    samples: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        samples.setdefault((r["name"], r["mode"]), []).append(r["ready_s"])
    by = {key: statistics.median(values) for key, values in samples.items()}
    out: dict = {}
    for (name, mode), ready in by.items():
        if mode == "warm" and (name, "cold") in by:
            out[f"{name} warm/cold"] = ready / by[(name, "cold")]
    layered = sorted({int(n[:-1]) for n, m in by if n.endswith("L") and n[:-1].isdigit() and m == "cold"})
    if len(layered) >= 2:
        lo, hi = layered[0], layered[-1]
        out[f"{hi}L/{lo}L cold"] = by[(f"{hi}L", "cold")] / by[(f"{lo}L", "cold")]
    return out


def step_times(num_layers: int, reps: int, width: dict = WIDTH) -> dict:
    """Median decode (8 sequences x 1 token over 256-token contexts) and extend (one
    256-token chunk on a 256-token prefix) step times, scan vs unrolled, interleaved;
    plus each variant's compile time of those two programs (first calls).  Weights are
    float32 on CPU, bfloat16 elsewhere."""
    import statistics

    import jax
    import jax.numpy as jnp

    from strata_jax.models.config import ModelConfig
    from strata_jax.models.weights import random_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig, SeqInput

    config = ModelConfig(
        model_type="llama",
        vocab_size=width["vocab_size"],
        hidden_size=width["hidden_size"],
        intermediate_size=width["intermediate_size"],
        num_layers=num_layers,
        num_heads=width["num_attention_heads"],
        num_kv_heads=width["num_key_value_heads"],
        head_dim=width["head_dim"],
        tie_word_embeddings=True,
    )
    on_cpu = jax.default_backend() == "cpu"
    model = random_model(config, dtype=jnp.float32 if on_cpu else jnp.bfloat16)
    pages_per_seq = 512 // 16
    runners = {}
    for scan in (True, False):
        rc = RunnerConfig(
            page_size=16,
            num_device_pages=8 * pages_per_seq + 1,
            max_batch_tokens=512,
            max_batch_size=8,
            max_context_tokens=512,
            scan_layers=scan,
            kv_dtype="float32" if on_cpu else "bfloat16",
        )
        runners["scan" if scan else "unrolled"] = ModelRunner(model, rc)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, size=256)]

    def pages(i: int) -> list[int]:
        return list(range(i * pages_per_seq, (i + 1) * pages_per_seq))

    decode = [SeqInput([int(rng.integers(0, config.vocab_size))], 256, pages(i)) for i in range(8)]
    extend = [SeqInput(prompt, 256, pages(0))]
    times: dict[str, dict[str, list[float]]] = {name: {"decode": [], "extend": []} for name in runners}
    compile_s = {}
    for name, runner in runners.items():  # compile the two programs, then fill the contexts
        start = time.perf_counter()
        runner.step(decode)
        runner.step(extend)
        compile_s[name] = time.perf_counter() - start
        for i in range(8):
            runner.step([SeqInput(prompt, 0, pages(i))])
    for _ in range(reps):
        for name, runner in runners.items():
            for kind, batch in (("decode", decode), ("extend", extend)):
                start = time.perf_counter()
                runner.step(batch)
                times[name][kind].append(time.perf_counter() - start)
    out: dict = {"layers": num_layers, "compile_s": compile_s}
    for kind in ("decode", "extend"):
        scan_s = statistics.median(times["scan"][kind])
        loop_s = statistics.median(times["unrolled"][kind])
        out[kind] = {"scan_ms": scan_s * 1e3, "unrolled_ms": loop_s * 1e3, "scan/unrolled": scan_s / loop_s}
    return out


def run_step_times(args: argparse.Namespace) -> int:
    rows = [step_times(int(n), args.step_reps, WIDTHS[args.width]) for n in args.step_times.split(",") if n.strip()]
    for row in rows:
        c = row["compile_s"]
        print(
            f"{row['layers']} layers ({args.width}): decode+extend programs compiled in {c['scan']:.1f} s with scan, "
            f"{c['unrolled']:.1f} s unrolled"
        )
    print(f"{'layers':>6} {'kind':<7}{'scan ms':>10}{'unrolled ms':>13}{'scan/unrolled':>15}")
    for row in rows:
        for kind in ("decode", "extend"):
            r = row[kind]
            print(
                f"{row['layers']:>6} {kind:<7}{r['scan_ms']:>10.2f}{r['unrolled_ms']:>13.2f}{r['scan/unrolled']:>15.3f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"step_times": rows}, indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.step_times:
        return run_step_times(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("cold", "warm") for m in modes):
        raise SystemExit(f"--modes: choose among cold, warm; got {args.modes!r}")
    try:
        depths = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--layers must be comma-separated integers, got {args.layers!r}") from None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="strata-bench-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    models = [(f"{n}L", str(write_random_model(work / f"random-{n}L", n))) for n in depths]
    models += [(Path(m).name[:13], m) for m in args.model]
    rows = []
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    for name, model in models:
        for repeat in range(args.repeats):
            xdg = Path(tempfile.mkdtemp(prefix=f"xdg-{name}-", dir=work))  # empty: the cold start compiles everything
            for mode in modes:
                result = start_once(args, model, xdg)
                rows.append({"name": name, "model": model, "mode": mode, "repeat": repeat, **result})
                print(
                    f"{name} {mode}: ready in {result['ready_s']:.1f} s, {result['xla_compiled']} programs compiled",
                    flush=True,
                )
    print()
    print_table(rows)
    summary = ratios(rows)
    for key, value in summary.items():
        print(f"{key}: {value:.2f}x")
    if args.json:
        payload = {
            "checkout": str(args.checkout or "."),
            "engine": engine_kwargs(args, "<model>"),
            "rows": rows,
            "ratios": summary,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
