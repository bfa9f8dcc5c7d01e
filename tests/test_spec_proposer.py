"""The n-gram proposer against a brute force, and --speculative-config parsing (issue 38)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_jax.api import InvalidRequestError
from strata_jax.spec import NgramProposer, SpeculativeConfig, parse_speculative_config


def brute_force(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n from max_n down to min_n whose suffix occurs earlier; its most recent
    earlier occurrence with k tokens after it (else its most recent); the (at most k) tokens
    after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        found = [s for s in range(len(ids) - n - 1, -1, -1) if ids[s : s + n] == suffix]  # most recent first
        if found:
            full = [s for s in found if len(ids[s + n : s + n + k]) == k]
            start = (full or found)[0]
            return ids[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_ngram_proposer_equals_brute_force(ids, k, min_n, extra):
    got = NgramProposer(min_n, min_n + extra).propose(np.array(ids, dtype=np.int64), k)
    assert got.dtype == np.int32
    assert got.tolist() == brute_force(ids, k, min_n, min_n + extra)


def test_a_document_question_copies_the_span_it_is_in():
    doc = list(range(100, 160))
    ids = doc + [7, 8] + doc[20:25]  # the answer has started copying the document at 120
    assert NgramProposer(2, 4).propose(np.array(ids), 5).tolist() == doc[25:30]
    assert NgramProposer(2, 4).propose(np.array(ids), 100).tolist() == doc[25:] + [7, 8] + doc[20:25]


def test_a_run_of_one_token_proposes_k_not_one():
    ids = [5, 1, 1, 1, 1, 1, 1]  # the latest "1 1" is right before the suffix: one token after it
    assert NgramProposer(2, 2).propose(np.array(ids), 3).tolist() == [1, 1, 1]
    assert NgramProposer(2, 2).propose(np.array(ids), 9).tolist() == [1]  # none has 9: the latest


def test_longer_matches_win_over_more_recent_short_ones():
    ids = [1, 2, 3, 9, 5, 3, 8, 1, 2, 3]  # "3" alone recurs at 5 (-> 8), "1 2 3" at 0 (-> 9)
    assert NgramProposer(1, 3).propose(np.array(ids), 2).tolist() == [9, 5]
    assert NgramProposer(1, 1).propose(np.array(ids), 2).tolist() == [8, 1]


def test_bad_proposer_arguments():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="one sequence"):
        NgramProposer(1, 2).propose(np.zeros((2, 3)), 2)


def test_config_takes_vllms_fields_and_defaults():
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(4, 5, 5)
    assert parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_max": 4}) == SpeculativeConfig(3, 4, 4)
    assert parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_min": 2}) == SpeculativeConfig(3, 2, 2)
    both = {"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert parse_speculative_config(both) == SpeculativeConfig(5, 2, 4)
    draft = parse_speculative_config('{"model": "tiny", "num_speculative_tokens": 3}')
    assert draft == SpeculativeConfig(3, method="draft_model", model="tiny")
    explicit = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "draft_kv_tokens": 512}
    want = SpeculativeConfig(2, method="draft_model", model="d", draft_kv_tokens=512)
    assert parse_speculative_config(explicit) == want


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"prompt_lookup_max": 3}', "num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 0}', "at least 1"),
        ('{"num_speculative_tokens": 17}', "at most 16"),
        ('{"num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
        ('{"num_speculative_tokens": 2, "lookahead": 3}', "unknown field"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "not implemented"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model path"),
        ('{"model": "tiny", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "does not apply to method 'draft"),
        ('{"num_speculative_tokens": 2, "draft_kv_tokens": 64}', "does not apply to method 'ngram'"),
        ('{"model": "tiny", "num_speculative_tokens": 2, "draft_kv_tokens": 0}', "draft_kv_tokens must be"),
    ],
)
def test_config_errors_name_the_problem(text, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_speculative_config(text)
