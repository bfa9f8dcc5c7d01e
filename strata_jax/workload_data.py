"""Reading the team's workload data, shared by ``bench serve`` (real engine) and ``simulate``.

* ``loogle_documents``: the LooGLE QA files (``<data>/loogle/{shortdep,longdep}_qa.jsonl``)
  as (title, document text, questions).
* ``mooncake_rows``: a Mooncake trace JSONL (``hash_ids`` = 512-token blocks; equal leading
  ids = a shared prefix) as (prompt ids, row), each block's ids made by the caller.
* ``poisson``: Poisson arrival times on anything with an ``arrival_s``.

Pure Python (no jax): the simulator imports it.
"""

from __future__ import annotations

import ast
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK = 512
LOOGLE_FILES = ("shortdep_qa.jsonl", "longdep_qa.jsonl")


def loogle_documents(data_dir: Path) -> list[tuple[str, str, list[str]]]:
    """(title, document, questions) of every LooGLE document under ``data_dir/loogle``."""
    docs = []
    for name in LOOGLE_FILES:
        path = data_dir / "loogle" / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            qa = ast.literal_eval(row["qa_pairs"]) if isinstance(row["qa_pairs"], str) else row["qa_pairs"]
            docs.append((row["title"], row["input"], [q["Q"] for q in qa]))
    if not docs:
        raise FileNotFoundError(f"no LooGLE data under {data_dir / 'loogle'} (pass --data-dir)")
    return docs


def mooncake_rows(
    path: Path, block_ids: Callable[[int], Iterable[int]], max_input_tokens: int
) -> Iterator[tuple[list[int], dict]]:
    """Each row of the trace with its prompt: ``block_ids(hash_id)`` per block, cut to the
    row's ``input_length`` and ``max_input_tokens``; rows left with no token are skipped."""
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            ids: list[int] = []
            for h in row["hash_ids"]:
                ids.extend(block_ids(int(h)))
            ids = ids[: min(int(row["input_length"]), max_input_tokens)]
            if ids:
                yield ids, row


def poisson(requests: Sequence[Any], rate: float, seed: int) -> None:
    """Set ``arrival_s`` of each request in order: Poisson at ``rate`` req/s, or all at t=0 for ``inf``."""
    rng = random.Random(seed)
    t = 0.0
    for r in requests:
        if not math.isinf(rate):
            t += rng.expovariate(rate)
        r.arrival_s = t
