#!/usr/bin/env python3
"""A LooGLE-style workload through a router in front of strata-jax replicas (``scripts/fleet.sh``).

Subcommands (``scripts/fleet.sh bench`` / ``failover`` call them in turn):

``run``
    Asks D documents x Q questions through the router (streamed chat completions, greedy,
    small ``max_tokens``): question q of every document, in a shuffled order, before
    question q+1 of any, so the questions of one document are spread in time; C requests in
    flight.  Which replica answered each request comes from the ``X-Strata-Instance``
    header (matched to each replica's ``/server_info``); per replica it reports requests,
    hit tokens per tier (from its ``/metrics``, before and after), mean TTFT (streamed, time
    to the first event) and throughput.  Documents: the LooGLE sample under
    ``--data-dir/loogle`` (cut to ``--doc-chars``), else synthetic ones (it says so).
``report``
    Runs side by side (one table) and the checks: no request failed; with
    ``round_robin`` every question that reached a replica which had not computed its
    document (it was computed on another one) took cached tokens from L3 (``storage`` >
    0) and returned the same greedy text as the ``cache_aware`` run's answer to it.
    Exits 1 when a check fails.
``failover``
    Steady streamed load through the router; after ``--before-s`` one replica is killed
    (``--kill-pid``); then: when the router marked it unhealthy, which requests failed
    (they must be requests in flight at the kill or sent before the router noticed, none
    served by a survivor), that every
    request sent after the router noticed succeeded on a survivor.
``verify-l3``
    After the killed replica restarted (empty L1/L2): questions answered before the kill,
    asked of it directly, must take their document from L3 and return the same greedy
    text; its L3 reads must have found no corrupt object; the router must route to it again.

Only the standard library, httpx and prometheus_client (both installed with the project).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
TIERS = ("device", "host", "storage")
TIER_NAMES = {"device": "L1", "host": "L2", "storage": "L3"}
INSTANCE_HEADER = "x-strata-instance"
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"
PROMPT = "Read the document below and answer the question after it.\n\n{document}\n\nQuestion: {question}"


# ---- documents -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Document:
    title: str
    text: str
    questions: tuple[str, ...]


@dataclass(frozen=True)
class Corpus:
    source: str  # "loogle" or "synthetic"
    note: str
    documents: tuple[Document, ...]


def _cut(text: str, chars: int) -> str:
    """The first ``chars`` characters, ending at a word boundary."""
    if len(text) <= chars:
        return text
    cut = text[:chars]
    return cut.rsplit(" ", 1)[0] if " " in cut else cut


def loogle_corpus(data_dir: Path, docs: int, questions: int, chars: int) -> Corpus | None:
    """The first ``docs`` distinct LooGLE documents with at least ``questions`` questions, or None without the data."""
    sys.path.insert(0, str(REPO))
    from strata_jax.workload_data import loogle_documents

    try:
        rows = loogle_documents(data_dir)
    except FileNotFoundError:
        return None
    seen: set[str] = set()
    picked: list[Document] = []
    for title, text, qs in rows:
        if title in seen or len(qs) < questions:
            continue
        seen.add(title)
        picked.append(Document(title, _cut(text, chars), tuple(qs[:questions])))
    if len(picked) < docs:
        raise SystemExit(
            f"the LooGLE data under {data_dir} has {len(picked)} distinct documents with "
            f">= {questions} questions; --docs {docs} asks for more"
        )
    note = f"LooGLE ({data_dir / 'loogle'}): {docs} documents cut to {chars} characters, {questions} questions each"
    return Corpus("loogle", note, tuple(picked[:docs]))


_WORDS = [
    "river",
    "harbour",
    "council",
    "market",
    "bridge",
    "winter",
    "archive",
    "railway",
    "museum",
    "garden",
    "festival",
    "engineer",
    "merchant",
    "library",
    "castle",
    "valley",
    "treaty",
    "harvest",
    "lantern",
    "village",
    "mayor",
    "school",
    "factory",
    "canal",
    "orchestra",
    "painter",
    "printer",
    "quarry",
    "tower",
    "island",
    "monastery",
    "forest",
    "lighthouse",
    "brewery",
    "ferry",
    "observatory",
    "senate",
    "tramway",
    "orchard",
    "vineyard",
    "fortress",
    "theatre",
    "cathedral",
    "mill",
    "granary",
]


def synthetic_corpus(docs: int, questions: int, chars: int, seed: int) -> Corpus:
    """Distinct pseudo-English documents (each about a named town) and questions about them."""
    documents = []
    for d in range(docs):
        rng = random.Random(seed * 1000 + d)
        town = "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3)).capitalize()
        sentences = [f"This is the chronicle of {town}, document number {d}."]
        while sum(len(s) + 1 for s in sentences) < chars:
            words = rng.sample(_WORDS, 7)
            sentences.append(
                f"In {rng.randint(1500, 2020)} the {words[0]} of {town} met the {words[1]} near the "
                f"{words[2]}, and the {words[3]} was rebuilt beside the {words[4]} and the {words[5]} "
                f"for the {words[6]}."
            )
        topics = rng.sample(_WORDS, questions)
        qs = tuple(f"What does the chronicle of {town} say about the {t}?" for t in topics)
        documents.append(Document(f"synthetic {town}", _cut(" ".join(sentences), chars), qs))
    note = f"synthetic: {docs} documents of ~{chars} characters, {questions} questions each"
    return Corpus("synthetic", note, tuple(documents))


def load_corpus(data_dir: Path, docs: int, questions: int, chars: int, seed: int) -> Corpus:
    corpus = loogle_corpus(data_dir, docs, questions, chars)
    if corpus is None:
        corpus = synthetic_corpus(docs, questions, chars, seed)
        print(
            f"no LooGLE data under {data_dir / 'loogle'} (a clone has no ../shared): using {corpus.note}",
            file=sys.stderr,
        )
    return corpus


def schedule(docs: int, questions: int, seed: int) -> list[tuple[int, int]]:
    """(document, question) pairs: question q of every document (shuffled) before question q+1 of any."""
    rng = random.Random(seed)
    return [(d, q) for q in range(questions) for d in rng.sample(range(docs), docs)]


# ---- one request -------------------------------------------------------------------------------
@dataclass
class Answer:
    doc: int
    question: int
    start_s: float  # since the run started
    end_s: float = 0.0
    instance: str | None = None  # X-Strata-Instance of the replica that answered
    replica: int | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # from the answer's logprobs: one string per token
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


LOGPROB_TOLERANCE = 0.05


def same_tokens(a: dict[str, Any] | Answer, b: dict[str, Any] | Answer) -> bool:
    """The same greedy tokens: equal token strings, and logprobs within ``LOGPROB_TOLERANCE`` (byte
    tokens that are not UTF-8 all print as U+FFFD; their logprobs tell them apart, and a cache
    hit's logits differ from a recompute's in the last bits only)."""
    ta, tb = (x.tokens if isinstance(x, Answer) else x["tokens"] for x in (a, b))
    la, lb = (x.logprobs if isinstance(x, Answer) else x["logprobs"] for x in (a, b))
    return bool(ta) and ta == tb and all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(la, lb))


async def ask(
    client: httpx.AsyncClient, url: str, model: str, corpus: Corpus, doc: int, question: int, max_tokens: int, t0: float
) -> Answer:
    """One streamed, greedy chat completion; never raises (a failure is ``Answer.error``)."""
    d = corpus.documents[doc]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT.format(document=d.text, question=d.questions[question])}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,  # the tokens themselves, to compare answers token by token
        "top_logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    out = Answer(doc, question, start - t0)
    done = False
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body) as r:
            out.instance = r.headers.get(INSTANCE_HEADER)
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = f"error event: {chunk['error']}"
                        break
                    for choice in chunk.get("choices") or []:
                        if out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - start
                        out.text += (choice.get("delta") or {}).get("content") or ""
                        for entry in (choice.get("logprobs") or {}).get("content") or []:
                            out.tokens.append(entry["token"])
                            out.logprobs.append(entry["logprob"])
                        out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    usage = chunk.get("usage")
                    if usage:
                        out.prompt_tokens = usage["prompt_tokens"]
                        out.completion_tokens = usage["completion_tokens"]
                        out.cached = {t: int(usage.get("cached_tokens_per_tier", {}).get(t, 0)) for t in TIERS}
                if out.error is None and not done:
                    out.error = "the stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.end_s = time.perf_counter() - t0
    return out


# ---- replicas ----------------------------------------------------------------------------------
def instance_ids(urls: list[str]) -> list[str]:
    """Each replica's ``instance_id`` (its ``/server_info``), to tell which one answered."""
    ids = []
    for url in urls:
        r = httpx.get(url.rstrip("/") + "/server_info", timeout=30)
        r.raise_for_status()
        ids.append(r.json()["instance_id"])
    return ids


