"""The executor seam (DESIGN §2): what the engine's step loop asks of the machine.

The step loop (``strata_jax.engine_step.EngineCore``) decides nothing about time
or devices; it hands an ``Executor`` the sequences to run and gets sampled tokens
and the measured seconds back.  Two implementations:

* ``strata_jax.runtime.jax_executor.JaxExecutor``: the real model on real devices
  (``ModelRunner`` steps; wall-clock time).
* ``strata_jax.sim.executor.SimExecutor``: a cost model of a target machine on a
  virtual clock.

The scheduler, the HiRadixTree and the cache controller are the same objects in
both.  Contract:

* ``now()`` is the clock every timestamp of the engine and the controller uses.
* ``extend(seqs, loads)`` runs ``seqs`` (prefill chunks) to completion and returns
  the token sampled at each sequence's last position and the seconds the step took
  from the caller's point of view (waiting for ``loads``, the L2->L1 copies issued
  for this batch, included: the real device waits for them through data flow).
* ``dispatch_decode(seqs)`` starts one decode step and returns at once;
  ``finish_decode(pending)`` waits for it.  Between the two the engine issues the
  batch's loads (bubble filling), so they overlap the decode.
* ``idle()``: nothing could run this step (everything waits on a transfer or a
  deferral); sleep a little, or advance virtual time to the next event.
* ``span(name)``: a profiler span around a phase of the step.
* ``open_sampling_state(rid, prompt_ids, output_ids, params)`` gives a request
  that asked for penalties/logit_bias/min_tokens its per-sequence state (False when
  none is free: the engine parks the request until ``close_sampling_state`` of
  another); an executor without device state accepts and ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from strata_jax.api import SamplingParams, TokenLogprob
    from strata_jax.cache.handles import TransferHandle


@dataclass(frozen=True)
class SeqWork:
    """One sequence's work in a step (the executor-neutral form of ``runtime.SeqInput``).

    ``token_ids`` are the new tokens, ``start_pos`` how many tokens of the sequence
    are already in the KV pool, ``page_ids`` its device pages in order (caller-owned:
    no other sequence writes them), ``sample_index`` how many tokens the request has
    sampled so far (it keys the request's sampling randomness).
    ``keep_sample``: the token sampled at the last position is kept (False for a
    prefill chunk that is not the prompt's last: the penalty counts skip it).
    ``prompt_logprob_targets``: per new token, the prompt token after it whose
    logprob is wanted (-1: none); None when the request did not ask.
    """

    request_id: str
    token_ids: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]
    params: SamplingParams
    sample_index: int
    keep_sample: bool = True
    prompt_logprob_targets: Sequence[int] | None = None


@dataclass(frozen=True)
class StepOutput:
    """Sampled token per request id, and the seconds the step took; the sampled
    token's logprob for requests that asked, and the prompt logprobs of the
    chunk's positions (one per new token) for requests that asked."""

    tokens: dict[str, int]
    seconds: float
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class Executor(Protocol):
    def now(self) -> float: ...

    def extend(self, seqs: list[SeqWork], loads: Sequence[TransferHandle]) -> StepOutput: ...

    def dispatch_decode(self, seqs: list[SeqWork]) -> Any: ...

    def finish_decode(self, pending: Any) -> StepOutput: ...

    def idle(self) -> None: ...

    def span(self, name: str) -> AbstractContextManager[Any]: ...

    def open_sampling_state(
        self, request_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams
    ) -> bool: ...

    def close_sampling_state(self, request_id: str) -> None: ...
