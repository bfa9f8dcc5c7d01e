"""``JaxExecutor``: the ``strata_jax.executor.Executor`` of the real model on real devices.

Runs extend work through ``ModelRunner.step`` in as few runner steps as the
runner's token/batch limits allow (one scheduler batch may exceed them), decodes
through ``ModelRunner.dispatch`` (JAX async dispatch: the engine issues loads while
the device decodes), times everything on the wall clock, and names profiler spans.
The L2->L1 loads a batch depends on need no waiting here: the extend program reads
the pool the loads wrote, so JAX's data flow orders it after them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax

from strata_jax.cache.handles import TransferHandle
from strata_jax.executor import SeqWork, StepOutput
from strata_jax.runtime.model_runner import ModelRunner, PendingStep, SeqInput
from strata_jax.runtime.sampling import request_rng_key


class JaxExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str) -> jax.profiler.TraceAnnotation:
        return jax.profiler.TraceAnnotation(name)

    def idle(self) -> None:
        time.sleep(0.001)  # everything waits on a transfer or a deferral: don't spin

    def extend(self, seqs: list[SeqWork], loads: Sequence[TransferHandle] = ()) -> StepOutput:
        start = time.perf_counter()
        sampled = self._run_packed(seqs)
        return StepOutput(sampled, time.perf_counter() - start)

    def _run_packed(self, work: list[SeqWork]) -> dict[str, int]:
        """Run extend work in as few runner steps as the runner's token/batch limits allow."""
        limit_tokens = self.runner.config.max_batch_tokens
        limit_seqs = self.runner.config.max_batch_size
        sampled: dict[str, int] = {}
        pending = [(w, list(w.token_ids), w.start_pos) for w in work]
        while pending:
            batch: list[tuple[SeqWork, SeqInput]] = []
            room = limit_tokens
            rest = []
            for w, tokens, start in pending:
                if room <= 0 or len(batch) >= limit_seqs:
                    rest.append((w, tokens, start))
                    continue
                piece = tokens[:room]
                batch.append((w, _seq_input(w, piece, start)))
                room -= len(piece)
                if len(piece) < len(tokens):
                    rest.append((w, tokens[len(piece) :], start + len(piece)))
            result = self.runner.step([s for _, s in batch])
            for (w, _), token in zip(batch, result.next_tokens):
                sampled[w.request_id] = int(token)
            pending = rest
        return sampled

    def dispatch_decode(self, seqs: list[SeqWork]) -> tuple[list[SeqWork], PendingStep, float]:
        start = time.perf_counter()
        return seqs, self.runner.dispatch([_seq_input(w, list(w.token_ids), w.start_pos) for w in seqs]), start

    def finish_decode(self, pending: tuple[list[SeqWork], PendingStep, float]) -> StepOutput:
        seqs, step, start = pending
        tokens = [int(x) for x in step.result().next_tokens]
        return StepOutput({w.request_id: tok for w, tok in zip(seqs, tokens)}, time.perf_counter() - start)


def _seq_input(w: SeqWork, tokens: list[int], start: int) -> SeqInput:
    p = w.params
    return SeqInput(
        token_ids=tokens,
        start_pos=start,
        page_ids=list(w.page_ids),
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        rng_key=request_rng_key(p.seed, w.request_id, w.sample_index),
    )