COUNTERS = (
    "strata_prompt_tokens_total",
    "strata_completion_tokens_total",
    "strata_time_to_first_token_seconds_sum",
    "strata_time_to_first_token_seconds_count",
)


def scrape(url: str) -> dict[str, float]:
    """The counters this benchmark reads from one replica's ``/metrics`` (keyed ``name{label=value}``)."""
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "strata_requests_total" and s.labels.get("api") == "http":
                out[f"requests{{{s.labels['status']}}}"] = s.value
            elif s.name == "strata_request_cached_tokens_total":
                out[f"cached{{{s.labels['tier']}}}"] = s.value
            elif s.name in COUNTERS:
                out[s.name] = s.value
    return out


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@dataclass
class ReplicaStats:
    url: str
    instance_id: str
    requests: int  # finished (stop or length) on the server, this run
    failed: int  # any other outcome counted by the server
    hit_tokens: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    client_requests: int  # answers whose X-Strata-Instance is this replica
    documents_computed: int  # documents whose first answered question it served
    mean_ttft_s: float | None  # streamed, client side
    server_mean_ttft_s: float | None
    tokens_per_s: float
    requests_per_s: float


def replica_stats(
    urls: list[str], ids: list[str], before: list[dict], after: list[dict], answers: list[Answer], wall_s: float
) -> list[ReplicaStats]:
    first_by_doc: dict[int, int | None] = {}
    for a in sorted(answers, key=lambda a: a.start_s):
        if a.error is None:
            first_by_doc.setdefault(a.doc, a.replica)
    stats = []
    for i, (url, iid, b, a) in enumerate(zip(urls, ids, before, after)):
        mine = [x for x in answers if x.replica == i and x.error is None]
        ttfts = [x.ttft_s for x in mine if x.ttft_s is not None]
        done = int(_delta(a, b, "requests{stop}") + _delta(a, b, "requests{length}"))
        failed = int(sum(_delta(a, b, k) for k in a if k.startswith("requests{")) - done)
        count = _delta(a, b, "strata_time_to_first_token_seconds_count")
        stats.append(
            ReplicaStats(
                url=url,
                instance_id=iid,
                requests=done,
                failed=failed,
                hit_tokens={t: int(_delta(a, b, f"cached{{{t}}}")) for t in TIERS},
                prompt_tokens=int(_delta(a, b, "strata_prompt_tokens_total")),
                completion_tokens=int(_delta(a, b, "strata_completion_tokens_total")),
                client_requests=len(mine),
                documents_computed=sum(1 for r in first_by_doc.values() if r == i),
                mean_ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
                server_mean_ttft_s=_delta(a, b, "strata_time_to_first_token_seconds_sum") / count if count else None,
                tokens_per_s=_delta(a, b, "strata_completion_tokens_total") / wall_s,
                requests_per_s=done / wall_s,
            )
        )
    return stats


