"""The scheduler's record of one request and its life cycle.

``waiting -> (deferred <-> waiting) -> prefilling (chunks) -> decoding -> finished``;
any live state can go to ``aborted``; ``decoding -> waiting`` is a retraction
(the engine backs the KV up to L2 first, the request re-prefills from the cache).
The record is the one owner of a request's token progress: the ``Scheduler`` moves
its life cycle and counts (``computed``, ``generated``) as steps are dispatched; the
engine reads them, and appends each output token's value once it is read back
(``add_output``), which the scheduler needs only to re-prefill a retracted request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    DEFERRED = "deferred"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def queued(self) -> bool:
        """In the waiting queue (not yet holding device KV)."""
        return self in (RequestStatus.WAITING, RequestStatus.DEFERRED)

    @property
    def live(self) -> bool:
        return self not in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(eq=False)
class ScheduledRequest:
    """One request as the scheduler sees it.

    ``arrival`` is a strictly increasing submission number (the queue order).
    ``prefill_tokens`` is what a prefill must cover: the prompt, or prompt +
    outputs so far after a retraction.  ``computed`` counts the positions whose KV is on
    the device for this request or being computed there by a dispatched step (cached
    prefix taken + chunks + decodes); a retracted request's stays until its next first
    chunk sets it (the engine hands its KV to the tree in the step that retracts it).
    ``generated`` counts the samples dispatched, ``output_token_ids`` the values read
    back so far (one step behind while a step is in flight).  ``inflight_end`` is the end of the chunk dispatched
    and not yet reported done (None when nothing of this request is running
    in a prefill).  ``cached_tokens`` is what its first prefill chunk took from
    each tier (device/host/storage), for ``RequestOutput.cached_tokens``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    namespace: str
    arrival: int
    prefill_tokens: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    generated: int = 0
    computed: int = 0
    inflight_end: int | None = None
    decode_inflight: bool = False
    held: bool = False  # its next step needs host work on its last token first (a grammar's mask)
    prefetch_choice: str | None = None  # "waited" / "not_waited": what the scheduler chose for its L3 prefetch
    cached_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    deferrals: int = 0
    retractions: int = 0
    first_scheduled_round: int | None = None
    last_decode_round: int = -1
    _page_keys: tuple[int, int, list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_tokens:
            self.prefill_tokens = self.prompt_token_ids

    @property
    def remaining_prefill(self) -> int:
        return len(self.prefill_tokens) - self.computed

    @property
    def seq_len(self) -> int:
        """Tokens whose KV the request holds or will hold (prompt + outputs so far)."""
        return len(self.prompt_token_ids) + self.generated

    @property
    def num_output_tokens(self) -> int:
        return self.generated

    def add_output(self, token_id: int) -> None:
        """The value of the next output token, read back by the engine."""
        self.output_token_ids.append(token_id)

    def page_keys(self, page_size: int) -> list[int]:
        """Chained hashes of the full pages of ``prefill_tokens``: key i stands for tokens[: (i+1)*page_size].

        Two requests share their first k pages iff their first k keys are equal
        (up to 64-bit hash collisions, which could only skew the scheduler's
        accounting, never data: the tree decides what is reused).  Cached.
        """
        n = len(self.prefill_tokens)
        cached = self._page_keys
        if cached is not None and cached[0] == page_size and cached[1] == n:
            return cached[2]
        keys: list[int] = []
        h = hash(self.namespace)
        toks = self.prefill_tokens
        for start in range(0, n - page_size + 1, page_size):
            h = hash((h, toks[start : start + page_size]))
            keys.append(h)
        self._page_keys = (page_size, n, keys)
        return keys
