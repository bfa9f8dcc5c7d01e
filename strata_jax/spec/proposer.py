"""Proposers: a guess of a row's next tokens, for the target model to verify in one step.

``Proposer`` is the seam: n-gram prompt lookup here, a draft model in
``strata_jax.runtime.draft_proposer`` (it holds device state per request: ``request_id``
names the sequence, ``forget`` drops it); EAGLE-style heads would be a third.

``NgramProposer`` is vLLM's ``ngram`` method (prompt lookup decoding): the last n tokens
of the sequence (prompt and output so far) are looked for earlier in it, longest n
first from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and the tokens that followed
the match are proposed.  Among several matches of the same n the most recent with k tokens
after it wins (the most recent of all when none has): answers about a document and code
edits copy the span they are working through, which the latest occurrence tracks best.
The search is a numpy comparison over a sliding window view of the ids (no per-token
Python loop), O(len * n) per call.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class Proposer(Protocol):
    def propose(self, token_ids: np.ndarray, k: int, request_id: str | None = None) -> np.ndarray:
        """At most ``k`` proposed next tokens (int32, possibly none) after ``token_ids``, the
        sequence of request ``request_id`` (None: a sequence of its own, nothing kept)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request left: drop anything kept for it."""
        ...


class NgramProposer:
    """Prompt lookup over the sequence's own tokens (see module doc)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def forget(self, request_id: str) -> None:
        return None  # nothing is kept per request

    def propose(self, token_ids: np.ndarray, k: int, request_id: str | None = None) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be one sequence, got shape {ids.shape}")
        if k <= 0:
            return np.zeros(0, np.int32)
        length = len(ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself
            windows = sliding_window_view(ids[: length - 1], n)
            hits = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
            if hits.size:
                # the most recent match whose continuation has all k tokens, else the most recent
                # (a run of one repeated token matches just before the suffix: one token of
                # continuation, where an earlier match of the same run proposes k)
                full = hits[hits + n + k <= length]
                start = int(full[-1] if full.size else hits[-1]) + n
                return ids[start : start + k].astype(np.int32)
        return np.zeros(0, np.int32)