def classify(answers: list[Answer]) -> list[dict[str, Any]]:
    """Per answer: the replica that computed its document (served its first question), and
    whether it is an expected L3 hit: the first question of that document on another replica,
    sent after the computing request had finished (so its pages were written to L3)."""
    computed: dict[int, Answer] = {}
    seen: set[tuple[int, int | None]] = set()
    out = []
    for a in sorted(answers, key=lambda a: a.start_s):
        if a.error is not None:
            first = computed.get(a.doc)
            out.append(
                {
                    "answer": a,
                    "computed_on": first.replica if first else None,
                    "foreign_first": False,
                    "while_computing": False,
                }
            )
            continue
        first = computed.setdefault(a.doc, a)
        elsewhere = first is not a and a.replica != first.replica and (a.doc, a.replica) not in seen
        seen.add((a.doc, a.replica))
        out.append(
            {
                "answer": a,
                "computed_on": first.replica,
                "foreign_first": elsewhere and a.start_s >= first.end_s,
                "while_computing": elsewhere and a.start_s < first.end_s,  # the document was not in L3 yet
            }
        )
    return out


# ---- run -----------------------------------------------------------------------------------------
async def run_workload(
    router: str,
    model: str,
    corpus: Corpus,
    pairs: list[tuple[int, int]],
    concurrency: int,
    max_tokens: int,
    ids: list[str],
    timeout_s: float,
) -> tuple[list[Answer], float]:
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for p in pairs:
        queue.put_nowait(p)
    answers: list[Answer] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                doc, question = queue.get_nowait()
                a = await ask(client, router, model, corpus, doc, question, max_tokens, t0)
                a.replica = ids.index(a.instance) if a.instance in ids else None
                answers.append(a)
                status = a.error or f"{a.cached['device']}/{a.cached['host']}/{a.cached['storage']} cached L1/L2/L3"
                print(f"  [{a.end_s:7.1f} s] doc {doc} q {question} -> replica {a.replica}: {status}", file=sys.stderr)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers, time.perf_counter() - t0


