"""Request streams for ``strata-jax bench serve``: LooGLE documents, multi-turn chats,
Mooncake traces and short prompts.  Each yields ``BenchRequest``s with arrival offsets."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from strata_jax.workload_data import MOONCAKE_BLOCK, loogle_documents, mooncake_rows

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    group: str = ""  # e.g. the document a LooGLE question is about
    depends_on: int | None = None  # multiturn: index of the previous turn of the same client
    client: int = -1
    extra: dict = field(default_factory=dict)


def loogle(
    encode: Callable[[str], list[int]],
    *,
    data_dir: Path,
    doc_tokens: int,
    num_requests: int,
    output_len: int,
    seed: int,
    questions_per_doc: int = 4,
) -> list[BenchRequest]:
    """Questions about LooGLE documents; the questions of one document arrive together.

    Each request is ``document[:doc_tokens] + question``; documents are visited round
    robin in bursts of ``questions_per_doc`` questions (the shape where delay-hit
    deferral matters, and where a small L1 cycles through the documents).
    """
    docs = loogle_documents(data_dir)
    encoded = [(title, encode(text)[:doc_tokens], qs) for title, text, qs in docs]
    out: list[BenchRequest] = []
    round_ = 0
    while len(out) < num_requests:
        for title, doc_ids, qs in encoded:
            for k in range(questions_per_doc):
                if len(out) >= num_requests:
                    break
                q = qs[(round_ * questions_per_doc + k) % len(qs)]
                out.append(BenchRequest(doc_ids + encode("\nQ: " + q + "\nA:")[1:], output_len, group=title))
        round_ += 1
    return out


def multiturn(
    vocab: int, *, clients: int, rounds: int, request_length: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """Clients whose every turn appends ``request_length`` new tokens to their history.

    Turn r of a client depends on turn r-1 (the history includes the previous answer,
    which the runner splices in when it is known: ``depends_on``).
    """
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    last: dict[int, int] = {}
    for _ in range(rounds):
        for c in range(clients):
            new = [rng.randrange(3, vocab) for _ in range(request_length)]
            out.append(BenchRequest(new, output_len, client=c, depends_on=last.get(c), group=f"client{c}"))
            last[c] = len(out) - 1
    return out


def mooncake_trace(
    vocab: int, *, path: Path, num_requests: int, max_input_tokens: int, output_len: int | None, time_scale: float
) -> list[BenchRequest]:
    """Mooncake JSONL (``hash_ids`` = 512-token blocks): equal leading ids share a prefix.

    Each block's tokens are derived deterministically from its hash id; inputs are
    truncated to ``max_input_tokens``; timestamps (ms) are scaled by ``time_scale``.
    """
    out: list[BenchRequest] = []

    def block_ids(h: int) -> list[int]:
        block_rng = random.Random(h)
        return [block_rng.randrange(3, vocab) for _ in range(MOONCAKE_BLOCK)]

    for ids, row in mooncake_rows(path, block_ids, max_input_tokens):
        out.append(
            BenchRequest(
                ids, output_len or max(1, min(row["output_length"], 64)), arrival_s=row["timestamp"] / 1000 * time_scale
            )
        )
        if len(out) >= num_requests:
            break
    return out


def short_prompts(vocab: int, *, num_requests: int, output_len: int, seed: int) -> list[BenchRequest]:
    """ShareGPT-shaped short chats (no shared prefix beyond chance): 16-256 token prompts."""
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))], output_len)
        for _ in range(num_requests)
    ]
