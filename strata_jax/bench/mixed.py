"""``strata-jax bench mixed``: streams decoding while long documents prefill, with mixed steps
off and on (``EngineConfig.mixed_steps``), side by side in one run.

The workload a burst of long prompts makes: ``--streams`` requests are decoding (short prompts,
``--stream-tokens`` each) when ``--docs`` documents of ``--doc-tokens`` tokens arrive at once.
Every step of their prefill also decodes the streams: as an extend then a decode program
(off), or as one program (on).  Reported per setting (medians over ``--repeats`` runs, the
settings alternating so a drift of the machine's speed hits both): the streams' inter-token
gap while a document is prefilling (mean and p99), the documents' TTFT (mean and last),
output tokens per second over the whole run, and whether every greedy token is the same.
Ratios only: absolute times mean something only on the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from strata_jax.api import SamplingParams, StreamChunk
from strata_jax.bench.serve import percentile
from strata_jax.engine.sinks import OutputSink

DEMO_DOCUMENT = Path(__file__).resolve().parents[1] / "demo_data" / "loogle_picardo.json"
DESCRIPTION = "decode streams while long documents prefill: mixed steps off vs on, side by side"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny', a local HF folder or a GGUF file (default tiny)")
    parser.add_argument("--streams", type=int, default=4, help="requests decoding when the documents arrive (4)")
    parser.add_argument("--stream-tokens", type=int, default=160, help="tokens each stream generates (160)")
    parser.add_argument("--docs", type=int, default=3, help="documents arriving at once (3)")
    parser.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document (3000)")
    parser.add_argument("--doc-answer-tokens", type=int, default=16, help="tokens generated per document (16)")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="prefill token budget per step (512)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting, alternating (2)")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON to this path")


class _TimedSink(OutputSink):
    """Each chunk's arrival time and token count; ``done`` once the request ends."""

    def __init__(self) -> None:
        self.times: list[tuple[float, int]] = []
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def push(self, chunk: StreamChunk) -> None:
        self.times.append((time.perf_counter(), len(chunk.token_ids)))
        self.tokens.extend(chunk.token_ids)
        if chunk.finished:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


@dataclass
class RunResult:
    mixed: bool
    itl_mean_ms: float
    itl_p99_ms: float
    doc_ttft_mean_s: float
    doc_ttft_last_s: float
    output_tok_s: float
    mixed_steps: int
    tokens: list[list[int]] = field(default_factory=list)


def _prompts(tokenizer, args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    text = json.loads(DEMO_DOCUMENT.read_text())["text"]
    body = tokenizer.encode(text, add_special_tokens=False)
    while len(body) < args.doc_tokens:
        body = body + body
    docs = [
        (tokenizer.encode(f"Document {i}: ", add_special_tokens=False) + body[i * 97 :])[: args.doc_tokens]
        for i in range(args.docs)
    ]
    streams = [
        tokenizer.encode(f"Write a long story about a lighthouse keeper, number {i}.", add_special_tokens=False)
        for i in range(args.streams)
    ]
    return streams, docs


def run_once(args: argparse.Namespace, mixed: bool) -> RunResult:
    from strata_jax.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=args.model,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_size=max(8, args.streams + args.docs),
            max_context_tokens=args.doc_tokens + args.doc_answer_tokens + 64,
            device_tokens=(args.docs + args.streams + 2) * (args.doc_tokens + 256),
            mixed_steps=mixed,
            show_progress=False,
        )
    )
    try:
        streams, docs = _prompts(engine.tokenizer, args)
        stream_params = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
        doc_params = SamplingParams(max_tokens=args.doc_answer_tokens, ignore_eos=True)
        start = time.perf_counter()
        stream_sinks = [_TimedSink() for _ in streams]
        for prompt, sink in zip(streams, stream_sinks):
            engine.submit(prompt, stream_params, sink=sink)
        while not all(len(s.tokens) >= 4 for s in stream_sinks):  # every stream is decoding
            time.sleep(0.005)
        arrived = time.perf_counter()
        doc_sinks = [_TimedSink() for _ in docs]
        for prompt, sink in zip(docs, doc_sinks):
            engine.submit(prompt, doc_params, sink=sink)
        for sink in stream_sinks + doc_sinks:
            sink.done.wait()
            if sink.error is not None:
                raise sink.error
        end = time.perf_counter()
        first = [s.times[0][0] for s in doc_sinks]
        window_end = max(first)  # the last document's prefill is over
        gaps = []
        for s in stream_sinks:
            for (t0, _), (t1, n) in zip(s.times, s.times[1:]):
                if arrived <= t0 and t1 <= window_end:
                    gaps.extend([(t1 - t0) / n] * n)
        if not gaps:
            raise SystemExit("no stream token arrived while the documents prefilled: raise --stream-tokens")
        outputs = sum(len(s.tokens) for s in stream_sinks + doc_sinks)
        return RunResult(
            mixed=mixed,
            itl_mean_ms=1e3 * statistics.fmean(gaps),
            itl_p99_ms=1e3 * percentile(gaps, 99),
            doc_ttft_mean_s=statistics.fmean(t - arrived for t in first),
            doc_ttft_last_s=window_end - arrived,
            output_tok_s=outputs / (end - start),
            mixed_steps=engine.counters["mixed_steps"],
            tokens=[s.tokens for s in stream_sinks + doc_sinks],
        )
    finally:
        engine.shutdown()