def probe_router(router: str, model: str, ids: list[str]) -> dict[str, Any]:
    """What the router lists on ``/v1/models``, and one ``/v1/completions`` request through it."""
    models = httpx.get(router.rstrip("/") + "/v1/models", timeout=30)
    models.raise_for_status()
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    r = httpx.post(router.rstrip("/") + "/v1/completions", json=body, timeout=300)
    instance = r.headers.get(INSTANCE_HEADER)
    return {
        "models": [m["id"] for m in models.json().get("data", [])],
        "completions": {
            "status": r.status_code,
            "replica": ids.index(instance) if instance in ids else None,
            "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:300],
        },
    }


def cmd_run(args: argparse.Namespace) -> int:
    corpus = load_corpus(Path(args.data_dir), args.docs, args.questions, args.doc_chars, args.seed)
    pairs = schedule(args.docs, args.questions, args.seed)
    ids = instance_ids(args.replicas)
    probe = probe_router(args.router, args.model, ids)
    print(
        f"the router lists {probe['models']}; /v1/completions through it: HTTP {probe['completions']['status']} "
        f"from replica {probe['completions']['replica']}",
        file=sys.stderr,
    )
    if args.flush_after_probe:
        for url in args.replicas:  # the probe's pages must not count as the workload's hits
            httpx.post(url.rstrip("/") + "/admin/flush_cache", json={"tier": "all"}, timeout=60).raise_for_status()
    before = [scrape(u) for u in args.replicas]
    print(
        f"{args.policy}: {len(pairs)} requests ({corpus.note}), {args.concurrency} in flight, via {args.router}",
        file=sys.stderr,
    )
    answers, wall_s = asyncio.run(
        run_workload(
            args.router, args.model, corpus, pairs, args.concurrency, args.max_tokens, ids, args.request_timeout_s
        )
    )
    after = [scrape(u) for u in args.replicas]
    stats = replica_stats(args.replicas, ids, before, after, answers, wall_s)
    result = {
        "policy": args.policy,
        "router": args.router,
        "model": args.model,
        "documents": {
            "source": corpus.source,
            "note": corpus.note,
            "count": args.docs,
            "questions": args.questions,
            "chars": args.doc_chars,
            "titles": [d.title for d in corpus.documents],
        },
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "router_probe": probe,
        "wall_s": wall_s,
        "replicas": [dataclasses.asdict(s) for s in stats],
        "answers": [
            {
                **dataclasses.asdict(c["answer"]),
                "computed_on": c["computed_on"],
                "foreign_first": c["foreign_first"],
                "while_computing": c["while_computing"],
            }
            for c in classify(answers)
        ],
    }
    print_table([result])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    errors = [a for a in answers if a.error]
    for a in errors:
        print(f"FAILED: doc {a.doc} q {a.question}: {a.error}", file=sys.stderr)
    return 1 if errors else 0


# ---- report --------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return f"{1000 * s:8.0f}" if s is not None else "       -"


