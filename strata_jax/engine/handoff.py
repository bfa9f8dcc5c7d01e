"""Waiting for a prompt's KV that another replica computes (prefill/decode disaggregation).

A decode replica given a request whose prompt a prefill replica is computing (the
router's ``bootstrap_room``) does not start computing it: it waits until the prompt's
pages are in the shared L3, then admits the request as any other, and the scheduler's L3
prefetch brings the pages in; only what is missing (the last partial page, pages that
never landed) is computed.  ``HandoffWait`` decides when to stop waiting (pure Python, no
jax; the caller polls it, so an asyncio server waits without holding a thread):

* every full page of the prompt is in L3: ``complete``;
* pages had begun to land during the wait and then none landed for ``stall_s``:
  ``stalled`` (the prefill replica died mid-write, or L3 dropped pages).  Pages already in
  L3 when the wait begins (a shared document, an earlier turn) are not a start: a prefill
  replica's first new pages come with its first chunk, after its queue, so before the first
  new page only the deadline ends the wait;
* ``deadline_s`` after the wait began: ``deadline`` (the prefill replica never got it, died,
  or is far slower than expected).

What the prefill replica says of the request (``note_peer``, when the router named it: the
caller asks it over HTTP, ``serving/disaggregation.py``) moves these ends:

* ``in_flight`` (queued or prefilling there): the deadline becomes ``max_wait_s`` and no
  gap between pages is a stall, so a prompt queued behind other people's prompts, or whose
  chunks take turns with theirs, on a busy prefill replica is waited for, not computed twice;
* ``done`` (its prefill ended; its pages are on their way to L3): ``stalled`` if they have
  not all landed ``deadline_s`` later (a loaded prefill replica writes them a step or more
  after its prefill ends);
* ``failed`` (it ended the request without finishing the prefill) or ``unreachable`` twice
  in a row (it died): ``prefill_lost`` at once;
* ``unknown`` (it never got the request, or forgot it): the deadline as without it.

With ``HandoffPolicy.local_tokens`` set (off by default), a prompt with at most that many
tokens not in L3 when the wait begins (a chat turn over a cached conversation, a short
question) is not waited for: ``local``, the replica computes it at once.

The deadline comes from the cost model (``HandoffPolicy.deadline``): a fixed allowance for
the router's dispatch and the prefill replica's queue, plus a multiple of this replica's own
predicted prefill time for the part of the prompt not yet in L3 (the replicas run the same
model), never more than ``max_wait_s``.  Past it the decode replica computes the prompt itself: a late prefill
replica costs the client that time, never an answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HandoffPolicy:
    """How long a decode replica waits for a prompt's pages (the ``serve --handoff-*`` flags
    take their help from here).

    base_s: fixed allowance for the router's dispatch and the prefill replica's queue.
    prefill_factor: the wait allows this many times this replica's predicted prefill of the
        part of the prompt not yet in L3.
    stall_s: pages began to land and none landed for this long: compute the rest here.
    max_wait_s: the wait never exceeds this; then what is missing is computed here.
    poll_s: time between two L3 existence probes.
    peer_poll_s: time between two questions to the prefill replica about the request (when
        the router names it: ``--prefill URL PORT`` with PORT its HTTP port).
    local_tokens: a prompt with at most this many tokens not yet in L3 is computed here at
        once (a chat turn, a short question), costing the streams here a few tokens of one
        step; it pays only behind a router that streams this replica's answer without waiting
        for the prefill replica's (sglang-router 0.3.2 waits: docs/serving.md); 0 waits for
        every prompt.
    """

    base_s: float = 2.0
    prefill_factor: float = 3.0
    stall_s: float = 2.0
    max_wait_s: float = 60.0
    poll_s: float = 0.02
    peer_poll_s: float = 0.25
    local_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.local_tokens, int) or isinstance(self.local_tokens, bool) or self.local_tokens < 0:
            raise ValueError(f"handoff local_tokens must be an integer >= 0, got {self.local_tokens!r}")
        for name in ("base_s", "prefill_factor", "stall_s", "max_wait_s", "poll_s", "peer_poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"handoff {name} must be a finite number >= 0, got {value!r}")
        for name in ("poll_s", "peer_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"handoff {name} must be positive, got {getattr(self, name)!r}")

    def deadline(self, predicted_prefill_s: float) -> float:
        """Seconds to wait for a prompt whose prefill this replica predicts at ``predicted_prefill_s``."""
        predicted = 0.0 if math.isnan(predicted_prefill_s) else predicted_prefill_s  # NaN: no estimate
        predicted = min(max(predicted, 0.0), self.max_wait_s)  # inf or absurd: the cap
        return min(self.base_s + self.prefill_factor * predicted, self.max_wait_s)


# "local": short enough to compute here without waiting (HandoffPolicy.local_tokens); the
# others end a wait: every page landed, or (stalled, prefill_lost, deadline) it gave up
OUTCOMES = ("complete", "stalled", "prefill_lost", "deadline", "local")
PEER_STATES = ("in_flight", "done", "failed", "unknown", "unreachable")
UNREACHABLE_LOST = 2  # consecutive unanswered questions that mean the prefill replica is gone


@dataclass(frozen=True)
class HandoffResult:
    """How a wait ended (``outcome``: one of ``OUTCOMES``): pages of the prompt wanted and in
    L3 at the end, seconds waited."""

    wanted_pages: int
    landed_pages: int
    waited_s: float
    outcome: str

    @property
    def fell_back(self) -> bool:
        """The replica computes (part of) the prompt itself."""
        return self.outcome != "complete"

    @property
    def gave_up(self) -> bool:
        """The replica waited and the pages did not all come (not a short prompt computed at once)."""
        return self.outcome not in ("complete", "local")


class HandoffWait:
    """One request's wait; ``poll()`` probes L3 and returns the result once the wait is over.

    ``probe(start)`` returns how many of the prompt's pages, from the first, are in L3,
    asking L3 only from page ``start`` on (the pages before were seen there already; pages
    land in order, so each probe is short once they begin to; an L3 that fails answers
    ``start``: the caller's probe counts its errors).  ``present_pages``: the
    count when the wait began (probed by the caller, which sized the deadline from it).
    ``compute_here``: the prompt is short enough to compute at once (``HandoffPolicy.local_tokens``):
    the wait is over before it starts (``local``)."""

    def __init__(
        self,
        probe: Callable[[int], int],
        wanted_pages: int,
        present_pages: int,
        deadline_s: float,
        stall_s: float,
        clock: Callable[[], float],
        poll_s: float = 0.02,
        max_wait_s: float | None = None,
        compute_here: bool = False,
    ) -> None:
        self._probe = probe
        self.wanted_pages = wanted_pages
        self.present_pages = present_pages
        self.deadline_s = deadline_s
        self._stall_s = stall_s
        self._clock = clock
        self.poll_s = poll_s
        self._started = clock()
        self._landed = present_pages
        self._last_progress: float | None = None  # when the count last grew (None: no new page yet)
        self._max_wait_s = deadline_s if max_wait_s is None else max(max_wait_s, deadline_s)
        self.peer: str | None = None  # what the prefill replica last said (None: never asked)
        self._peer_done_at: float | None = None
        self._unreachable = 0
        self.result: HandoffResult | None = None
        if compute_here:
            self.result = HandoffResult(wanted_pages, present_pages, 0.0, "local")

    def note_peer(self, state: str) -> None:
        """What the prefill replica says of the request now (one of ``PEER_STATES``)."""
        if state not in PEER_STATES:
            raise ValueError(f"unknown prefill replica state {state!r}")
        self._unreachable = self._unreachable + 1 if state == "unreachable" else 0
        if state == "unreachable" and self.peer is not None and self._unreachable < UNREACHABLE_LOST:
            return  # one unanswered question is not yet a dead replica: keep what it said before
        if state == "done" and self._peer_done_at is None:
            self._peer_done_at = self._clock()
        self.peer = state

    def poll(self) -> HandoffResult | None:
        """Probe once (not when every page was there already); the result when the wait is
        over (then every later call returns it)."""
        if self.result is not None:
            return self.result
        now = self._clock()
        landed = self._probe(self._landed) if self._landed < self.wanted_pages else self._landed
        if landed > self._landed:
            self._landed = landed
            self._last_progress = now
        waited = now - self._started
        if self._landed >= self.wanted_pages:
            outcome = "complete"
        elif self.peer == "in_flight":  # alive and on it: a gap between its chunks is no stall
            if waited < self._max_wait_s:
                return None
            outcome = "deadline"
        elif self.peer == "failed" or (self.peer == "unreachable" and self._unreachable >= UNREACHABLE_LOST):
            outcome = "prefill_lost"
        elif self._peer_done_at is not None:
            # its prefill ended and the last pages are being written: a loaded prefill replica
            # writes them a step or more later, so the whole deadline again (capped), not stall_s
            if now - self._peer_done_at < self.deadline_s and waited < self._max_wait_s:
                return None
            outcome = "stalled"
        elif self._last_progress is not None and now - self._last_progress >= self._stall_s:
            outcome = "stalled"
        elif waited >= self.deadline_s:
            outcome = "deadline"
        else:
            return None
        self.result = HandoffResult(self.wanted_pages, self._landed, waited, outcome)
        return self.result