METRICS = (
    ("stream gap while prefilling, mean (ms)", "itl_mean_ms"),
    ("stream gap while prefilling, p99 (ms)", "itl_p99_ms"),
    ("document TTFT, mean (s)", "doc_ttft_mean_s"),
    ("document TTFT, last (s)", "doc_ttft_last_s"),
    ("output tokens/s, whole run", "output_tok_s"),
)


def run(args: argparse.Namespace) -> int:
    for name in ("streams", "stream_tokens", "docs", "doc_tokens", "doc_answer_tokens", "max_batch_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    results: dict[bool, list[RunResult]] = {False: [], True: []}
    for i in range(args.repeats):
        for mixed in (False, True) if i % 2 == 0 else (True, False):  # ABBA: a drift hits both
            r = run_once(args, mixed)
            results[mixed].append(r)
            print(
                f"run {i + 1} mixed={'on' if mixed else 'off'}: gap mean {r.itl_mean_ms:.0f} ms p99"
                f" {r.itl_p99_ms:.0f} ms, doc TTFT mean {r.doc_ttft_mean_s:.2f} s last {r.doc_ttft_last_s:.2f} s,"
                f" {r.output_tok_s:.1f} tok/s, {r.mixed_steps} mixed steps",
                flush=True,
            )
    reference = results[False][0].tokens
    identical = all(r.tokens == reference for rs in results.values() for r in rs)
    print(
        f"\n{args.model}: {args.streams} streams x {args.stream_tokens} tokens; {args.docs} documents x"
        f" {args.doc_tokens} tokens at once; chunk {args.max_batch_tokens}; medians of {args.repeats}"
    )
    print("| metric | mixed off | mixed on | on / off |\n|---|---:|---:|---:|")
    summary = {}
    for label, key in METRICS:
        off = statistics.median(getattr(r, key) for r in results[False])
        on = statistics.median(getattr(r, key) for r in results[True])
        summary[key] = {"off": off, "on": on, "ratio": on / off if off else None}
        print(f"| {label} | {off:.2f} | {on:.2f} | {on / off:.2f}x |")
    mixed_steps = min(r.mixed_steps for r in results[True])
    print(f"greedy tokens identical in every run: {'yes' if identical else 'NO'}")
    if mixed_steps == 0:
        print("warning: a run with mixed steps on made none (no decode row met a prefill chunk)")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "summary": summary,
                    "mixed_steps_on": mixed_steps,
                    "identical": identical,
                },
                indent=1,
            )
        )
    return 0 if identical else 1