def print_table(runs: list[dict]) -> None:
    print(
        f"{'policy':<12} {'replica':<24} {'reqs':>5} {'docs':>5} {'L1 hit':>7} {'L2 hit':>7} {'L3 hit':>7} "
        f"{'prompt':>7} {'TTFT ms':>8} {'tok/s':>6} {'req/s':>6}"
    )
    for run in runs:
        for r in run["replicas"]:
            h = r["hit_tokens"]
            print(
                f"{run['policy']:<12} {r['url']:<24} {r['requests']:>5} {r['documents_computed']:>5} {h['device']:>7} "
                f"{h['host']:>7} {h['storage']:>7} {r['prompt_tokens']:>7} {_ms(r['mean_ttft_s'])} "
                f"{r['tokens_per_s']:>6.1f} {r['requests_per_s']:>6.2f}"
            )
        ok = [a for a in run["answers"] if a["error"] is None]
        ttft = [a["ttft_s"] for a in ok if a["ttft_s"] is not None]
        hits = {t: sum(r["hit_tokens"][t] for r in run["replicas"]) for t in TIERS}
        tokens = sum(r["completion_tokens"] for r in run["replicas"])
        print(
            f"{run['policy']:<12} {'all (via the router)':<24} {len(ok):>5} {run['documents']['count']:>5} "
            f"{hits['device']:>7} {hits['host']:>7} {hits['storage']:>7} "
            f"{sum(r['prompt_tokens'] for r in run['replicas']):>7} {_ms(sum(ttft) / len(ttft) if ttft else None)} "
            f"{tokens / run['wall_s']:>6.1f} {len(ok) / run['wall_s']:>6.2f}   ({run['wall_s']:.0f} s)"
        )


def checks(runs: list[dict]) -> list[tuple[str, bool, str]]:
    """(name, passed, detail) of each check over the runs."""
    out = []
    by_policy = {r["policy"]: r for r in runs}
    for run in runs:
        probe = run["router_probe"]
        out.append(
            (
                f"{run['policy']}: the router lists the served model",
                probe["models"] == [run["model"]],
                f"/v1/models: {probe['models']}",
            )
        )
        out.append(
            (
                f"{run['policy']}: /v1/completions routes",
                probe["completions"]["status"] == 200 and probe["completions"]["replica"] is not None,
                f"HTTP {probe['completions']['status']}, answered by replica {probe['completions']['replica']}",
            )
        )
        errors = [a for a in run["answers"] if a["error"]]
        out.append(
            (
                f"{run['policy']}: every request answered",
                not errors,
                f"{len(run['answers']) - len(errors)}/{len(run['answers'])} answered",
            )
        )
        used = Counter(a["replica"] for a in run["answers"] if a["error"] is None)
        out.append(
            (
                f"{run['policy']}: requests per replica",
                True,
                ", ".join(f"replica {k}: {v}" for k, v in sorted(used.items(), key=lambda kv: str(kv[0]))),
            )
        )
    rr, ca = by_policy.get("round_robin"), by_policy.get("cache_aware")
    if rr is not None:
        foreign = [a for a in rr["answers"] if a["foreign_first"]]
        with_l3 = [a for a in foreign if a["cached"]["storage"] > 0]
        racing = sum(1 for a in rr["answers"] if a["while_computing"])
        detail = (
            f"{len(with_l3)}/{len(foreign)} questions whose document another replica had computed took it from "
            f"L3 ({sum(a['cached']['storage'] for a in foreign)} L3 tokens of "
            f"{sum(a['prompt_tokens'] for a in foreign)} prompt tokens; not counted: {racing} sent while "
            f"the other replica was still computing the document)"
        )
        out.append(("round_robin: L3 hits across replicas", bool(foreign) and len(with_l3) == len(foreign), detail))
        if ca is not None:
            ref = {(a["doc"], a["question"]): a for a in ca["answers"] if a["error"] is None}
            compared = [a for a in foreign if (a["doc"], a["question"]) in ref]
            same = [a for a in compared if same_tokens(a, ref[(a["doc"], a["question"])])]
            out.append(
                (
                    "round_robin: same greedy tokens as cache_aware where L3 served the document",
                    bool(compared) and len(same) == len(compared),
                    f"{len(same)}/{len(compared)} identical",
                )
            )
            everything = [a for a in rr["answers"] if a["error"] is None and (a["doc"], a["question"]) in ref]
            equal = sum(1 for a in everything if same_tokens(a, ref[(a["doc"], a["question"])]))
            out.append(
                (
                    "all questions: same greedy tokens in both runs (informational)",
                    True,
                    f"{equal}/{len(everything)} identical",
                )
            )
    return out


