#!/usr/bin/env python3
"""Streaming clients while long documents arrive, through a router: what prefill/decode
disaggregation buys the streams (docs/serving.md, "Prefill/decode disaggregation").

``run``
    For ``--duration-s``: ``--streams`` clients each ask, one after another, for a long
    greedy answer (``--stream-tokens`` tokens, ``ignore_eos``) to a short prompt of their own,
    streamed; meanwhile a new document of about ``--doc-chars`` characters (a LooGLE document
    under ``--data-dir/loogle``, else a synthetic one: it says so) arrives every
    ``--doc-interval-s`` with a question (``--doc-tokens`` answer tokens).  Records every
    streamed token's arrival, so the inter-token gaps the streaming clients saw (p50, p90,
    p99), the documents' time to first token, output tokens per second over the run, errors,
    and every answer's text (greedy: the same in any layout).  ``--json`` writes it all.
    With ``--kill-pid`` (failover): ``--kill-after-s`` into the run, at the first moment the
    replica at ``--kill-url`` is prefilling a document (its ``/get_load`` counts a waiting
    request and at least ``--kill-min-tokens`` tokens), that
    process gets SIGKILL; the run then passes only if no request failed and, with ``--decode``,
    the decode replica computed at least one prompt itself (its ``strata_pd_handoffs_total``
    outcomes other than ``complete`` grew).  ``--decode`` alone records the decode replica's
    handoff outcomes and where its prompt tokens came from over the run.
``compare``
    Two or more ``run`` files side by side (the first is the baseline): the table, the
    ratios, and whether every request both runs answered got the same text.

Only the standard library and httpx (installed with the project).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def _documents(data_dir: Path, count: int, chars: int) -> tuple[list[tuple[str, str]], str]:
    """``count`` (document cut to ``chars``, its first question): LooGLE's when the data is there."""
    sys.path.insert(0, str(REPO))
    from strata_jax.workload_data import loogle_documents

    try:
        rows = loogle_documents(data_dir)
    except FileNotFoundError:
        rows = []
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for title, text, questions in rows:
        if title not in seen and questions and len(text) >= chars:
            seen.add(title)
            out.append((text[:chars], questions[0]))
        if len(out) == count:
            return out, f"LooGLE ({data_dir / 'loogle'})"
    words = "the tenant of each unit pays the agreed rent on the first day of every month".split()
    synthetic = []
    for k in range(count):
        body = " ".join(f"Clause {k}.{i}: {' '.join(words[(i + k) % 7 :])}." for i in range(chars // 60))
        synthetic.append((body[:chars], f"What does clause {k}.3 say?"))
    return synthetic, f"synthetic (fewer than {count} LooGLE documents of {chars} characters under {data_dir})"


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[list[float], str, int, float | None]:
    """One streamed chat: token arrival times (tokens counted from the logprobs), the text,
    tokens, time to first token."""
    start = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body | {"stream": True, "logprobs": True}
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            piece = choice.get("delta", {}).get("content")
            # tokens from the logprobs (a token whose bytes are not yet text streams no content)
            count = len((choice.get("logprobs") or {}).get("content") or []) or (1 if piece else 0)
            now = time.perf_counter()
            arrivals.extend([now] * count)
            if piece:
                text.append(piece)
    ttft = arrivals[0] - start if arrivals else None
    return arrivals, "".join(text), len(arrivals), ttft


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    docs, source = _documents(Path(args.data_dir), args.docs, args.doc_chars)
    print(f"documents: {len(docs)} of {args.doc_chars} characters, {source}", file=sys.stderr)
    end = time.perf_counter() + args.duration_s
    gaps: list[float] = []
    answers: dict[str, str] = {}
    doc_ttft: list[float] = []
    stream_ttft: list[float] = []  # each streamed answer's first token (behind the router's prefill leg in PD mode)
    errors: list[str] = []
    tokens = 0
    limits = httpx.Limits(max_connections=args.streams + len(docs) + 4)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:

        async def streamer(i: int) -> None:
            nonlocal tokens
            j = 0
            while time.perf_counter() < end:
                key = f"stream {i}.{j}"
                body = {
                    "model": args.model,
                    "messages": [{"role": "user", "content": f"Write a long story about traveller {i} on day {j}."}],
                    "max_tokens": args.stream_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                try:
                    arrivals, text, n, first = await _stream(client, args.router, body)
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    errors.append(f"{key}: {type(exc).__name__}: {exc}")
                    j += 1
                    continue
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
                if first is not None:
                    stream_ttft.append(first)
                answers[key] = text
                tokens += n
                j += 1

        async def document(k: int) -> None:
            nonlocal tokens
            await asyncio.sleep(args.doc_start_s + k * args.doc_interval_s)
            text, question = docs[k]
            key = f"document {k}"
            body = {
                "model": args.model,
                "messages": [{"role": "user", "content": f"{text}\n\nQuestion: {question}"}],
                "max_tokens": args.doc_tokens,
                "temperature": 0,
            }
            try:
                _, answer, n, ttft = await _stream(client, args.router, body)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(f"{key}: {type(exc).__name__}: {exc}")
                return
            answers[key] = answer
            tokens += n
            if ttft is not None:
                doc_ttft.append(ttft)

        killed: dict[str, Any] = {}

        async def killer() -> None:
            """SIGKILL ``--kill-pid`` while the replica at ``--kill-url`` is prefilling."""
            await asyncio.sleep(args.kill_after_s)
            while time.perf_counter() < end:
                try:
                    load = (await client.get(f"{args.kill_url}/get_load", timeout=5)).json()[0]
                except (httpx.HTTPError, ValueError, LookupError, TypeError):
                    load = {}
                if load.get("num_waiting_reqs", 0) > 0 and load.get("num_tokens", 0) >= args.kill_min_tokens:
                    os.kill(args.kill_pid, signal.SIGKILL)
                    killed.update(at_s=time.perf_counter() - t0, load=load)
                    print(f"  [{killed['at_s']:6.1f} s] SIGKILL -> pid {args.kill_pid} while {load}", file=sys.stderr)
                    return
                await asyncio.sleep(0.05)

        before = await _decode_counters(client, args.decode) if args.decode else _NO_COUNTERS
        t0 = time.perf_counter()
        arrivals_due = [k for k in range(len(docs)) if args.doc_start_s + k * args.doc_interval_s < args.duration_s]
        tasks = [*(streamer(i) for i in range(args.streams)), *(document(k) for k in arrivals_due)]
        if args.kill_pid is not None:
            tasks.append(killer())
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        after = await _decode_counters(client, args.decode) if args.decode else _NO_COUNTERS

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "label": args.label,
        "router": args.router,
        "documents": source,
        "elapsed_s": elapsed,
        "itl_p50_s": pct(gaps, 0.5),
        "itl_p90_s": pct(gaps, 0.9),
        "itl_p99_s": pct(gaps, 0.99),
        "itl_max_s": max(gaps) if gaps else None,
        "gaps": len(gaps),
        "stream_ttft_mean_s": statistics.fmean(stream_ttft) if stream_ttft else None,
        "stream_ttft_p90_s": pct(stream_ttft, 0.9),
        "doc_ttft_mean_s": statistics.fmean(doc_ttft) if doc_ttft else None,
        "docs_answered": len(doc_ttft),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "errors": errors,
        "killed": killed or None,
        "decode_handoffs": _grown(before["handoffs"], after["handoffs"]),
        "decode_prompt_tokens": _grown(before["prompt_tokens"], after["prompt_tokens"]),
        "answers": answers,
    }


_NO_COUNTERS: dict[str, dict[str, float]] = {"handoffs": {}, "prompt_tokens": {}}


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each counter grew over the run."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def _decode_counters(client: httpx.AsyncClient, decode: str) -> dict[str, dict[str, float]]:
    """The decode replica's ``strata_pd_handoffs_total`` by outcome (``handoffs``), and its
    prompt tokens (``prompt``) and prompt tokens cached by tier (``device``, ``host``,
    ``storage``) (``prompt_tokens``)."""
    text = (await client.get(f"{decode}/metrics", timeout=10)).text

    def labelled(metric: str, label: str) -> dict[str, float]:
        pattern = rf'^{metric}\{{{label}="(\w+)"\}} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}

    prompt = re.search(r"^strata_prompt_tokens_total (\S+)$", text, re.M)
    tokens = labelled("strata_request_cached_tokens_total", "tier")
    tokens["prompt"] = float(prompt[1]) if prompt else 0.0
    return {"handoffs": labelled("strata_pd_handoffs_total", "outcome"), "prompt_tokens": tokens}


def cmd_run(args: argparse.Namespace) -> int:
    result = asyncio.run(_run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    brief = {k: v for k, v in result.items() if k not in ("answers",)}
    print(json.dumps(brief, indent=1))
    if args.kill_pid is None:
        return 1 if result["errors"] else 0
    fell_back = sum(v for k, v in result["decode_handoffs"].items() if k not in ("complete", "local"))
    checks = [
        ("the prefill replica was killed mid-prefill", result["killed"] is not None, str(result["killed"])),
        ("every request answered", not result["errors"], f"{len(result['errors'])} errors"),
    ]
    if args.decode:
        checks.append(("the decode replica computed prompts itself", fell_back > 0, str(result["decode_handoffs"])))
    for name, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return 0 if all(ok for _, ok, _ in checks) else 1


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f} ms"


def cmd_compare(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    base = runs[0]
    rows = [
        ("streams' inter-token p50", "itl_p50_s", _ms),
        ("streams' inter-token p90", "itl_p90_s", _ms),
        ("streams' inter-token p99", "itl_p99_s", _ms),
        ("streams' mean TTFT", "stream_ttft_mean_s", _ms),
        ("streams' TTFT p90", "stream_ttft_p90_s", _ms),
        ("documents' mean TTFT", "doc_ttft_mean_s", lambda v: "-" if v is None else f"{v:.2f} s"),
        ("output tokens per s", "output_tokens_per_s", lambda v: f"{v:.1f}"),
    ]
    print("| | " + " | ".join(r["label"] for r in runs) + " | ratio (first / each) |")
    print("|---|" + "---|" * (len(runs) + 1))
    for name, key, fmt in rows:
        # no ratio of a value under a millisecond (a p50 of 0 ms where a router delivers tokens in bursts)
        ratios = [
            f"{base[key] / r[key]:.2f}x" if min(base.get(key) or 0, r.get(key) or 0) >= 1e-3 else "-" for r in runs[1:]
        ]
        print(f"| {name} | " + " | ".join(fmt(r.get(key)) for r in runs) + f" | {', '.join(ratios)} |")
    ok = True
    for r in runs[1:]:
        common = sorted(set(base["answers"]) & set(r["answers"]))
        differ = [k for k in common if base["answers"][k] != r["answers"][k]]
        print(f"{r['label']} vs {base['label']}: {len(common)} requests answered in both, {len(differ)} differ")
        ok = ok and not differ
    for r in runs:
        if r["errors"]:
            ok = False
            print(f"{r['label']}: {len(r['errors'])} errors, first: {r['errors'][0]}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the mixed workload through --router")
    run.add_argument("--router", required=True, help="the router's (or a replica's) URL")
    run.add_argument("--model", required=True, help="the served model name")
    run.add_argument("--label", default="run", help="this run's name in the comparison")
    run.add_argument("--streams", type=int, default=4, help="streaming clients (default 4)")
    run.add_argument("--stream-tokens", type=int, default=128, help="tokens of each streamed answer (default 128)")
    run.add_argument("--docs", type=int, default=12, help="documents available (default 12)")
    run.add_argument("--doc-chars", type=int, default=12000, help="characters of each document (default 12000)")
    run.add_argument("--doc-tokens", type=int, default=16, help="answer tokens of a document question (default 16)")
    run.add_argument("--doc-interval-s", type=float, default=5.0, help="a new document every (default 5 s)")
    run.add_argument("--doc-start-s", type=float, default=3.0, help="the first document after (default 3 s)")
    run.add_argument("--duration-s", type=float, default=60.0, help="streams start requests until (default 60 s)")
    run.add_argument("--timeout-s", type=float, default=600.0, help="per request (default 600 s)")
    run.add_argument("--data-dir", default="../shared/data", help="holds loogle/shortdep_qa.jsonl")
    run.add_argument("--decode", help="the decode replica's URL: its handoff outcomes over the run are reported")
    run.add_argument("--kill-pid", type=int, help="failover: SIGKILL this process while it prefills")
    run.add_argument("--kill-url", help="failover: that process's URL (its /get_load tells when it prefills)")
    run.add_argument("--kill-after-s", type=float, default=10.0, help="failover: not before (default 10 s)")
    run.add_argument(
        "--kill-min-tokens",
        type=int,
        default=1000,
        help="failover: only while it holds this many tokens (a document's prefill, not a stream's; default 1000)",
    )
    run.add_argument("--json", help="write the run here")
    run.set_defaults(func=cmd_run)
    compare = sub.add_parser("compare", help="runs side by side (the first is the baseline)")
    compare.add_argument("files", nargs="+")
    compare.set_defaults(func=cmd_compare)
    args = parser.parse_args(argv)
    if args.command == "run" and (args.kill_pid is None) != (args.kill_url is None):
        parser.error("--kill-pid and --kill-url go together")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
