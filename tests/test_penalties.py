"""Penalties, logit bias and min_tokens on device against plain re-implementations of
the published formulas (OpenAI's frequency/presence definition, HF transformers'
``RepetitionPenaltyLogitsProcessor`` itself)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from strata_jax.runtime import logits_processors as lp
from strata_jax.runtime.sampling_state import SamplingState, gather_rows

V = 64


def _openai_reference(logits: np.ndarray, generated: list[int], frequency: float, presence: float) -> np.ndarray:
    """mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence (OpenAI API docs)."""
    out = logits.astype(np.float64).copy()
    for j in range(len(out)):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - float(c > 0) * presence
    return out


def _flags(prompt: list[int], generated: list[int], suppressed: list[int] = ()) -> np.ndarray:
    return lp.initial_flags(V, prompt, suppressed, generated)


def test_frequency_presence_match_openai_formula():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 3
    prompts = [[1, 2, 3], [5], [7, 7, 8]]
    generated = [[4, 4, 4, 9], [5, 5], []]
    params = [(0.5, 0.25), (-1.5, 2.0), (2.0, -2.0)]
    flags = np.stack([_flags(p, g) for p, g in zip(prompts, generated)])
    out = lp.apply_frequency_presence(
        jnp.asarray(logits),
        jnp.asarray(flags),
        jnp.asarray([f for f, _ in params]),
        jnp.asarray([p for _, p in params]),
    )
    for b in range(3):
        ref = _openai_reference(logits[b], generated[b], *params[b])
        np.testing.assert_allclose(np.asarray(out[b]), ref, rtol=1e-6, atol=1e-5)
    # prompt tokens alone are not penalised (OpenAI's c[j] counts sampled tokens)
    np.testing.assert_array_equal(np.asarray(out[2]), logits[2])


def test_repetition_penalty_matches_hf_processor_over_prompt_and_output():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, V)).astype(np.float32) * 4
    histories = [([3, 10, 11], [12, 3, 40]), ([0, 63], [])]
    penalties = [1.3, 0.7]
    flags = np.stack([_flags(p, g) for p, g in histories])
    out = np.asarray(
        lp.apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(flags), jnp.asarray(penalties, jnp.float32))
    )
    for b, (prompt, gen) in enumerate(histories):
        hf = RepetitionPenaltyLogitsProcessor(penalty=penalties[b])
        ref = hf(torch.tensor([prompt + gen]), torch.tensor(logits[b : b + 1]))[0].numpy()
        np.testing.assert_allclose(out[b], ref, rtol=1e-6)


def test_bias_and_min_tokens_masking():
    logits = np.zeros((2, V), np.float32)
    bias = np.stack([lp.initial_bias(V, {5: 100.0, 6: -100.0}), lp.initial_bias(V, {})])
    flags = np.stack([_flags([], [], [0, 1]), _flags([], [], [0, 1])])
    active = jnp.asarray([True, False])
    out = np.asarray(
        lp.process_logits(
            jnp.asarray(logits), jnp.asarray(flags), jnp.asarray(bias), jnp.ones(2), jnp.zeros(2), jnp.zeros(2), active
        )
    )
    assert out[0, 5] == 100.0 and out[0, 6] == -100.0
    assert np.isneginf(out[0, [0, 1]]).all() and np.isfinite(out[0, 2:]).all()
    np.testing.assert_array_equal(out[1], logits[1])  # inactive min_tokens, no bias: untouched


def test_neutral_params_leave_rows_bit_identical():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((4, V)).astype(np.float32))
    flags = jnp.asarray(np.stack([_flags([1, 2], [3, 3, 4], [9]) for _ in range(4)]))
    out = lp.process_logits(
        logits, flags, jnp.zeros((4, V)), jnp.ones(4), jnp.zeros(4), jnp.zeros(4), jnp.zeros(4, bool)
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


def _numpy_penalised_greedy(table, prompt, steps, rep, freq, pres, bias, min_tokens, eos):
    """A plain loop: 'model' logits = table[last token]; formulas applied per step."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(steps):
        x = table[seq[-1]].astype(np.float64).copy()
        for t, v in bias.items():
            x[t] += v
        if len(out) < min_tokens:
            x[eos] = -np.inf
        for j in set(prompt) | set(out):
            x[j] = x[j] / rep if x[j] > 0 else x[j] * rep
        x = _openai_reference(x, out, freq, pres)
        tok = int(np.argmax(x))
        out.append(tok)
        seq.append(tok)
    return out