def cmd_report(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    print()
    print(runs[0]["documents"]["note"] + f"; max_tokens {runs[0]['max_tokens']}, {runs[0]['concurrency']} in flight")
    print_table(runs)
    results = checks(runs)
    print()
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"runs": runs, "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in results]}, indent=1
            )
        )
    return 0 if all(ok for _, ok, _ in results) else 1


# ---- failover ------------------------------------------------------------------------------------
def router_health(router: str) -> dict[str, bool]:
    """``{worker url: is_healthy}`` as the router sees them (a removed worker is absent)."""
    r = httpx.get(router.rstrip("/") + "/workers", timeout=5)
    r.raise_for_status()
    return {w["url"]: bool(w.get("is_healthy")) for w in r.json().get("workers", [])}


async def failover_load(args: argparse.Namespace, corpus: Corpus, ids: list[str]) -> dict[str, Any]:
    victim_url = args.replicas[args.kill_replica]
    pairs = schedule(args.docs, args.questions, args.seed)
    answers: list[Answer] = []
    t0 = time.perf_counter()
    kill_s: float | None = None
    noticed_s: float | None = None
    stop_s = args.before_s + args.after_s
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=10), limits=limits) as client:
        counter = iter(range(1 << 30))

        async def worker() -> None:
            while time.perf_counter() - t0 < stop_s:
                doc, question = pairs[next(counter) % len(pairs)]
                a = await ask(client, args.router, args.model, corpus, doc, question, args.max_tokens, t0)
                a.replica = ids.index(a.instance) if a.instance in ids else None
                answers.append(a)

        async def killer() -> None:
            nonlocal kill_s, noticed_s
            await asyncio.sleep(args.before_s)
            os.kill(args.kill_pid, getattr(signal, f"SIG{args.signal}"))
            kill_s = time.perf_counter() - t0
            print(
                f"  [{kill_s:7.1f} s] SIG{args.signal} -> replica {args.kill_replica} (pid {args.kill_pid})",
                file=sys.stderr,
            )
            while time.perf_counter() - t0 < stop_s:
                health = await asyncio.to_thread(router_health, args.router)
                if not health.get(victim_url, False):
                    noticed_s = time.perf_counter() - t0
                    print(f"  [{noticed_s:7.1f} s] the router marked it unhealthy ({health})", file=sys.stderr)
                    return
                await asyncio.sleep(0.1)

        await asyncio.gather(killer(), *(worker() for _ in range(args.concurrency)))
    return {"answers": answers, "kill_s": kill_s, "noticed_s": noticed_s, "wall_s": time.perf_counter() - t0}


