"""Which decode rows speculate, what they propose, and what a verification kept (issue 38).

A speculating row's decode step is a short extend over ``[its last token, p1 .. pk]``
(``ExtendChunk.verify``): the target model's token after each of those positions comes
back, picked on the device exactly as decoding would pick it there (``argmax`` for a greedy
row; for a sampled one the row's processors over the tokens before that position and the
same draw with the PRNG key of that token's number: ``runtime/verify_sampling.py``).  The
longest run of proposals equal to the picks is accepted, and the pick after that run (the
correction, or a bonus token when all k were right) is emitted too.  So a step emits
1 .. k+1 tokens, each one exactly what decoding would have produced: the output does not
depend on the proposals, only the number of steps does.  At temperature > 0 this is
rejection sampling (Leviathan et al.) for a proposal that is a single token: ``pj`` is
kept with the target's probability of it, and a rejected position's token follows the
target without ``pj``; and with a seed the tokens equal decoding's without speculation.
The KV written for rejected positions lies past the request's length: never read, never
inserted into the tree, overwritten by the next step (``EngineCore`` keeps that true).

Every row speculates but a structured output's: its grammar would need a mask per
proposed position, computed on the host from the tokens before it (it decodes as before,
in the same step).  Sampled rows, penalties, ``logit_bias`` and ``min_tokens`` speculate:
the picks see the proposed tokens before them as generated, and the picks that are
emitted are counted in the row's penalty state on the device.  Rows asking for logprobs
speculate: each emitted token's logprob and top alternatives come from the verification's
position that chose it (the same log-softmax of the same logits; a different program, so
equal to a decode's within float rounding).

Speculating costs a verification program instead of a decode program, and what that
costs against what it saves differs by machine and batch: on this project's 2-core CPU a
one-row verification of 8 tokens takes about 3x a one-row decode (a matmul over 8 rows
is not free there; docs/runtime.md), on a GPU a decode of a small batch is memory-bound and 8 rows cost
little more than 1.  So each step ``choose`` picks which rows verify from measured step
times (seconds per decode program and per verification program, by rows bucket) and each
row's running acceptance, the choice with the most tokens per second of the step.  A row
that does not verify is still scored: its proposal is compared with the tokens it then
decodes (``observe_token``), so the acceptance estimate of a row that stepped aside
keeps up at no cost to the device, and it comes back once its text turns repetitive.

The verification program is padded to k + 1 tokens per row, so a shorter proposal costs
the same on the device: a row whose acceptance is low steps aside, its proposal is not
shortened.

Pure Python and numpy (no jax): the engine core and the simulator share this layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from strata_jax.engine.executor import SeqRow
from strata_jax.spec import NgramProposer, Proposer, SpeculativeConfig


@dataclass
class SpeculationCounters:
    """vLLM's spec-decode metrics: drafts (verifications with at least one proposed token),
    proposed tokens, accepted tokens, and acceptances per proposal position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted proposals plus the one always emitted."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


ACCEPTANCE_WEIGHT = 0.2  # of a new sample in a row's running acceptance (and in the prior)
STEP_TIME_WEIGHT = 0.2  # of a new step time in its program's running mean
FIRST_ACCEPTANCE = 1.0  # accepted tokens per proposal a new row is assumed to get, until measured
MAX_DECLINED_STEPS = 512  # the longest a batch size goes without holding a row after declines


def rows_bucket(rows: int) -> int:
    """The power of two a program of ``rows`` rows is padded to (the runner's batch buckets)."""
    return 1 << max(0, rows - 1).bit_length()


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


class StepTimes:
    """Running seconds of one kind of program (decode, verification) by rows bucket.  A
    program's first run is not kept: it is an outlier (first-use costs on the device)."""

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}
        self._runs: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        b = rows_bucket(rows)
        self._runs[b] = runs = self._runs.get(b, 0) + 1
        if runs > 1 and math.isfinite(seconds) and seconds >= 0:
            self._mean[b] = _ema(self._mean.get(b), seconds, STEP_TIME_WEIGHT)

    def measured(self, rows: int) -> bool:
        """Whether the bucket of ``rows`` rows has a kept time."""
        return rows_bucket(rows) in self._mean

    def seconds(self, rows: int) -> float:
        """Seconds of a program of ``rows`` rows (some bucket measured): its bucket's, else
        the nearest measured bucket's, scaled up by the rows when it is smaller (a guess
        until that bucket runs once)."""
        if rows == 0:
            return 0.0
        table = self._mean
        b = rows_bucket(rows)
        if b in table:
            return table[b]
        near = min(table, key=lambda k: abs(k.bit_length() - b.bit_length()))
        return table[near] * b / near if b > near else table[near]


