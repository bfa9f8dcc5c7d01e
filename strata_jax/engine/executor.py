"""The executor seam (docs/design.md §2): what the engine's step loop asks of the machine.

The step loop (``strata_jax.engine.core.EngineCore``) decides nothing about time or
devices; it hands an ``Executor`` the sequences to run and gets sampled tokens and
the measured seconds back.  Two implementations:

* ``strata_jax.runtime.jax_executor.JaxExecutor``: the real model on real devices
  (``ModelRunner`` steps; wall-clock time).
* ``strata_jax.sim.executor.SimExecutor``: a cost model of a target machine on a
  virtual clock.

The scheduler, the HiRadixTree and the cache controller are the same objects in
both.  Contract:

* ``now()`` is the clock every timestamp of the engine and the controller uses.
* ``dispatch_extend(work, loads)`` starts an extend step of prefill chunks and
  returns at once; ``dispatch_decode(rows)`` starts a decode step (each row's input
  is its last sampled token, which may not have reached the host yet: it is read
  where it was sampled).  ``collect(pending)`` waits for a dispatched step and
  returns its sampled tokens (in row order) and the seconds the device spent on it
  (None when that cannot be told, e.g. the step finished long before it was
  collected).  The engine dispatches step N+1 before it collects step N.  The loads
  of an extend need no waiting here: the extend reads what they wrote (data flow).
* ``open_sequence(request_id)`` gives a request starting to run (its first prefill chunk)
  a row of per-sequence state, written whole with its page table before its next step;
  ``close_sequence(request_id)`` takes it back (a no-op for a request without one).
  The executor keeps its rows by request id (which slot, how much of the page table
  the row holds); ``page_table_changed(request_id, index)`` tells it that entries from
  ``index`` on were replaced (a duplicate page swapped for the tree's) and must be sent
  again.
* ``begin_step(decode_rows, prefill_rows, prefill_tokens)``: the engine is about to
  dispatch a step of that size (the simulator charges its measured model of the
  engine's host path for it; a real executor ignores it).
* ``idle()``: nothing could run this step (everything waits on a transfer or a
  deferral); sleep a little, or advance virtual time to the next event.
* ``span(name)``: a profiler span around a phase of the step.
* ``open_sampling_state(rid, prompt_ids, output_ids, params)`` gives a request that
  asked for penalties/logit_bias/min_tokens its per-sequence state (False when none
  is free: the engine parks the request until ``close_sampling_state`` of another);
  an executor without device state accepts and ignores it.
* ``rewind_row(request_id, last_token)``: a ``verify`` chunk wrote KV and a length past
  what was accepted; the row's next step reads ``computed`` positions and decodes from
  ``last_token`` (the executor rewrites the row before it).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from strata_jax.api import SamplingParams, TokenLogprob
    from strata_jax.cache.handles import TransferHandle


class SeqRow(Protocol):
    """What an executor reads of a running request (``engine.requests.TrackedRequest``)."""

    @property
    def request_id(self) -> str: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def computed(self) -> int: ...  # positions whose KV precedes this step's tokens

    @property
    def generated(self) -> int: ...  # samples dispatched before this step's

    @property
    def page_table(self) -> list[int]: ...

    @property
    def grammar(self) -> Any: ...  # a structured output's matcher (its ``mask``), or None

    @property
    def adapter_slot(self) -> int: ...  # its LoRA adapter's device slot, -1 for the base model


RowRef = TypeVar("RowRef")


@dataclass(frozen=True)
class ExtendChunk(Generic[RowRef]):
    """One request's prefill chunk: ``token_ids`` at positions ``start ..`` of ``row``.

    ``row``: the sequence, as the layer addresses it: the engine's ``SeqRow`` (what it
    hands the executor), the runner's slot index (what the executor packs).
    ``keep_sample``: the token sampled at the last position is kept (False for a
    chunk that is not the prompt's last: the penalty counts skip it).
    ``prompt_logprob_targets``: per new token, the prompt token after it whose
    logprob is wanted (-1: none); None when the request did not ask.
    ``verify``: a speculative row's check (its last token and the proposed ones): the
    target's token after every position comes back (``StepOutput.picks``), not one sample,
    each picked as decoding would have picked it (greedy, or drawn with the row's
    processors and its PRNG key for that token's number); never split across steps.
    ``device_token``: a decoding row's step in a prompt chunk's program (a mixed step):
    one token, the row's last sample at its KV length, both as the device holds them
    (``token_ids`` and ``start`` are placeholders: the host may not have read that sample).
    """

    row: RowRef
    token_ids: Sequence[int]
    start: int
    keep_sample: bool = True
    prompt_logprob_targets: Sequence[int] | None = None
    verify: bool = False
    device_token: bool = False


@dataclass
class StepOutput:
    """Sampled tokens in row order (extend: one per work item), the device seconds of
    the step (None if unknown), the sampled tokens' logprobs by row index for rows
    that asked, prompt logprobs by row index (one per new token) for rows that asked,
    and for ``verify`` chunks by row index the target's token after each of their tokens
    (with its logprob and top alternatives for rows that asked for logprobs)."""

    tokens: list[int]
    seconds: float | None
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    picks: dict[int, list[int]] = field(default_factory=dict)
    pick_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # verify rows that asked


class Executor(Protocol):
    def now(self) -> float: ...

    def dispatch_extend(self, work: list[ExtendChunk[SeqRow]], loads: Sequence[TransferHandle]) -> Any: ...

    def dispatch_decode(self, rows: Sequence[SeqRow]) -> Any: ...

    def collect(self, pending: Any) -> StepOutput: ...

    def open_sequence(self, request_id: str) -> None: ...

    def close_sequence(self, request_id: str) -> None: ...

    def page_table_changed(self, request_id: str, index: int) -> None: ...

    def rewind_row(self, request_id: str, last_token: int) -> None: ...

    def begin_step(self, decode_rows: int, prefill_rows: int, prefill_tokens: int) -> None: ...

    def idle(self) -> None: ...

    def span(self, name: str) -> AbstractContextManager[Any]: ...

    def open_sampling_state(
        self, request_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams
    ) -> bool: ...

    def close_sampling_state(self, request_id: str) -> None: ...