def cmd_failover(args: argparse.Namespace) -> int:
    corpus = load_corpus(Path(args.data_dir), args.docs, args.questions, args.doc_chars, args.seed)
    ids = instance_ids(args.replicas)
    victim = args.kill_replica
    print(
        f"failover: {args.concurrency} streams through {args.router} for {args.before_s} s, then SIG{args.signal} to "
        f"replica {victim}, {args.after_s} s more",
        file=sys.stderr,
    )
    out = asyncio.run(failover_load(args, corpus, ids))
    answers: list[Answer] = out["answers"]
    kill_s, noticed_s = out["kill_s"], out["noticed_s"]
    if kill_s is None:
        raise SystemExit("the replica was never killed (the run ended first)")
    in_flight = [a for a in answers if a.start_s <= kill_s <= a.end_s]
    # A request sent after the kill but before the router's health check noticed it may still be
    # routed to the dead replica (the router cannot know yet): that window is part of the failure.
    blind = [a for a in answers if kill_s < a.start_s and (noticed_s is None or a.start_s <= noticed_s)]
    exposed_ids = {id(a) for a in in_flight + blind}
    errors = [a for a in answers if a.error]
    after = [a for a in answers if noticed_s is not None and a.start_s > noticed_s]
    survivors = [i for i in range(len(args.replicas)) if i != victim]
    results = [
        (
            "the router marked the killed replica unhealthy",
            noticed_s is not None,
            f"{noticed_s - kill_s:.1f} s after the kill" if noticed_s is not None else "never",
        ),
        (
            "errors only for requests in flight at the kill or sent before the router noticed, none served by "
            "a survivor",
            all(id(a) in exposed_ids and a.replica not in survivors for a in errors),
            (
                f"{len(errors)} errors; {len(in_flight)} requests in flight at the kill "
                f"({sum(1 for a in in_flight if a.replica == victim)} known on the killed replica), "
                f"{len(blind)} sent between the kill and the router noticing"
            ),
        ),
        (
            "requests sent after the router noticed: all answered by a survivor",
            bool(after) and all(a.error is None and a.replica in survivors for a in after),
            f"{sum(1 for a in after if a.error is None and a.replica in survivors)}/{len(after)}",
        ),
        (
            "the survivors kept serving",
            any(a.error is None and a.replica in survivors and a.start_s > kill_s for a in answers),
            f"{sum(1 for a in answers if a.error is None and a.replica in survivors and a.start_s > kill_s)} answered "
            "after the kill",
        ),
    ]
    for a in errors:
        print(f"  error (started {a.start_s:.1f} s, replica {a.replica}): {a.error}", file=sys.stderr)
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    before = [a for a in answers if a.error is None and a.end_s < kill_s]
    print(
        f"answered before the kill: {len(before)} "
        f"({', '.join(f'replica {i}: {sum(1 for a in before if a.replica == i)}' for i in range(len(args.replicas)))})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "replicas": args.replicas,
                    "killed": victim,
                    "signal": args.signal,
                    "kill_s": kill_s,
                    "noticed_s": noticed_s,
                    "documents": {
                        "source": corpus.source,
                        "note": corpus.note,
                        "chars": args.doc_chars,
                        "docs": args.docs,
                        "questions": args.questions,
                        "seed": args.seed,
                        "data_dir": args.data_dir,
                    },
                    "max_tokens": args.max_tokens,
                    "answers": [dataclasses.asdict(a) for a in answers],
                    "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in results],
                },
                indent=1,
            )
        )
    return 0 if all(ok for _, ok, _ in results) else 1


def cmd_verify_l3(args: argparse.Namespace) -> int:
    prior = json.loads(Path(args.failover).read_text())
    spec = prior["documents"]
    corpus = load_corpus(Path(spec["data_dir"]), spec["docs"], spec["questions"], spec["chars"], spec["seed"])
    reference: dict[tuple[int, int], dict[str, Any]] = {}
    for a in prior["answers"]:  # answered well before the kill: their documents were in L3 by then
        if a["error"] is None and a["end_s"] < prior["kill_s"] - args.settle_s:
            reference.setdefault((a["doc"], a["question"]), a)
    picks: list[tuple[int, int]] = []
    for key in sorted(reference):
        if key[0] not in {d for d, _ in picks}:
            picks.append(key)
    picks = picks[: args.questions]
    if not picks:
        raise SystemExit("no question was answered before the kill: nothing to read back")

    async def ask_all(url: str) -> list[Answer]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=10)) as client:
            t0 = time.perf_counter()
            return [await ask(client, url, args.model, corpus, d, q, prior["max_tokens"], t0) for d, q in picks]

    got = asyncio.run(ask_all(args.replica))
    storage = httpx.get(args.replica.rstrip("/") + "/admin/cache_stats", timeout=60).json().get("storage") or {}
    results = []
    for (d, q), a in zip(picks, got):
        same = same_tokens(a, reference[(d, q)])
        ok = a.error is None and a.cached["storage"] > 0 and same
        results.append(
            (
                f"doc {d} q {q} read back from L3",
                ok,
                a.error
                or f"{a.cached['storage']}/{a.prompt_tokens} prompt tokens from L3, "
                f"tokens {'identical' if same else 'DIFFERENT'}: {a.text!r}",
            )
        )
    results.append(
        ("no corrupt L3 object read", storage.get("corrupt") == 0, f"storage stats of the restarted replica: {storage}")
    )
    # the router routes to the restarted replica again (health checks passed)
    deadline = time.monotonic() + args.rejoin_timeout_s
    while time.monotonic() < deadline and not router_health(args.router).get(args.replica.rstrip("/"), False):
        time.sleep(0.5)
    new_id = instance_ids([args.replica])[0]

    async def via_router() -> list[Answer]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s, connect=10)) as client:
            t0 = time.perf_counter()
            return [
                await ask(client, args.router, args.model, corpus, d, q, prior["max_tokens"], t0) for d, q in picks * 2
            ]

    routed = asyncio.run(via_router())
    back = sum(1 for a in routed if a.error is None and a.instance == new_id)
    results.append(
        (
            "the router sends to the restarted replica again",
            back > 0,
            f"{back}/{len(routed)} requests through the router answered by it",
        )
    )
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in results],
                    "answers": [dataclasses.asdict(a) for a in got],
                },
                indent=1,
            )
        )
    return 0 if all(ok for _, ok, _ in results) else 1


