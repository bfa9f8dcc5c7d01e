"""``RoundQueue``: one round's walk over the waiting queue.

It hands requests to the policy head first, skips (and records) the ones the
delay-hit rule defers, and at the end of the round yields the new queue order:
deferred requests at the front (in their order), then every request not admitted,
in its original order, so a request set aside or not fitting keeps its place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from strata_jax.scheduler.batch import Candidate


class RoundQueue:
    """Cursor over the waiting queue for one scheduling round.

    ``classify(request_id)`` returns the request's ``Candidate`` or None when the
    delay-hit rule defers it this round; it is called at most once per request,
    and only for the first ``lookahead`` queued requests (bounding the matches
    one round costs; the rest keep their order for later rounds).
    """

    def __init__(
        self, order: list[str], classify: Callable[[str], Candidate | None], lookahead: int | None = None
    ) -> None:
        # Only the first ``lookahead`` queued requests are examined this round.
        limit = len(order) if lookahead is None else lookahead
        self._order = order[:limit]
        self._tail = order[limit:]
        self._classify = classify
        self._cache: dict[str, Candidate | None] = {}
        self._cursor = 0
        self.admitted: set[str] = set()
        self.deferred: list[str] = []

    @property
    def classified(self) -> set[str]:
        """Requests whose match was looked at this round."""
        return set(self._cache)

    def _get(self, rid: str) -> Candidate | None:
        if rid not in self._cache:
            cand = self._classify(rid)
            self._cache[rid] = cand
            if cand is None:
                self.deferred.append(rid)
        return self._cache[rid]

    def pop_head(self) -> Candidate | None:
        """The next request in queue order not yet admitted or deferred (None at the end)."""
        while self._cursor < len(self._order):
            rid = self._order[self._cursor]
            self._cursor += 1
            if rid in self.admitted:
                continue
            cand = self._get(rid)
            if cand is not None:
                return cand
        return None

    def rest(self) -> Iterator[Candidate]:
        """Requests after the cursor, not admitted and not deferred, in order (for bundle pulls)."""
        for rid in self._order[self._cursor :]:
            if rid not in self.admitted:
                cand = self._get(rid)
                if cand is not None:
                    yield cand

    def admit(self, cand: Candidate) -> None:
        self.admitted.add(cand.request.request_id)

    def new_order(self) -> list[str]:
        deferred = set(self.deferred)
        rest = [rid for rid in self._order if rid not in self.admitted and rid not in deferred]
        return [rid for rid in self._order if rid in deferred] + rest + self._tail