def test_device_state_penalised_greedy_loop_matches_reference():
    """The slot tables as a real step uses them: seed once, then read rows, process,
    argmax and count the sampled token in-jit, for two sequences in two slots (plus a
    row without state) over 12 steps."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((V, V)).astype(np.float32)
    eos = 0
    table[:, eos] += 2.0  # EOS would win often without min_tokens
    cases = [
        dict(prompt=[5, 6, 7], rep=1.4, freq=0.3, pres=0.6, bias={11: 1.5, 12: -100.0}, min_tokens=6),
        dict(prompt=[9, 9, 1], rep=1.0, freq=1.2, pres=0.0, bias={}, min_tokens=0),
    ]
    state = SamplingState(num_slots=4, vocab_size=V)
    slots = []
    for c in cases:
        slot = state.acquire()
        state.seed(slot, lp.initial_flags(V, c["prompt"], [eos]), lp.initial_bias(V, c["bias"]))
        slots.append(slot)
    slot_ids = jnp.asarray(slots + [state.no_slot], jnp.int32)
    rep = jnp.asarray([c["rep"] for c in cases] + [1.0], jnp.float32)
    freq = jnp.asarray([c["freq"] for c in cases] + [0.0], jnp.float32)
    pres = jnp.asarray([c["pres"] for c in cases] + [0.0], jnp.float32)

    @jax.jit
    def step(flags_table, bias_table, last, n_generated, min_tokens):
        logits = jnp.asarray(table)[last]
        flags = gather_rows(flags_table, slot_ids)
        bias = gather_rows(bias_table, slot_ids)
        x = lp.process_logits(logits, flags, bias, rep, freq, pres, n_generated < min_tokens)
        tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
        return tok, lp.record_sampled(flags_table, slot_ids, tok, jnp.ones(3, bool))

    last = jnp.asarray([c["prompt"][-1] for c in cases] + [5], jnp.int32)
    min_tokens = jnp.asarray([c["min_tokens"] for c in cases] + [0], jnp.int32)
    got: list[list[int]] = [[], [], []]
    flags_table = state.flags
    for i in range(12):
        last, flags_table = step(flags_table, state.bias, last, jnp.full(3, i, jnp.int32), min_tokens)
        for b in range(3):
            got[b].append(int(last[b]))
    for b, c in enumerate(cases):
        ref = _numpy_penalised_greedy(
            table, c["prompt"], 12, c["rep"], c["freq"], c["pres"], c["bias"], c["min_tokens"], eos
        )
        assert got[b] == ref
    plain = _numpy_penalised_greedy(table, [5], 12, 1.0, 0.0, 0.0, {}, 0, eos)
    assert got[2] == plain  # the stateless row is plain greedy
    assert got[0] != _numpy_penalised_greedy(table, cases[0]["prompt"], 12, 1.0, 0.0, 0.0, {}, 0, eos)
    # the stateless row's samples were dropped, not written anywhere
    counts = np.asarray(flags_table) & lp.COUNT_MASK
    assert counts[slots[0]].sum() == 12 and counts[slots[1]].sum() == 12 and counts[2:].sum() == 0


def test_slots_are_exclusive():
    state = SamplingState(num_slots=2, vocab_size=8)
    a, b = state.acquire(), state.acquire()
    assert a != b and state.free_slots == 0
    try:
        state.acquire()
        raise AssertionError("a third slot was handed out")
    except Exception as exc:
        assert "slots are in use" in str(exc)
    state.release(a)
    assert state.acquire() == a
