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

from strata_jax.api import SamplingParams
from strata_jax.cache.handles import TransferHandle
from strata_jax.executor import SeqWork, StepOutput
from strata_jax.runtime.logits_processors import initial_bias, initial_flags
from strata_jax.runtime.model_runner import ModelRunner, PendingStep, SeqInput, StepResult
from strata_jax.runtime.sampling import request_rng_key
from strata_jax.runtime.sampling_state import NoFreeSlotError
from strata_jax.runtime.sampling_step import to_token_logprob


class JaxExecutor:
    def __init__(self, runner: ModelRunner, *, eos_token_ids: Sequence[int] = ()) -> None:
        self.runner = runner
        self.eos_token_ids = tuple(eos_token_ids)
        self._slots: dict[str, int] = {}  # request id -> sampling-state slot

    # ---- per-request device state (penalties, logit_bias, min_tokens) ----------------
    def open_sampling_state(
        self, request_id: str, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams
    ) -> bool:
        """Take a slot and write its rows once; False when every slot is held."""
        state = self.runner.sampling
        try:
            slot = state.acquire()
        except NoFreeSlotError:
            return False
        suppressed = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        flags = initial_flags(state.vocab_size, prompt_ids, suppressed if params.min_tokens else (), output_ids)
        state.seed(slot, flags, initial_bias(state.vocab_size, params.logit_bias))
        self._slots[request_id] = slot
        return True

    def close_sampling_state(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.runner.sampling.release(slot)

    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str) -> jax.profiler.TraceAnnotation:
        return jax.profiler.TraceAnnotation(name)

    def idle(self) -> None:
        time.sleep(0.001)  # everything waits on a transfer or a deferral: don't spin

    def extend(self, seqs: list[SeqWork], loads: Sequence[TransferHandle] = ()) -> StepOutput:
        start = time.perf_counter()
        out = StepOutput({}, 0.0)
        self._run_packed(seqs, out)
        return StepOutput(out.tokens, time.perf_counter() - start, out.logprobs, out.prompt_logprobs)

    def _run_packed(self, work: list[SeqWork], out: StepOutput) -> None:
        """Run extend work in as few runner steps as the runner's token/batch limits allow."""
        limit_tokens = self.runner.config.max_batch_tokens
        limit_seqs = self.runner.config.max_batch_size
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
                last_piece = len(piece) == len(tokens)
                batch.append((w, self._seq_input(w, piece, start, last_piece)))
                room -= len(piece)
                if not last_piece:
                    rest.append((w, tokens[len(piece) :], start + len(piece)))
            seqs = [s for _, s in batch]
            self._collect(batch, self.runner.step(seqs), out)
            pending = rest

    def dispatch_decode(self, seqs: list[SeqWork]) -> tuple[list[SeqWork], PendingStep, float]:
        start = time.perf_counter()
        inputs = [self._seq_input(w, list(w.token_ids), w.start_pos, True) for w in seqs]
        return seqs, self.runner.dispatch(inputs), start

    def finish_decode(self, pending: tuple[list[SeqWork], PendingStep, float]) -> StepOutput:
        seqs, step, start = pending
        out = StepOutput({}, 0.0)
        self._collect([(w, None) for w in seqs], step.result(), out)
        return StepOutput(out.tokens, time.perf_counter() - start, out.logprobs, out.prompt_logprobs)

    def _collect(self, batch: list[tuple[SeqWork, SeqInput | None]], result: StepResult, out: StepOutput) -> None:
        """Tokens, and the logprobs the batch asked for, into ``out`` (by request id)."""
        offset = 0
        for i, ((w, seq), token) in enumerate(zip(batch, result.next_tokens)):
            rid = w.request_id
            out.tokens[rid] = int(token)
            p = w.params
            if p.logprobs is not None and result.sample_logprobs is not None:
                out.logprobs[rid] = to_token_logprob(result.sample_logprobs, i, int(token), p.logprobs)
            n = len(seq.token_ids) if seq is not None else len(w.token_ids)
            if seq is not None and seq.prompt_logprob_targets is not None and result.prompt_logprobs is not None:
                got = out.prompt_logprobs.setdefault(rid, [])
                for j, target in enumerate(seq.prompt_logprob_targets):
                    if target >= 0:
                        got.append(to_token_logprob(result.prompt_logprobs, offset + j, target, p.prompt_logprobs or 0))
            offset += n

    def _seq_input(self, w: SeqWork, tokens: list[int], start: int, last_piece: bool) -> SeqInput:
        p = w.params
        targets = None
        if w.prompt_logprob_targets is not None:
            first = start - w.start_pos
            targets = list(w.prompt_logprob_targets[first : first + len(tokens)])
        return SeqInput(
            token_ids=tokens,
            start_pos=start,
            page_ids=list(w.page_ids),
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            rng_key=request_rng_key(p.seed, w.request_id, w.sample_index),
            sampling_slot=self._slots.get(w.request_id),
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            min_tokens_active=w.sample_index < p.min_tokens,
            count_sample=w.keep_sample and last_piece,
            logprobs=p.logprobs is not None and w.keep_sample and last_piece,
            prompt_logprob_targets=targets,
        )