class Speculator:
    """Proposals for the rows that may speculate, which of them verify (``choose``), and the
    bookkeeping of what they kept."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        if proposer is None and config.method != "ngram":
            raise ValueError(f"method {config.method!r} needs its proposer (engine.factory builds it)")
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self._acceptance: dict[str, float] = {}  # request id -> running accepted tokens per proposal
        self._prior = FIRST_ACCEPTANCE  # running acceptance over all rows: a new row's estimate
        self._found: dict[str, float] = {}  # request id -> running share of lookups that found a proposal
        self._found_prior = 1.0  # the same over all rows
        self._shadow: dict[str, tuple[list[int], int]] = {}  # a row that did not verify: its proposal, matched
        self._decode = StepTimes()
        self._verify = StepTimes()
        self._rest = self.rest_tokens  # what rows stepping aside now rest (1 while measuring a decode)
        self._resting: dict[str, int] = {}  # request id -> tokens it decodes before it is considered again
        self._batch = 1  # rows of the last decode step (with the verifications when there were any)
        self.stepped_aside = 0  # rows with a proposal that the cost decision kept decoding
        self._decode_steps = 0
        # rows bucket -> (decode step before which no row is held there, that wait's length)
        self._declined: dict[int, tuple[int, int]] = {}

    # -------------------------------------------------------------- what verifying is worth
    def acceptance(self, request_id: str) -> float:
        """Accepted tokens the row's next proposal is expected to get.  A row with no
        sample yet is given the benefit of the doubt (at least the break-even): its first
        proposal is tried and measured, whatever other rows' text was like."""
        got = self._acceptance.get(request_id)
        return got if got is not None else max(self._prior, self.break_even())

    def expected_gain(self, request_id: str) -> float:
        """Accepted tokens the row's next step is expected to get: how often a lookup finds
        a proposal for it times what a proposal gets.  A row is held for its next step
        only when this beats the break-even: held without a proposal, it would only lose
        the host/device overlap."""
        found = self._found.get(request_id)
        if found is None and request_id not in self._acceptance:
            found = 1.0  # (the benefit of the doubt, as in ``acceptance``)
        return (found if found is not None else self._found_prior) * self.acceptance(request_id)

    def _record(self, request_id: str, accepted: int) -> None:
        self._acceptance[request_id] = _ema(self._acceptance.get(request_id), accepted, ACCEPTANCE_WEIGHT)
        self._prior = _ema(self._prior, accepted, ACCEPTANCE_WEIGHT)

    def observe_decode(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds`` on the device."""
        self._decode.observe(rows, seconds)
        self._batch = rows
        self._decode_steps += 1

    def observe_verify(self, rows: int, seconds: float) -> None:
        """A verification step of ``rows`` rows took ``seconds`` on the device."""
        self._verify.observe(rows, seconds)

    def choose(self, plain_rows: int, candidates: Sequence[tuple[str, int]]) -> list[bool]:
        """Which ``candidates`` (request id, proposal length) verify this step,
        beside ``plain_rows`` rows that decode anyway: the choice with the most expected
        tokens per second of the step (module doc), rows with the best acceptance first.

        Measured first: while the verification of all of them has no measured time (its
        rows bucket never ran) they all verify; while the decode of all rows has none, they
        all decode.  Other sizes are estimated from the nearest measured bucket."""
        n = len(candidates)
        if n == 0:
            return []
        self._batch = plain_rows + n
        if not self._verify.measured(n):
            return [True] * n
        if not self._decode.measured(plain_rows + n):
            self._rest = 1  # only to measure: they are considered again at once
            return [False] * n
        self._rest = self.rest_tokens
        gains = [min(float(length), self.acceptance(rid)) for rid, length in candidates]
        order = sorted(range(n), key=lambda i: -gains[i])
        best_count, best_rate = n, -1.0
        tokens = float(plain_rows + n)  # every row emits one token either way
        for count in range(n + 1):
            if count:
                tokens += gains[order[count - 1]]
            seconds = self._decode.seconds(plain_rows + n - count) + self._verify.seconds(count)
            rate = tokens / max(seconds, 1e-9)
            if rate > best_rate:
                best_count, best_rate = count, rate
        chosen = [False] * n
        for i in order[:best_count]:
            chosen[i] = True
            self._shadow.pop(candidates[i][0], None)  # (its verification scores it now)
        self._note_decision(rows_bucket(plain_rows + n), declined=best_count == 0)
        return chosen

    def _note_decision(self, bucket: int, *, declined: bool) -> None:
        """After ``choose`` declined every candidate in a batch of this size, no row is held
        there for a while, twice as long after each decline in a row (up to
        ``MAX_DECLINED_STEPS`` decode steps); one verification chosen ends it.  A held row
        loses the host/device overlap, so at a load where verifying does not pay, holding
        rows only to decline them cost every step its overlap (measured: a burst of 32 on
        SmolLM2 had 97 of 100 steps dispatched to an idle device, 0.91x the tokens/s)."""
        if not declined:
            self._declined.pop(bucket, None)
            return
        _, wait = self._declined.get(bucket, (0, self.rest_tokens // 2))
        wait = min(2 * wait, MAX_DECLINED_STEPS)
        self._declined[bucket] = (self._decode_steps + wait, wait)

    def _batch_declined(self) -> bool:
        """Whether batches of the last one's size are waiting after declines (``_note_decision``)."""
        declined = self._declined.get(rows_bucket(self._batch))
        return declined is not None and self._decode_steps < declined[0]

    def wants_token(self, row: SeqRow) -> bool:
        """Whether the row's next step needs its last token on the host (for a proposal):
        it may speculate, is not resting, and its running acceptance is worth a
        verification in the batch last seen (``break_even``).  Any other row is not held:
        it decodes with the host and device overlapped like any other row."""
        if not self.may_speculate(row):
            return False
        return self._would_hold(row.request_id)

    def _would_hold(self, request_id: str) -> bool:
        """Not resting, its batch size not waiting after declines, its gain worth a verification."""
        return (
            request_id not in self._resting
            and not self._batch_declined()
            and self.expected_gain(request_id) >= self.break_even()
        )

    def break_even(self) -> float:
        """Accepted tokens per proposal above which verifying every row of a batch as large
        as the last one gives more tokens per second than decoding it: the measured time
        of that verification over that decode, less one (0 while either has no measured
        time: try).  ``choose`` then picks which rows verify, from their own estimates."""
        batch = self._batch
        if not (self._verify.measured(batch) and self._decode.measured(batch)):
            return 0.0
        return max(0.0, self._verify.seconds(batch) / max(self._decode.seconds(batch), 1e-9) - 1.0)

    def step_aside(self, request_id: str, proposal: list[int]) -> None:
        """``choose`` kept the row decoding although it had a proposal: it rests (is not
        held) for ``rest_tokens`` tokens, or until its proposals start to match, and its
        proposal is scored against the tokens it decodes."""
        self.stepped_aside += 1
        self._resting[request_id] = self._rest
        self._shadow.setdefault(request_id, (proposal, 0))

    @property
    def rest_tokens(self) -> int:
        """Tokens a row that stepped aside decodes before it is considered again: long
        enough that the step it is held for (to be considered) is a small share."""
        return 2 * (self.config.num_speculative_tokens + 1)

    def observe_token(self, request_id: str, token: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A token a row that may speculate emitted (``output_ids`` ends with it): scores
        the proposal in flight for it.  A row that does not verify now (resting, or below
        the break-even) gets a proposal to score every k + 1 tokens, so its estimate keeps
        up with its text: one that matches at least a token ends its rest."""
        shadow = self._shadow.get(request_id)
        if shadow is not None:
            proposal, matched = shadow
            hit = proposal[matched] == token
            matched += hit
            if hit and matched < len(proposal):
                self._shadow[request_id] = (proposal, matched)
            else:  # a miss, or all of it matched: that is what a verification would have kept
                del self._shadow[request_id]
                self._record(request_id, matched)
                if matched:
                    self._resting.pop(request_id, None)
        rest = self._resting.get(request_id)
        if rest is not None:
            if rest <= 1:
                del self._resting[request_id]
            else:
                self._resting[request_id] = rest - 1
        k = self.config.num_speculative_tokens
        if request_id in self._shadow or self._would_hold(request_id):
            return  # being scored, or it proposes for itself next step
        if len(output_ids) % (k + 1) == 0:
            proposal = self.propose(prompt_ids, output_ids, k, request_id)
            if proposal:
                self._shadow[request_id] = (proposal, 0)

    def forget(self, request_id: str) -> None:
        """The request left: drop what is kept about it (here and in the proposer)."""
        self.proposer.forget(request_id)
        self._acceptance.pop(request_id, None)
        self._found.pop(request_id, None)
        self._shadow.pop(request_id, None)
        self._resting.pop(request_id, None)

    @staticmethod
    def may_speculate(row: SeqRow) -> bool:
        """No grammar (module doc)."""
        return row.grammar is None

    def propose(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], limit: int, request_id: str | None = None
    ) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` proposed tokens after the sequence
        (whether there were any counts in ``request_id``'s running find rate)."""
        k = min(limit, self.config.num_speculative_tokens)
        if k <= 0 or not output_ids:
            return []
        ids = np.concatenate((np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)))
        proposal = [int(token) for token in self.proposer.propose(ids, k, request_id)]
        if request_id is not None:
            found = 1.0 if proposal else 0.0
            self._found[request_id] = _ema(self._found.get(request_id), found, ACCEPTANCE_WEIGHT)
            self._found_prior = _ema(self._found_prior, found, ACCEPTANCE_WEIGHT)
        return proposal

    def accepted(self, proposal: Sequence[int], picks: Sequence[int], request_id: str | None = None) -> int:
        """How many leading proposals equal the target's picks (``picks[j]`` follows the
        verification's position ``j``: the last token, then proposal ``j - 1``); counted."""
        if len(picks) != len(proposal) + 1:
            raise ValueError(f"{len(picks)} picks for {len(proposal)} proposed")
        n = 0
        while n < len(proposal) and proposal[n] == picks[n]:
            n += 1
        if request_id is not None and proposal:
            self._record(request_id, n)
        c = self.counters
        if proposal:
            c.drafts += 1
            c.draft_tokens += len(proposal)
            c.accepted_tokens += n
            for position in range(n):
                c.accepted_per_position[position] += 1
        return n
