"""A draft model's proposals: its greedy continuation of a request's sequence (issue 38).

The draft has a runner and a KV pool of its own (``ModelRunner`` without the cache
controller: no tree, no tiers).  Each request's sequence keeps its pages there between
proposals, with the tokens whose KV they hold; a proposal computes only what is new since
the last one (the tokens the target accepted and emitted, in chunks of the runner's batch
budget), takes the draft's greedy token after them, then decodes ``k - 1`` more.  The KV
those decodes wrote lies past the sequence's tokens and is overwritten by the next catch-up,
as the target's rejected positions are.

The draft only proposes: the target's verification decides every emitted token, so a
draft that is wrong (another model, a quantised copy, float rounding) costs acceptance,
never exactness.  A draft is greedy whatever the request samples: its proposal is one
token per position, which is what ``runtime/verify_sampling.py``'s acceptance assumes.

When the pool is short, the least recently used other sequences give their pages back (they
recompute from their start at their next proposal); a sequence that alone needs more than
the pool, or is past the draft's context, gets no proposal (it decodes as usual).

Per row: a step holds one sequence, so a batch's proposals take ``k`` device steps each.
Batching them (one catch-up step and ``k - 1`` decode steps for all rows) is the next step
for GPUs, where one draft step costs little more for many rows than for one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from strata_jax.runtime.model_runner import ModelRunner, SeqInput


@dataclass
class _DraftSequence:
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # whose KV the pages hold
    pages: list[int] = field(default_factory=list)


class DraftModelProposer:
    """``Proposer`` over a draft model's runner (module doc)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        config = runner.config
        self.page_size = config.page_size
        self.max_context_tokens = config.max_context_tokens
        self.chunk_tokens = config.max_batch_tokens
        self._free = list(range(config.num_device_pages - 1, -1, -1))
        self._sequences: OrderedDict[str, _DraftSequence] = OrderedDict()  # least recently used first
        self.steps = 0  # draft device steps run (catch-up chunks and decodes)
        self.evicted_tokens = 0  # tokens of sequences whose pages were taken for another (recomputed if they come back)

    def forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self._give_back(sequence)

    def propose(self, token_ids: np.ndarray, k: int, request_id: str | None = None) -> np.ndarray:
        ids = np.asarray(token_ids, np.int64)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be one sequence, got shape {ids.shape}")
        n = len(ids)
        # positions 0 .. n + k - 2 are written (the last proposal's own KV is never needed)
        if k <= 0 or n == 0 or n + k - 1 > self.max_context_tokens:
            return np.zeros(0, np.int32)
        sequence = self._sequences.pop(request_id, None) if request_id is not None else None
        if sequence is None:
            sequence = _DraftSequence()
        if not self._reserve(sequence, -(-(n + k - 1) // self.page_size)):
            self._give_back(sequence)
            return np.zeros(0, np.int32)
        # the longest prefix whose KV the pages hold; the last token always runs (its logits)
        held = min(len(sequence.tokens), n - 1)
        differs = np.flatnonzero(sequence.tokens[:held] != ids[:held])
        start = int(differs[0]) if differs.size else held
        token = self._catch_up(sequence.pages, ids, start)
        proposal = [token]
        for position in range(n, n + k - 1):
            token = self._run(SeqInput([token], position, sequence.pages))
            proposal.append(token)
        sequence.tokens = ids
        if request_id is None:
            self._give_back(sequence)
        else:
            self._sequences[request_id] = sequence  # the most recently used
        return np.asarray(proposal, np.int32)

    def _catch_up(self, pages: list[int], ids: np.ndarray, start: int) -> int:
        """Run ``ids[start:]`` in chunks; the draft's greedy token after the last one."""
        token = -1
        while start < len(ids):
            chunk = ids[start : start + self.chunk_tokens]
            last = start + len(chunk) == len(ids)
            token = self._run(SeqInput([int(t) for t in chunk], start, pages, keep_sample=last))
            start += len(chunk)
        return token

    def _run(self, work: SeqInput) -> int:
        self.steps += 1
        return int(self.runner.step([work]).next_tokens[0])

    def _reserve(self, sequence: _DraftSequence, pages: int) -> bool:
        """Grow ``sequence`` to ``pages`` pages, taking them from the least recently used other
        sequences when none are free; False when the whole pool would not do."""
        while len(sequence.pages) < pages:
            if not self._free:
                if not self._sequences:
                    return False
                _, evicted = self._sequences.popitem(last=False)
                self.evicted_tokens += len(evicted.tokens)
                self._give_back(evicted)
                continue
            sequence.pages.append(self._free.pop())
        return True

    def _give_back(self, sequence: _DraftSequence) -> None:
        self._free.extend(reversed(sequence.pages))
        sequence.pages = []
        sequence.tokens = np.zeros(0, np.int64)
