"""Structured outputs: the device mask against a plain reference, constraint validation, and
the engine's outputs obeying every kind of constraint, pipelined or not (tiny model; the
real model through the OpenAI client is in test_structured_real.py)."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.runtime.sampling_step import apply_token_mask
from strata_jax.structured import StructuredOutput


def test_device_mask_matches_a_bit_by_bit_reference():
    rng = np.random.default_rng(0)
    vocab, rows = 77, 5  # not a multiple of 32: the last word is partial
    words = rng.integers(-(2**31), 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    constrained = np.array([True, False, True, True, False])
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(words), jnp.asarray(constrained)))
    for r in range(rows):
        for i in range(vocab):
            allowed = (int(words[r, i // 32]) >> (i % 32)) & 1
            want = logits[r, i] if (allowed or not constrained[r]) else -np.inf
            assert got[r, i] == want, (r, i)


@pytest.mark.parametrize(
    "spec, message",
    [
        (lambda: StructuredOutput("regex", "(["), "regex"),
        (lambda: StructuredOutput.json_schema({"type": "objectt"}), "objectt"),
        (lambda: StructuredOutput.json_schema("{not json"), "not valid JSON"),
        (lambda: StructuredOutput.json_schema({"type": "string", "format": "no-such-format"}), "no-such-format"),
        (lambda: StructuredOutput("choice", ()), "non-empty list"),
        (lambda: StructuredOutput("xml", "x"), "unknown constraint"),
        (lambda: StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_bad_constraints_are_clear_errors(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        spec().grammar()


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engines():
    from strata_jax.engine import Engine, EngineConfig

    made = {}
    for pipeline in (False, True):
        made[pipeline] = Engine(
            EngineConfig(
                model="tiny",
                warmup=False,
                show_progress=False,
                max_batch_size=8,
                device_tokens=8192,
                max_context_tokens=512,
                pipeline=pipeline,
            )
        )
    yield made
    for e in made.values():
        e.shutdown()


def test_every_kind_of_constraint_holds_and_both_loops_agree(engines):
    cases = [
        (StructuredOutput.json_schema(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        (
            StructuredOutput("regex", r"[0-9]{2,4}-[a-f]{1,6}"),
            lambda t: re.fullmatch(r"[0-9]{2,4}-[a-f]{1,6}", t) or pytest.fail(t),
        ),
        (
            StructuredOutput("choice", ("north", "south", "east")),
            lambda t: t in ("north", "south", "east") or pytest.fail(t),
        ),
        (
            StructuredOutput("grammar", 'start: "(" num ("," num)? ("," num)? ")"\nnum: /[0-9]/'),
            lambda t: re.fullmatch(r"\([0-9](,[0-9]){0,2}\)", t) or pytest.fail(t),
        ),
    ]
    # (a random model would fill an unbounded repetition until max_tokens: the constraints are bounded)
    prompts = [f"question {i}: " for i in range(len(cases))]
    sampled = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=spec) for i, (spec, _) in enumerate(cases)
    ]
    greedy = [SamplingParams(max_tokens=200, structured=spec) for spec, _ in cases]
    results = {}
    for pipeline, engine in engines.items():
        outs = engine.generate(prompts + prompts, greedy + sampled)  # constrained rows beside each other, batched
        results[pipeline] = [(o.token_ids, o.text, o.finish_reason) for o in outs]
        for (spec, check), out in zip(cases + cases, outs):
            assert out.finish_reason == "stop", (spec.kind, out.text)  # the grammar ended it, not max_tokens
            check(out.text)
        assert engine.check_accounting()["live_requests"] == 0
    assert results[True] == results[False]


def test_constrained_and_free_requests_share_batches(engines):
    engine = engines[True]
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = engine.generate(["free text"], free)[0].token_ids
    outs = engine.generate(
        ["free text", "digits: ", "free text"],
        [free, SamplingParams(max_tokens=30, structured=StructuredOutput("regex", "[0-9]{5}")), free],
    )
    assert outs[0].token_ids == outs[2].token_ids == alone  # a neighbour's mask never touches a free row
    assert re.fullmatch("[0-9]{5}", outs[1].text)


def test_n_choices_and_an_abort_keep_their_own_grammar(engines):
    engine = engines[True]
    spec = StructuredOutput("regex", "(yes|no|maybe) [a-z]{3}")
    outs = engine.generate_choices(
        "answer: ", SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=spec), 3
    )
    assert all(re.fullmatch("(yes|no|maybe) [a-z]{3}", o.text) for o in outs), [o.text for o in outs]
    rid = engine.submit("long: ", SamplingParams(max_tokens=300, structured=StructuredOutput("regex", "[a-z]{200}")))
    assert engine.abort(rid).result(timeout=60) is True  # queued behind its admission: it was live
    acc = engine.check_accounting()
    assert acc["live_requests"] == 0 and acc["device_request_pages"] == 0


def test_json_closes_within_its_budget(engines):
    """A random model writes one string forever; near the end of max_tokens a JSON constraint
    lets it use only tokens that close its strings, arrays and objects: the output parses."""
    from strata_jax.structured.matcher import CLOSING_WINDOW, json_scan

    engine = engines[True]
    schema = {
        "type": "object",
        "properties": {
            "notes": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}}
        },
    }
    loop = {ord("a"): 100.0, ord('"'): 50.0}  # opens a string, then writes "aaa..." for ever: never closes by itself
    for spec in (StructuredOutput("json_object"), StructuredOutput.json_schema(schema)):
        for max_tokens in (CLOSING_WINDOW + 5, 3 * CLOSING_WINDOW):
            params = [
                SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, logit_bias=loop, structured=spec)
                for i in range(4)
            ]
            outs = engine.generate([f"w{i}: " for i in range(4)], params)
            for out in outs:
                assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens, (out.finish_reason, out.text)
                value = json.loads(out.text)
                assert json_scan((False, False, 0), out.text) == (False, False, 0)
                if spec.kind == "json":
                    jsonschema.validate(value, schema)


def test_a_constrained_batch_decodes_together_in_the_pipeline(engines):
    """Constrained rows whose prefills end in different steps must not fall into two
    halves decoding in turn (each held row joining only the step after next): the step
    holding a row's token is read before the next is planned, so every decode step
    carries every running row."""
    engine = engines[True]
    spec = StructuredOutput("regex", "[a-z]{24}")
    prompts = [f"{'long prompt ' * (1 + 6 * i)}: " for i in range(4)]  # prefills of different lengths
    engine.core.plan_log = []
    try:
        outs = engine.generate(prompts, [SamplingParams(max_tokens=40, structured=spec) for _ in prompts])
        plans = engine.core.plan_log
    finally:
        engine.core.plan_log = None
    assert all(re.fullmatch("[a-z]{24}", o.text) for o in outs)
    sizes = [len(p.decode) for p in plans]
    first_full = sizes.index(len(prompts))
    after = sizes[first_full:]  # from the first full step on, rows only leave (they finish)
    assert after.count(len(prompts)) >= 20 and after == sorted(after, reverse=True), str(sizes)