# ---- command line --------------------------------------------------------------------------------
def _workload_flags(p: argparse.ArgumentParser, docs: int, questions: int, concurrency: int) -> None:
    p.add_argument("--router", required=True, help="the router's URL")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--docs", type=int, default=docs, help="documents")
    p.add_argument("--questions", type=int, default=questions, help="questions per document")
    p.add_argument(
        "--doc-chars",
        type=int,
        default=5300,
        help="characters per document (5300: ~1,200 SmolLM2 tokens of LooGLE text)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each answer (greedy)")
    p.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight")
    p.add_argument("--seed", type=int, default=0, help="order of the questions; synthetic documents")
    p.add_argument(
        "--data-dir",
        default=os.environ.get("STRATA_DATA_DIR", str(DEFAULT_DATA_DIR)),
        help="folder holding loogle/*.jsonl (default $STRATA_DATA_DIR or ../shared/data)",
    )
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--json", default=None, help="write the results here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one policy: the workload through the router")
    _workload_flags(run, docs=8, questions=6, concurrency=2)
    run.add_argument("--replicas", nargs="+", required=True, help="each replica's URL (for /server_info and /metrics)")
    run.add_argument("--policy", required=True, help="the router's policy (a label for the report)")
    run.add_argument(
        "--no-flush-after-probe",
        dest="flush_after_probe",
        action="store_false",
        help="keep what the /v1/completions probe cached (default: flush every tier before the workload)",
    )
    report = sub.add_parser("report", help="runs side by side, and the checks")
    report.add_argument("runs", nargs="+", help="JSON files written by `run`")
    report.add_argument("--json", default=None)
    fail = sub.add_parser("failover", help="kill one replica under load")
    _workload_flags(fail, docs=4, questions=6, concurrency=4)
    fail.add_argument("--replicas", nargs="+", required=True)
    fail.add_argument("--kill-replica", type=int, required=True, help="index of the replica to kill")
    fail.add_argument("--kill-pid", type=int, required=True, help="its process id")
    fail.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
    fail.add_argument("--before-s", type=float, default=30.0, help="load before the kill")
    fail.add_argument("--after-s", type=float, default=30.0, help="load after the kill")
    verify = sub.add_parser("verify-l3", help="the restarted replica reads the L3 the fleet left")
    verify.add_argument("--replica", required=True, help="the restarted replica's URL")
    verify.add_argument("--router", required=True)
    verify.add_argument("--model", required=True)
    verify.add_argument("--failover", required=True, help="the JSON written by `failover`")
    verify.add_argument("--questions", type=int, default=3, help="questions to read back (one per document)")
    verify.add_argument("--rejoin-timeout-s", type=float, default=30.0)
    verify.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        help="read back questions answered at least this long before the kill (L3 writes are asynchronous)",
    )
    verify.add_argument("--request-timeout-s", type=float, default=600.0)
    verify.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    handler = {"run": cmd_run, "report": cmd_report, "failover": cmd_failover, "verify-l3": cmd_verify_l3}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
