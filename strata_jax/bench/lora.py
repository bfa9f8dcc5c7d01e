"""``strata-jax bench lora``: what serving LoRA adapters costs, side by side in one run.

Two ``ModelRunner``s over the same weights (``--model``): one without LoRA (its step
programs carry none of it) and one with ``--slots`` adapter slots of rank ``--rank``, each
slot holding a random adapter on all seven target modules (built in memory).  Measured,
alternating the runners ``--repeats`` times (medians; this machine is noisy):

* **decode**: a step of ``--batch`` sequences at ``--decode-context`` tokens of context
  (random tokens, pages of their own): on the plain runner; on the LoRA runner with the
  rows spread over the slots (row ``i`` -> slot ``i % slots``: the mixed case, every slot's
  columns); and on the LoRA runner with every row on the base model (what compiling LoRA
  in costs rows that use none);
* **prefill**: a ``--prefill-tokens`` prompt in chunks of ``--chunk`` tokens (the engine's
  default step), with and without an adapter (one adapter per step: its own columns only).

Ratios are LoRA over plain (issue targets: decode <= 1.3x, prefill <= 1.2x).  The work the
LoRA runner adds is two matmuls of width ``slots * rank`` per targeted projection
(``models/lora.py``), so the ratios move with ``--slots`` and ``--rank``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = "LoRA's cost: decode step of a batch spread over adapters, and a long prefill, vs the base model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help='a HF folder or GGUF file (default "tiny")')
    parser.add_argument("--slots", type=int, default=4, help="adapter slots, each holding one adapter (default 4)")
    parser.add_argument("--rank", type=int, default=16, help="the slots' rank (default 16)")
    parser.add_argument("--batch", type=int, default=16, help="decode batch (default 16)")
    parser.add_argument("--decode-context", type=int, default=512, help="context of each decode row (default 512)")
    parser.add_argument("--prefill-tokens", type=int, default=2000, help="prompt of the prefill (default 2000)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step (default 512)")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per measurement (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the runners (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def random_adapter(config: Any, name: str, rank: int, seed: int) -> Any:
    """A LoRA adapter on all seven modules of every layer, random A and B (std 0.02)."""
    from strata_jax.lora.peft_adapter import MODULES, LoraAdapter, module_shape

    rng = np.random.default_rng(seed)
    weights = {}
    for m in MODULES:
        d_in, d_out = module_shape(config, m)
        a = rng.normal(0, 0.02, (config.num_layers, rank, d_in)).astype(np.float32)
        b = rng.normal(0, 0.02, (config.num_layers, d_out, rank)).astype(np.float32)
        weights[m] = (a, b)
    return LoraAdapter(name, "<memory>", f"bench-{seed}", rank, 1.0, weights)


def _runner(model_path: str, args: argparse.Namespace, slots: int) -> Any:
    from strata_jax.models.loader import load_model
    from strata_jax.runtime.model_runner import ModelRunner, RunnerConfig

    loaded = load_model(model_path)
    context = max(args.decode_context + 1, args.prefill_tokens)
    pages_per_seq = -(-context // 16)
    config = RunnerConfig(
        page_size=16,
        num_device_pages=max(pages_per_seq * args.batch, pages_per_seq) + 8,
        max_batch_tokens=max(args.chunk, args.batch),
        max_batch_size=args.batch,
        max_context_tokens=-(-context // 16) * 16,
        max_loras=slots,
        max_lora_rank=args.rank,
    )
    runner = ModelRunner(loaded.model, config)
    for slot in range(slots):
        assert runner.lora is not None
        runner.lora.install(slot, random_adapter(loaded.config, f"a{slot}", args.rank, seed=slot))
    return runner, loaded.config


def _decode_seqs(config: Any, args: argparse.Namespace, slot_of_row: Callable[[int], int]) -> list[Any]:
    from strata_jax.runtime.model_runner import SeqInput

    pages = -(-(args.decode_context + 1) // 16)
    rng = np.random.default_rng(0)
    high = max(4, min(config.vocab_size, 32000) - 1)
    return [
        SeqInput(
            [int(rng.integers(3, high))],
            args.decode_context,
            list(range(i * pages, (i + 1) * pages)),
            adapter_slot=slot_of_row(i),
        )
        for i in range(args.batch)
    ]


def _decode_s(runner: Any, seqs: list[Any], steps: int) -> float:
    runner.step(seqs)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step(seqs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prefill_s(runner: Any, config: Any, args: argparse.Namespace, slot: int) -> float:
    from strata_jax.runtime.model_runner import SeqInput

    rng = np.random.default_rng(1)
    high = max(4, min(config.vocab_size, 32000) - 1)
    ids = [int(t) for t in rng.integers(3, high, size=args.prefill_tokens)]
    pages = list(range(-(-args.prefill_tokens // 16)))
    start = time.perf_counter()
    for begin in range(0, len(ids), args.chunk):
        chunk = ids[begin : begin + args.chunk]
        runner.step([SeqInput(chunk, begin, pages[: -(-(begin + len(chunk)) // 16)], adapter_slot=slot)])
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    if args.slots < 1 or args.rank < 1 or args.batch < 1:
        raise SystemExit("--slots, --rank and --batch must be positive")
    plain, config = _runner(args.model, args, 0)
    lora, _ = _runner(args.model, args, args.slots)
    seqs_plain = _decode_seqs(config, args, lambda i: -1)
    seqs_mixed = _decode_seqs(config, args, lambda i: i % args.slots)
    seqs_base = _decode_seqs(config, args, lambda i: -1)
    _prefill_s(plain, config, args, -1)  # compiles every chunk's program before anything is timed
    _prefill_s(lora, config, args, 0)
    rows: dict[str, list[float]] = {k: [] for k in ("decode_plain", "decode_mixed", "decode_base_rows")}
    rows |= {"prefill_plain": [], "prefill_adapter": []}
    for _ in range(args.repeats):
        rows["decode_plain"].append(_decode_s(plain, seqs_plain, args.steps))
        rows["decode_mixed"].append(_decode_s(lora, seqs_mixed, args.steps))
        rows["decode_base_rows"].append(_decode_s(lora, seqs_base, args.steps))
        rows["prefill_plain"].append(_prefill_s(plain, config, args, -1))
        rows["prefill_adapter"].append(_prefill_s(lora, config, args, 0))
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "model": args.model,
        "slots": args.slots,
        "rank": args.rank,
        "batch": args.batch,
        "decode_context": args.decode_context,
        "prefill_tokens": args.prefill_tokens,
        "chunk": args.chunk,
        "seconds": med,
        "runs": rows,
        "decode_ratio": med["decode_mixed"] / med["decode_plain"],
        "decode_base_rows_ratio": med["decode_base_rows"] / med["decode_plain"],
        "prefill_ratio": med["prefill_adapter"] / med["prefill_plain"],
    }
    print(f"model {args.model}: {args.slots} slots of rank {args.rank}, medians of {args.repeats} alternations")
    print(
        f"decode b{args.batch} @ {args.decode_context}: plain {med['decode_plain'] * 1e3:.1f} ms, "
        f"{args.slots} adapters {med['decode_mixed'] * 1e3:.1f} ms ({result['decode_ratio']:.2f}x), "
        f"LoRA runner, base rows {med['decode_base_rows'] * 1e3:.1f} ms ({result['decode_base_rows_ratio']:.2f}x)"
    )
    print(
        f"prefill {args.prefill_tokens} tokens (chunks of {args.chunk}): plain {med['prefill_plain']:.2f} s, "
        f"adapter {med['prefill_adapter']:.2f} s ({result['prefill_ratio']:.2f}x)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
