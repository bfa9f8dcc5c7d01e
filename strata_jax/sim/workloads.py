"""Simulated request streams: LooGLE-like document QA, multi-turn chat, Mooncake replay, ShareGPT-like.

Token ids are synthetic (a document or trace block is a run of ids unique to
it; only equality matters to the cache).  Every generator is deterministic in its seed.

* ``loogle``: documents with the length and question-count distribution of
  ``<data>/loogle/*.jsonl`` (document tokens ~ characters / 4, Llama-3-like),
  ``docs`` of them; each pass over the documents asks every document its number
  of questions (drawn from the data), until ``num_requests``.  Cache distance
  orders the questions: ``min`` (a document's questions back to back), ``max``
  (round robin over documents: the farthest reuse), ``shuffle`` (random).
  ``warmup=True`` puts one unmeasured request per document (the document alone,
  one output token) before the stream: the cache then starts as a long-running
  server's would, every document already computed once.
* ``multiturn``: the SGLang HiCache benchmark shape: ``clients`` conversations of
  ``rounds`` turns, each turn appends ``request_length`` new tokens to the
  history (which includes the previous answers); a turn is sent once the previous
  one finished and its Poisson arrival time has come.
* ``mooncake``: a Mooncake trace (``hash_ids`` = 512-token blocks, equal leading
  ids = shared prefix), timestamps honoured and divided by ``speedup``.
* ``sharegpt``: short chats (16-1024 token prompts, 16-512 token answers) with no
  shared prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from strata_jax.workload_data import MOONCAKE_BLOCK, loogle_documents, mooncake_rows, poisson

WORKLOADS = ("loogle", "multiturn", "mooncake", "sharegpt")
CACHE_DISTANCES = ("min", "shuffle", "max")
CHARS_PER_TOKEN = 4.0


def find_data_dir(explicit: str | Path | None = None) -> Path:
    """``explicit``, else ``../shared/data`` next to the repository (or its parent)."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_dir():
            raise FileNotFoundError(f"--data-dir {path} is not a directory")
        return path
    repo = Path(__file__).resolve().parents[2]
    for cand in (repo.parent / "shared" / "data", repo.parent.parent / "shared" / "data", repo / "shared" / "data"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError("no shared/data next to the repository; pass --data-dir")


@dataclass
class SimRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0
    depends_on: int | None = None  # multiturn: the previous turn; its answer is spliced into this prompt
    new_tokens: list[int] = field(default_factory=list)  # multiturn: this turn's own message
    group: str = ""
    warmup: bool = False  # run before the measured stream (all at t=0), excluded from every metric


class _Ids:
    """Fresh runs of token ids (no two runs share an id)."""

    def __init__(self) -> None:
        self.next = 1

    def run(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def loogle_shape(data_dir: Path) -> list[tuple[int, int, int]]:
    """(document tokens, questions, mean question tokens) of each LooGLE document in the data."""
    out = []
    for _, text, questions in loogle_documents(data_dir):
        q_tokens = sum(len(q) for q in questions) / max(1, len(questions)) / CHARS_PER_TOKEN
        out.append((int(len(text) / CHARS_PER_TOKEN), len(questions), max(4, int(q_tokens))))
    return out


def loogle(
    *,
    num_requests: int,
    rate: float,
    seed: int,
    data_dir: Path | None = None,
    docs: int = 100,
    distance: str = "max",
    output_len: int = 32,
    max_doc_tokens: int = 120_000,
    warmup: bool = False,
    shape: list[tuple[int, int, int]] | None = None,
) -> list[SimRequest]:
    """``shape``: (document tokens, questions, mean question tokens) per document instead of
    the LooGLE data's (``loogle_shape``); ``data_dir`` is then not read."""
    if distance not in CACHE_DISTANCES:
        raise ValueError(f"cache distance must be one of {CACHE_DISTANCES}, got {distance!r}")
    if shape is None:
        if data_dir is None:
            raise ValueError("loogle needs data_dir (the LooGLE documents) or an explicit shape")
        shape = loogle_shape(data_dir)
    rng = random.Random(seed)
    ids = _Ids()
    documents = []
    for d in range(docs):
        tokens, questions, q_tokens = shape[d % len(shape)] if d < len(shape) else rng.choice(shape)
        tokens = min(max_doc_tokens, int(tokens * rng.uniform(0.8, 1.2)) if d >= len(shape) else tokens)
        documents.append((f"doc{d}", ids.run(tokens), questions, q_tokens))
    passes: list[list[list[SimRequest]]] = []  # pass -> document -> its questions
    total = 0
    while total < num_requests:
        this = []
        for name, doc, questions, q_tokens in documents:
            qs = []
            for _ in range(questions):
                qs.append(
                    SimRequest(doc + ids.run(max(4, int(q_tokens * rng.uniform(0.5, 1.5)))), output_len, group=name)
                )
                total += 1
            this.append(qs)
        passes.append(this)
    out: list[SimRequest] = []
    for this in passes:
        if distance == "min":
            out.extend(r for qs in this for r in qs)
        elif distance == "max":
            depth = max(len(qs) for qs in this)
            out.extend(qs[k] for k in range(depth) for qs in this if k < len(qs))
        else:
            flat = [r for qs in this for r in qs]
            rng.shuffle(flat)
            out.extend(flat)
    out = out[:num_requests]  # the last pass is ordered whole, then cut
    poisson(out, rate, seed + 1)
    if warmup:
        out = [SimRequest(list(doc), 1, group=name, warmup=True) for name, doc, _, _ in documents] + out
    return out


def cached_sequence_tokens(requests: list[SimRequest]) -> list[int]:
    """Token lengths of the sequences a run leaves cached, one per reuse point (what a
    window-aware tier keeps a window for, ``ModelSpec.cached_share``): a group's shared
    prefix where its prompts share one (a LooGLE document), a multi-turn conversation's
    whole length once (its turns' messages and answers), else each request's prompt and answer."""
    groups: dict[str, list[SimRequest]] = {}
    out = []
    for r in requests:
        if r.group:
            groups.setdefault(r.group, []).append(r)
        else:
            out.append(len(r.prompt) + r.output_len)
    for rs in groups.values():
        if any(r.depends_on is not None for r in rs):  # a conversation: each turn adds its message and answer
            out.append(sum(len(r.prompt if r.depends_on is None else r.new_tokens) + r.output_len for r in rs))
        elif len(rs) == 1:
            out.append(len(rs[0].prompt) + rs[0].output_len)
        else:
            first, common = rs[0].prompt, len(rs[0].prompt)
            for r in rs[1:]:
                common = next(
                    (i for i, (a, b) in enumerate(zip(first[:common], r.prompt)) if a != b), min(common, len(r.prompt))
                )
            out.append(common)
    return out


def multiturn(
    *,
    num_requests: int,
    rate: float,
    seed: int,
    rounds: int = 5,
    request_length: int = 512,
    output_len: int = 64,
) -> list[SimRequest]:
    clients = max(1, num_requests // rounds)
    ids = _Ids()
    out: list[SimRequest] = []
    last: dict[int, int] = {}
    for _ in range(rounds):
        for c in range(clients):
            if len(out) >= num_requests:
                break
            new = ids.run(request_length)
            previous = last.get(c)
            # a first turn is its own message; a later one is built when the previous answer is known
            prompt = new if previous is None else []
            out.append(SimRequest(prompt, output_len, depends_on=previous, new_tokens=new, group=f"client{c}"))
            last[c] = len(out) - 1
    poisson(out, rate, seed)
    return out


def mooncake(
    *,
    num_requests: int,
    path: Path,
    speedup: float = 1.0,
    max_input_tokens: int = 131_072,
    max_output: int | None = None,
) -> list[SimRequest]:
    if not speedup > 0:
        raise ValueError("--speedup must be > 0")
    if not path.is_file():
        raise FileNotFoundError(f"Mooncake trace {path} does not exist (pass --trace)")
    out: list[SimRequest] = []
    for ids, row in mooncake_rows(
        path, lambda h: range(1 + h * MOONCAKE_BLOCK, 1 + (h + 1) * MOONCAKE_BLOCK), max_input_tokens
    ):
        out_len = max(1, int(row["output_length"]))
        if max_output is not None:
            out_len = min(out_len, max_output)
        out.append(SimRequest(ids, out_len, arrival_s=row["timestamp"] / 1000.0 / speedup))
        if len(out) >= num_requests:
            break
    return out


def sharegpt(*, num_requests: int, rate: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    ids = _Ids()
    out = [
        SimRequest(
            ids.run(int(min(1024, max(16, rng.lognormvariate(5.3, 0.8))))),
            int(min(512, max(16, rng.lognormvariate(5.0, 0.7)))),
        )
        for _ in range(num_requests)
    ]
    poisson(out, rate, seed + 1)
    return out
