"""Which decode rows speculate, what they propose, and what a verification kept (issue 38).

A speculating row's decode step is a short extend over ``[its last token, p1 .. pk]``
(``ExtendChunk.verify``): the target model's greedy token after each of those positions
comes back, the longest run of proposals equal to them is accepted, and the greedy token
after that run (the correction, or a bonus token when all k were right) is emitted too.
So a step emits 1 .. k+1 tokens, each one exactly what greedy decoding would have
produced: the output does not depend on the proposals, only the number of steps does.
The KV written for rejected positions lies past the request's length: never read, never
inserted into the tree, overwritten by the next step (``EngineCore`` keeps that true).

Only greedy rows without per-token host or device state speculate: sampling at
temperature > 0 needs rejection sampling (not built), penalties / ``logit_bias`` /
``min_tokens`` keep device state per sampled token, a structured output's grammar needs a
mask per position, and logprobs would have to come from the verification's positions.
Those rows decode as before, in the same step.

Pure Python and numpy (no jax): the engine core and the simulator share this layer.
"""

from __future__ import annotations

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


class Speculator:
    """Proposals for the rows that may speculate, and the bookkeeping of what they kept."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.counters = SpeculationCounters(accepted_per_position=[0] * config.num_speculative_tokens)

    @staticmethod
    def may_speculate(row: SeqRow) -> bool:
        """Greedy, and nothing per sampled token besides the token itself (module doc)."""
        p = row.params
        return p.temperature == 0 and not p.needs_sampling_state and row.grammar is None and p.logprobs is None

    def propose(self, prompt_ids: Sequence[int], output_ids: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` proposed tokens after the sequence."""
        k = min(limit, self.config.num_speculative_tokens)
        if k <= 0 or not output_ids:
            return []
        ids = np.concatenate((np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)))
        return [int(token) for token in self.proposer.propose(ids, k)]

    def accepted(self, proposal: Sequence[int], greedy: Sequence[int]) -> int:
        """How many leading proposals equal the target's greedy tokens (``greedy[j]`` follows
        the verification's position ``j``: the last token, then proposal ``j - 1``); counted."""
        if len(greedy) != len(proposal) + 1:
            raise ValueError(f"{len(greedy)} greedy tokens for {len(proposal)} proposed")
        n = 0
        while n < len(proposal) and proposal[n] == greedy[n]:
            n += 1
        c = self.counters
        if proposal:
            c.drafts += 1
            c.draft_tokens += len(proposal)
            c.accepted_tokens += n
            for position in range(n):
                c.accepted_per_position[position] += 1
        return n
