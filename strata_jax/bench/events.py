"""``strata-jax bench events``: what publishing KV events costs the engine.

Two engines of the same model and settings in one process, one publishing KV events (to
an ``ipc://`` endpoint, a subscriber thread draining it as a router would), one not; the
same batch of ``--batch`` requests (prompts sharing a prefix, so pages are stored, reused
and evicted) alternately on each, ``--repeats`` times.  Reported: decode throughput
(tokens/s over the batch's wall time) of each, their ratio, and the events published.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

DESCRIPTION = "decode throughput with KV events published vs off, two engines side by side in one run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="model (tiny, a HF folder or a GGUF; default tiny)")
    parser.add_argument("--batch", type=int, default=16, help="requests at once (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="alternations (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import zmq

    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    tmp = tempfile.mkdtemp(prefix="strata-events-bench-")
    endpoint = f"ipc://{tmp}/events"
    common = dict(
        model=args.model,
        show_progress=False,
        max_batch_size=args.batch,
        tiers="L1+L2",
        device_tokens=max(4096, 2 * args.batch * (args.prompt_tokens + args.tokens)),
    )
    engines = {"off": Engine(EngineConfig(**common)), "on": Engine(EngineConfig(**common, kv_events_endpoint=endpoint))}
    received = [0]
    stop = threading.Event()

    def drain() -> None:
        sock: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        while not stop.is_set():
            if sock.poll(50):
                sock.recv_multipart()
                received[0] += 1
        sock.close(linger=0)

    # The engine thread's own cost of events, timed directly (the throughput ratio alone
    # cannot resolve a few percent on a noisy machine): the tree observer and end_step.
    recorder = engines["on"].core.kv_event_recorder
    assert recorder is not None  # the "on" engine publishes KV events
    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    engines["on"].ctl.tree.tier_observer = timed(recorder.observe)
    recorder.end_step = timed(recorder.end_step)  # type: ignore[method-assign]  # timing wrapper, this instance
    assert engines["off"].ctl.tree.tier_observer is None and engines["off"].core.kv_event_recorder is None
    consumer = threading.Thread(target=drain, daemon=True)
    consumer.start()
    rng = np.random.default_rng(0)
    vocab = 200 if args.model == "tiny" else 1000
    shared = rng.integers(3, vocab, size=args.prompt_tokens // 2).tolist()

    def prompts(round_: int) -> list[list[int]]:
        r = np.random.default_rng(round_ + 1)  # (-1: the warm-up round)
        return [
            shared + r.integers(3, vocab, size=args.prompt_tokens - len(shared)).tolist() for _ in range(args.batch)
        ]

    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts(-1), params)  # warm
    rows = []
    on_wall = 0.0
    spent[0] = 0.0
    for i in range(args.repeats):
        row = {}
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts(i), params)
            wall = time.perf_counter() - t0
            row[name] = sum(len(o.token_ids) for o in outs) / wall
            if name == "on":
                on_wall += wall
        rows.append(row)
    stats = engines["on"].cache_stats()["kv_events"]
    stop.set()
    consumer.join()
    for engine in engines.values():
        engine.shutdown()
    off = statistics.median(r["off"] for r in rows)
    on = statistics.median(r["on"] for r in rows)
    print(
        f"{args.model}, batch {args.batch}, {args.prompt_tokens} prompt + {args.tokens} output tokens, {args.repeats} "
        "alternations"
    )
    for r in rows:
        print(f"  events off {r['off']:8.1f} tok/s   on {r['on']:8.1f} tok/s   ({r['on'] / r['off']:.3f}x)")
    print(
        f"events on / off: {on / off:.3f}x (medians {on:.1f} / {off:.1f} tok/s); "
        f"{stats['batches_total']} batches, {stats['events_total']} events published, {stats['dropped_events_total']} "
        "dropped, "
        f"{received[0]} batches received"
    )
    share = spent[0] / on_wall
    print(
        f"engine thread in the events recorder: {1e3 * spent[0]:.1f} ms of {on_wall:.2f} s ({100 * share:.3f}% of the "
        "wall time); "
        "off: no observer on the tree"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "ratio": on / off, "kv_events": stats, "recorder_share": share}, indent=2) + "\n"
        )
    return 0
