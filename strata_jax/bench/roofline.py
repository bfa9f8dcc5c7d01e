"""``strata-jax bench roofline``: a real engine on one long document, against this device's peaks.

One process, one device, random weights of a real model's width (``--width``, default
Llama-3.1-8B: 32 layers, bfloat16 on a GPU, float32 on a CPU; built in memory with
``random_model``, as ``bench startup --step-times`` does, and handed to the engine in place
of a checkpoint, so nothing is written to disk):

* **peaks**, measured first, in this run: the device's memory bandwidth (an elementwise
  pass ``x + 1`` over a ``--hbm-mb`` array: bytes read + written over the best time of
  back-to-back calls) and its matmul rate (an ``n x n`` product in the model's dtype,
  ``2 n^3`` FLOPs, the same way);
* **TTFT** of a ``--doc-tokens`` document (``generate`` with ``max_tokens=1``, random
  token ids, a fresh document per repeat): **cold** (nothing cached), **L1** (the same
  document again: its KV on the device) and **L2** (after ``flush_cache("device")``: its KV
  loaded from host memory).  A warm-up document runs the three first, so no timed request
  compiles; the per-tier hit tokens of each request are recorded to show which tier served;
* **prefill MFU**: model FLOPs (``runtime.compute_prior``: projections, causal attention,
  one LM-head row) of the cold prefill over the cold TTFT, and of one ``--prefill-chunk``
  step on a context of as many tokens over its step time, each over the matmul peak;
* **decode**: at each batch of ``--batches`` (each sequence ``--decode-context`` tokens
  of context, pages of its own), the step time (median of synchronous steps) and the
  time per step of ``--step-reps`` steps dispatched back to back (``pipelined``, as the
  engine's loop runs them); **HBM utilisation** = bytes a step must read (the weights,
  less an untied input embedding of which it reads a row per sequence, plus every
  sequence's KV) / pipelined step time / the measured bandwidth;
* **verification** (``--verify-tokens`` N > 0): at each batch of ``--verify-batches``, a
  step of that many rows x N tokens with the logits of every position (a speculative
  verification of N - 1 proposed tokens), its time over the decode step's: speculative
  decoding pays where the accepted tokens per verification exceed that ratio less one.
* **mixed step**: at each batch whose rows fit beside the prefill chunk in its program (at
  most a quarter of the chunk, and fewer than the engine's ``max_batch_size``, the largest
  batch), one step of the chunk less a token per row plus that many
  one-token decode rows (``EngineConfig.mixed_steps``), over the same chunk alone plus the
  decode step: below 1, one program is cheaper than the two.

The engine is built with ``warmup=False`` and no compilation cache; the step programs
the run uses (the prefill chunk's and a page's extend, each batch's decode and
verification) are then
compiled side by side (``ModelRunner.warmup`` over just those shapes), and the warm-up
document compiles whatever else a request runs (KV transfers), so no timed request
compiles.  The prefill-chunk and decode measurements run on the engine's ``ModelRunner``
after the engine is shut down (same weights, same pool).  The JSON
(``--json``) is rewritten after every phase, so a run cut short keeps what it measured;
a phase that fails is recorded under ``errors`` and the next still runs (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from strata_jax.bench.startup import WIDTHS as STARTUP_WIDTHS

DESCRIPTION = "a real engine on one long document: TTFT cold/L1/L2, decode step time and HBM use per batch, prefill MFU"

WIDTHS = {
    **STARTUP_WIDTHS,
    # For --dry-run style checks on a CPU: a few seconds per program.
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
}
DEFAULT_LAYERS = {"llama-3.1-8b": 32, "smollm2-135m": 30, "tiny": 2}
TIED = {"llama-3.1-8b": False, "smollm2-135m": True, "tiny": True}  # Llama-3.1-8B has its own LM head


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--width", choices=sorted(WIDTHS), default="llama-3.1-8b", help="model width (default llama-3.1-8b)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layers (default: the width's model: 32 for llama-3.1-8b)"
    )
    parser.add_argument("--doc-tokens", type=int, default=16384, help="document length in tokens (default 16384)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=8192,
        help="engine max_batch_tokens: tokens per prefill step (default 8192)",
    )
    parser.add_argument("--batches", default="1,64,256", help="decode batch sizes, comma-separated (default 1,64,256)")
    parser.add_argument(
        "--decode-context", type=int, default=1024, help="context tokens of each decoding sequence (default 1024)"
    )
    parser.add_argument(
        "--verify-tokens",
        type=int,
        default=0,
        help="also time a speculative verification of this many tokens per row (k + 1) at each batch of "
        "--verify-batches, beside its decode (0: none; default 0)",
    )
    parser.add_argument("--verify-batches", default=None, help="batch sizes of the verifications (default: --batches)")
    parser.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (default 16)")
    parser.add_argument(
        "--ttft-repeats", type=int, default=1, help="documents timed cold/L1/L2 (median kept; default 1)"
    )
    parser.add_argument(
        "--step-reps", type=int, default=10, help="timed steps per decode batch and prefill chunk (default 10)"
    )
    parser.add_argument(
        "--hbm-mb",
        type=float,
        default=None,
        help="array size of the bandwidth pass in MiB (default: 2048 on a GPU, 64 on a CPU)",
    )
    parser.add_argument(
        "--matmul-n",
        type=int,
        default=None,
        help="size of the square matmul of the peak (default: 8192 on a GPU, 1024 on a CPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for weights and documents")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the results as JSON to this path (after every phase)"
    )


# ------------------------------------------------------------------------------ peaks
def _best_per_call(call: Callable[[], Any], calls: int, rounds: int = 3) -> float:
    """Best over ``rounds`` of (time of ``calls`` back-to-back calls, the last waited for) / calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls - 1):
            call()
        call().block_until_ready()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_peaks(dtype, hbm_mb: float, matmul_n: int) -> dict:
    """Memory bandwidth (elementwise pass) and matmul rate of the first device, measured now."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(hbm_mb * (1 << 20)) // 4,), jnp.float32)
    one = jnp.float32(1.0)
    add = jax.jit(lambda a, b: a + b)
    add(x, one).block_until_ready()
    # a partial, not a closure over ``x``: nothing may keep the buffer alive past the ``del``
    t_pass = _best_per_call(functools.partial(add, x, one), 5)
    nbytes = 2 * x.nbytes  # read + write
    del x  # free the HBM pass buffer before the matmul operands are allocated
    a = jax.random.normal(jax.random.key(0), (matmul_n, matmul_n), dtype)  # not constants: realistic power draw
    mm = jax.jit(lambda p, q: p @ q)
    mm(a, a).block_until_ready()
    t_mm = _best_per_call(lambda: mm(a, a), 5)
    return {
        "hbm_bytes_per_s": nbytes / t_pass,
        "hbm_pass_mb": hbm_mb,
        "matmul_flops_per_s": 2.0 * matmul_n**3 / t_mm,
        "matmul_n": matmul_n,
        "matmul_dtype": str(jnp.dtype(dtype)),
    }


# ------------------------------------------------------------------------------ model
def model_config(width: str, layers: int, max_positions: int):
    from strata_jax.models.config import ModelConfig

    w = WIDTHS[width]
    return ModelConfig(
        model_type="llama",
        vocab_size=w["vocab_size"],
        hidden_size=w["hidden_size"],
        intermediate_size=w["intermediate_size"],
        num_layers=layers,
        num_heads=w["num_attention_heads"],
        num_kv_heads=w["num_key_value_heads"],
        head_dim=w["head_dim"],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=max_positions,
        tie_word_embeddings=TIED[width],
        bos_token_id=1,
        eos_token_ids=(2,),
    )


@contextlib.contextmanager
def engine_on_random_weights(config, seed: int):
    """While open, ``Engine`` loads a random model of ``config`` (in the engine's dtype) in
    place of a checkpoint: ``strata_jax.engine.factory.load_model`` is swapped for this run."""
    from strata_jax.engine import factory as engine_module
    from strata_jax.models.loader import LoadedModel
    from strata_jax.models.weights import random_model
    from strata_jax.tokenizer import ByteTokenizer

    def load(spec: str, *, dtype: Any = np.float32, show_progress: bool = True) -> LoadedModel:
        return LoadedModel(f"random-{spec}", config, random_model(config, dtype=dtype, seed=seed), ByteTokenizer())

    original = engine_module.load_model
    engine_module.load_model = load
    try:
        yield
    finally:
        engine_module.load_model = original


def model_flops(config, tokens: int, context: int, rows: int = 1) -> float:
    from strata_jax.runtime.compute_prior import attention_flops, lm_head_flops, projection_flops

    return projection_flops(config, tokens) + attention_flops(config, context, tokens) + lm_head_flops(config, rows)


def _tree_bytes(tree) -> int:
    import jax

    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def precompile(runner, tokens: list[int], batches: list[int], ragged: Sequence[tuple[int, int]] = ()) -> int:
    """Compile, side by side, the runner's step programs for extends of ``tokens`` new
    tokens (one sequence), extends of ``ragged`` (tokens, rows) and decodes of ``batches``
    sequences: ``ModelRunner.warmup`` over those shapes only (its shape lists narrowed
    while it runs).  Returns the programs."""
    decode = {min(s for s in runner.decode_shapes if s[1] >= b) for b in batches}
    extend = {min(s for s in runner.extend_shapes if s[0] >= t) for t in tokens}
    extend |= {min(s for s in runner.extend_shapes if s[0] >= t and s[1] >= b) for t, b in ragged}
    saved = runner.decode_shapes, runner.extend_shapes
    runner.decode_shapes, runner.extend_shapes = tuple(sorted(decode)), tuple(sorted(extend))
    try:
        runner.warmup(show_progress=False, compile_workers=min(len(decode) + len(extend), os.cpu_count() or 1))
    finally:
        runner.decode_shapes, runner.extend_shapes = saved
    return len(decode) + len(extend)


# ------------------------------------------------------------------------------ phases
class _Report:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict = {"phases": [], "errors": {}}

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=2, default=float))

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        print(f"[roofline] {name} ...", flush=True)
        try:
            yield
            self.data["phases"].append(name)
        except Exception as exc:  # recorded; the next phase still runs
            traceback.print_exc()
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
        finally:
            self.data.setdefault("phase_s", {})[name] = time.perf_counter() - start
            self.save()


def _ttft(engine, ids: list[int]) -> tuple[float, dict]:
    from strata_jax.api import SamplingParams

    before = dict(engine.cache_stats()["hit_tokens"])
    start = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
    seconds = time.perf_counter() - start
    after = engine.cache_stats()["hit_tokens"]
    return seconds, {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}


def _doc_cycle(engine, ids: list[int]) -> dict:
    """cold, L1 (same document again), L2 (after dropping L1)."""
    out: dict[str, Any] = {}
    out["cold_s"], out["cold_hits"] = _ttft(engine, ids)
    out["l1_s"], out["l1_hits"] = _ttft(engine, ids)
    engine.flush_cache("device")
    out["l2_s"], out["l2_hits"] = _ttft(engine, ids)
    return out


def _sequences(config, batch: int, tokens: int, context: int, page_size: int, rng, *, every_position: bool):
    """``batch`` sequences of ``tokens`` random new tokens each at ``context``, on pages of
    their own; ``every_position``: the logits of every new token wanted (a verification's)."""
    from strata_jax.runtime.model_runner import SeqInput

    pages_per_seq = -(-(context + tokens) // page_size)
    high = max(4, min(config.vocab_size, 32000) - 1)
    return [
        SeqInput(
            [int(t) for t in rng.integers(3, high, size=tokens)],
            context,
            list(range(i * pages_per_seq, (i + 1) * pages_per_seq)),
            prompt_logprob_targets=[0] * tokens if every_position else None,
        )
        for i in range(batch)
    ]


def _verify_batch(runner, config, batch: int, tokens: int, context: int, page_size: int, reps: int, rng) -> float:
    """Median seconds of a step of ``batch`` rows x ``tokens`` at ``context``, the logits of
    every position computed (as a speculative verification's are)."""
    seqs = _sequences(config, batch, tokens, context, page_size, rng, every_position=True)
    runner.step(seqs)  # precompiled: the first step only writes the rows' tables
    return _median_step(runner, seqs, reps)


def _median_step(runner, seqs, reps: int) -> float:
    """Median seconds of ``reps`` synchronous steps of ``seqs``."""
    sync = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.step(seqs)
        sync.append(time.perf_counter() - start)
    return statistics.median(sync)


def _decode_batch(runner, config, batch: int, context: int, page_size: int, reps: int, rng) -> dict:
    seqs = _sequences(config, batch, 1, context, page_size, rng, every_position=False)
    start = time.perf_counter()
    runner.step(seqs)  # precompiled: the first step only writes the rows' tables
    first_s = time.perf_counter() - start
    step_s = _median_step(runner, seqs, reps)
    start = time.perf_counter()
    pending = [runner.dispatch(seqs) for _ in range(reps)]
    pending[-1].result()
    pipelined = (time.perf_counter() - start) / reps
    return {"first_step_s": first_s, "step_s": step_s, "pipelined_step_s": pipelined}


def _mixed_batch(runner, config, batch: int, chunk: int, context: int, page_size: int, reps: int, rng) -> dict:
    """Median seconds of one prompt chunk of ``chunk - batch`` tokens alone and with ``batch``
    one-token decode rows at ``context`` in the same program (a mixed step)."""
    rows = _sequences(config, batch, 1, context, page_size, rng, every_position=False)
    first_page = max(p for s in rows for p in s.page_ids) + 1
    tokens = chunk - batch
    (prompt,) = _sequences(config, 1, tokens, 0, page_size, rng, every_position=False)
    prompt = dataclasses.replace(prompt, page_ids=[first_page + p for p in prompt.page_ids])  # after the rows'
    runner.step([prompt])
    alone = _median_step(runner, [prompt], reps)
    runner.step([prompt, *rows])
    together = _median_step(runner, [prompt, *rows], reps)
    return {"mixed_chunk_tokens": tokens, "chunk_alone_s": alone, "mixed_step_s": together}


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from strata_jax.engine import Engine, EngineConfig

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) <= 0:
        raise SystemExit("--batches needs positive batch sizes")
    for name in ("doc_tokens", "prefill_chunk", "decode_context", "page_size", "ttft_repeats", "step_reps"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.prefill_chunk <= max(batches):
        raise SystemExit(
            "--prefill-chunk must exceed the largest batch (the engine's max_batch_tokens > max_batch_size)"
        )
    verify_batches = [int(b) for b in (args.verify_batches or args.batches).split(",") if b.strip()]
    if args.verify_tokens and not 2 <= args.verify_tokens <= 17:
        raise SystemExit(f"--verify-tokens must be 0 or 2-17 (k + 1, k at most 16), got {args.verify_tokens}")
    if args.verify_tokens and not set(verify_batches) <= set(batches):
        raise SystemExit(f"--verify-batches {verify_batches} must be among --batches {batches}")
    if not args.verify_tokens:
        verify_batches = []
    elif max(verify_batches) * args.verify_tokens > min(args.prefill_chunk, args.doc_tokens):
        raise SystemExit("a verification of the largest --verify-batches must fit one prefill chunk")
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    layers = args.layers or DEFAULT_LAYERS[args.width]
    ps = args.page_size
    chunk = min(args.prefill_chunk, args.doc_tokens)
    chunk = max(chunk, max(batches) + 1)
    row_tokens = args.decode_context + max(1, args.verify_tokens)  # a decoding (verifying) row's
    ctx_limit = -(-(max(args.doc_tokens + ps, 2 * chunk, row_tokens)) // ps) * ps
    config = model_config(args.width, layers, max(131072, ctx_limit))
    pages_per_seq = -(-row_tokens // ps)
    # (the decode rows, and a prompt chunk beside them for the mixed step)
    device_tokens = max(max(batches) * pages_per_seq * ps + chunk + ps, 4 * (args.doc_tokens + ps))
    host_tokens = 4 * (args.doc_tokens + ps)  # L2: the warm-up and the timed documents, with room
    report = _Report(args.json)
    r = report.data
    r["device"] = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "devices": len(jax.devices()),
    }
    r["config"] = {
        "width": args.width,
        "layers": layers,
        "doc_tokens": args.doc_tokens,
        "prefill_chunk": chunk,
        "batches": batches,
        "decode_context": args.decode_context,
        "page_size": ps,
        "ttft_repeats": args.ttft_repeats,
        "step_reps": args.step_reps,
        "device_tokens": device_tokens,
        "host_tokens": host_tokens,
        "max_context_tokens": ctx_limit,
    }
    rng = np.random.default_rng(args.seed)
    high = max(4, min(config.vocab_size, 32000) - 1)

    def document() -> list[int]:
        return [int(t) for t in rng.integers(3, high, size=args.doc_tokens)]

    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    with report.phase("peaks"):
        r["peaks"] = measure_peaks(
            dtype, args.hbm_mb or (64.0 if on_cpu else 2048.0), args.matmul_n or (1024 if on_cpu else 8192)
        )
    peaks = r.get("peaks", {})

    engine = None
    with report.phase("engine"):
        start = time.perf_counter()
        with engine_on_random_weights(config, args.seed):
            engine = Engine(
                EngineConfig(
                    model=args.width,
                    page_size=ps,
                    device_tokens=device_tokens,
                    tiers="L1+L2",
                    hicache_ratio=min(2.0, host_tokens / device_tokens),
                    max_batch_tokens=chunk,
                    max_batch_size=max(batches),
                    max_context_tokens=ctx_limit,
                    warmup=False,
                    compilation_cache_dir="none",
                    show_progress=False,
                    freeze_gc=False,
                    speculative_config=(
                        f'{{"method": "ngram", "num_speculative_tokens": {args.verify_tokens - 1}}}'
                        if args.verify_tokens
                        else None
                    ),
                )
            )
        runner = engine.runner
        weight_bytes = _tree_bytes(runner.state)
        itemsize = jnp.dtype(engine.platform.dtype).itemsize
        embed_bytes = config.vocab_size * config.hidden_size * itemsize
        r["model"] = {
            "width": args.width,
            "layers": layers,
            "parameters": config.num_parameters,
            "weight_bytes": weight_bytes,
            "dtype": str(engine.platform.dtype),
            "kv_dtype": str(engine.platform.kv_dtype),
            "kernel_backend": engine.platform.kernel_backend,
            "kv_bytes_per_token": engine.ctl.page_bytes // ps,
            "tied_embeddings": config.tie_word_embeddings,
            "build_s": time.perf_counter() - start,
        }

    if "engine" in r["phases"]:
        with report.phase("precompile"):  # the engine is idle: nothing submitted yet
            start = time.perf_counter()
            programs = precompile(runner, [chunk, ps], batches, [(b * args.verify_tokens, b) for b in verify_batches])
            r["precompile"] = {"programs": programs, "seconds": time.perf_counter() - start}

        with report.phase("ttft"):
            start = time.perf_counter()
            warm = _doc_cycle(engine, document())  # compiles every program the timed requests run
            r["ttft"] = {
                "doc_tokens": args.doc_tokens,
                "warmup_s": time.perf_counter() - start,
                "warmup": warm,
                "runs": [],
            }
            for _ in range(args.ttft_repeats):
                r["ttft"]["runs"].append(_doc_cycle(engine, document()))
            for key in ("cold_s", "l1_s", "l2_s"):
                r["ttft"][key] = statistics.median(run[key] for run in r["ttft"]["runs"])
            last = r["ttft"]["runs"][-1]
            # which tier served: the L1 request hit the device, the L2 one loaded from host
            r["ttft"]["l1_served_by_device"] = last["l1_hits"].get("device", 0) >= args.doc_tokens - ps
            r["ttft"]["l2_served_by_host"] = last["l2_hits"].get("host", 0) >= args.doc_tokens - ps
            flops = model_flops(config, args.doc_tokens, 0)
            r["prefill"] = {"tokens": args.doc_tokens, "flops": flops}
            if peaks:  # the whole cold request: host work and the steps' gaps included
                r["prefill"]["ttft_mfu"] = flops / r["ttft"]["cold_s"] / peaks["matmul_flops_per_s"]
        with contextlib.suppress(Exception):
            engine.shutdown()

        with report.phase("prefill_chunk"):
            from strata_jax.runtime.model_runner import SeqInput

            context = chunk if 2 * chunk <= ctx_limit else 0
            seq = SeqInput(
                [int(t) for t in rng.integers(3, high, size=chunk)], context, list(range(-(-(context + chunk) // ps)))
            )
            runner.step([seq])
            times = []
            for _ in range(max(3, args.step_reps // 2)):
                start = time.perf_counter()
                runner.step([seq])
                times.append(time.perf_counter() - start)
            flops = model_flops(config, chunk, context)
            step_s = statistics.median(times)
            r.setdefault("prefill", {}).update(
                {"chunk_tokens": chunk, "chunk_context": context, "chunk_s": step_s, "chunk_flops": flops}
            )
            if peaks:
                r["prefill"]["chunk_mfu"] = flops / step_s / peaks["matmul_flops_per_s"]

        r["decode"] = {"context": args.decode_context, "batches": {}}
        kv_token = r["model"]["kv_bytes_per_token"]
        weights_read = weight_bytes - (0 if config.tie_word_embeddings else embed_bytes)
        for batch in batches:
            with report.phase(f"decode_{batch}"):
                row = _decode_batch(runner, config, batch, args.decode_context, ps, args.step_reps, rng)
                kv = batch * (args.decode_context + 1) * kv_token
                read = weights_read + batch * config.hidden_size * itemsize + kv
                row.update({"weight_bytes_read": weights_read, "kv_bytes_read": kv, "bytes_per_step": read})
                row["hbm_bytes_per_s"] = read / row["pipelined_step_s"]
                if peaks:
                    row["hbm_utilisation"] = row["hbm_bytes_per_s"] / peaks["hbm_bytes_per_s"]
                if batch in verify_batches:
                    row["verify_tokens"] = args.verify_tokens
                    row["verify_step_s"] = _verify_batch(
                        runner, config, batch, args.verify_tokens, args.decode_context, ps, args.step_reps, rng
                    )
                    row["verify_over_decode"] = row["verify_step_s"] / row["step_s"]
                chunk_rows = min(s for s in runner.extend_shapes if s[0] >= chunk)[1]  # the precompiled program's
                if 4 * batch <= chunk and batch + 1 <= chunk_rows:
                    row.update(_mixed_batch(runner, config, batch, chunk, args.decode_context, ps, args.step_reps, rng))
                    row["mixed_over_separate"] = row["mixed_step_s"] / (row["chunk_alone_s"] + row["step_s"])
                r["decode"]["batches"][str(batch)] = row
    print(format_report(r))
    report.save()
    return 1 if r["errors"] else 0


def format_report(r: dict) -> str:
    lines = []
    d, m, p = r.get("device", {}), r.get("model"), r.get("peaks")
    lines.append(f"device: {d.get('device_kind')} ({d.get('platform')}), jax {d.get('jax')}")
    if m:
        lines.append(
            f"model: {m['width']} x {m['layers']} layers, {m['weight_bytes'] / 1e9:.2f} GB of {m['dtype']} weights, "
            f"KV {m['kv_bytes_per_token'] / 1024:.0f} KiB/token ({m['kv_dtype']}), kernels {m['kernel_backend']}"
        )
    if p:
        lines.append(
            f"peaks (measured): memory {p['hbm_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
            f"{p['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s "
            f"({p['matmul_n']}^2 {p['matmul_dtype']})"
        )
    t = r.get("ttft")
    if t and "cold_s" in t:
        lines.append(
            f"TTFT {t['doc_tokens']}-token document: cold {t['cold_s'] * 1e3:.1f} ms, L1 {t['l1_s'] * 1e3:.1f} ms, "
            f"L2 {t['l2_s'] * 1e3:.1f} ms (L1 from device: {t['l1_served_by_device']}, L2 from host: "
            f"{t['l2_served_by_host']})"
        )
    f = r.get("prefill", {})
    if "ttft_mfu" in f:
        lines.append(f"prefill MFU: {100 * f['ttft_mfu']:.1f}% over the cold TTFT")
    if "chunk_mfu" in f:
        lines.append(
            f"prefill MFU: {100 * f['chunk_mfu']:.1f}% in one {f['chunk_tokens']}-token step on {f['chunk_context']} "
            f"tokens of context ({f['chunk_s'] * 1e3:.1f} ms)"
        )
    dec = r.get("decode", {}).get("batches", {})
    for batch, row in dec.items():
        util = row.get("hbm_utilisation")
        lines.append(
            f"decode batch {batch:>4} (context {r['decode']['context']}): step {row['step_s'] * 1e3:.2f} ms, "
            f"pipelined {row['pipelined_step_s'] * 1e3:.2f} ms, {row['bytes_per_step'] / 1e9:.2f} GB/step, "
            f"{row['hbm_bytes_per_s'] / 1e9:.0f} GB/s"
            + ("" if util is None else f" = {100 * util:.0f}% of measured HBM")
        )
        if "verify_step_s" in row:
            lines.append(
                f"  verification of {batch} x {row['verify_tokens']} tokens: {row['verify_step_s'] * 1e3:.2f} ms = "
                f"{row['verify_over_decode']:.2f}x the decode step (speculation pays above "
                f"{max(0.0, row['verify_over_decode'] - 1):.2f} accepted tokens per verification)"
            )
        if "mixed_step_s" in row:
            lines.append(
                f"  mixed step, {row['mixed_chunk_tokens']}-token chunk + {batch} decode rows: "
                f"{row['mixed_step_s'] * 1e3:.2f} ms vs {row['chunk_alone_s'] * 1e3:.2f} + "
                f"{row['step_s'] * 1e3:.2f} ms as two programs = {row['mixed_over_separate']:.2f}x"
            )
    for name, err in r.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {err}")
    return "\n".join(lines)
