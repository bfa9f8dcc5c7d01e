"""A fresh engine over an L3 another engine filled takes the whole stored prefix with the
default settings (``prefetch_policy="cost"``): the scheduler holds the request while the
rest of its prefetch is estimated to land sooner than recomputing it."""

from __future__ import annotations

import numpy as np

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig

GREEDY = SamplingParams(max_tokens=8)


def _engine(**storage) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            device_tokens=4096,
            max_batch_tokens=512,
            max_context_tokens=2048,
            **storage,
        )
    )


def check_fresh_engine_takes_the_whole_stored_prefix(**storage) -> None:
    prompt = np.random.default_rng(11).integers(3, 250, size=1500).tolist()
    first = _engine(**storage)
    try:
        assert first.config.prefetch_policy == "cost"  # the default
        cold = first.generate([prompt], GREEDY)[0]
    finally:
        first.shutdown()  # drains its L3 writes
    second = _engine(**storage)
    try:
        warm = second.generate([prompt], GREEDY)[0]
        stats = second.cache_stats()
    finally:
        second.shutdown()
    assert cold.cached_tokens == {"device": 0, "host": 0, "storage": 0}
    assert warm.cached_tokens["storage"] == 1488  # all 93 full pages the first engine wrote
    assert warm.token_ids == cold.token_ids
    assert stats["recomputed_tokens"] == 1500 - 1488
    assert stats["prefetch"]["not_waited"] == 0


def test_best_effort_takes_what_landed_and_cost_counts_its_choice(tmp_path):
    """The same setup under best_effort starts at once with what landed (the first chunk
    of reads here), so the two policies really differ on this prompt."""
    prompt = np.random.default_rng(11).integers(3, 250, size=1500).tolist()
    storage = dict(storage_backend="file", storage_dir=str(tmp_path / "l3"))
    first = _engine(**storage)
    first.generate([prompt], GREEDY)
    first.shutdown()
    second = Engine(
        EngineConfig(
            model="tiny",
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            device_tokens=4096,
            max_batch_tokens=512,
            max_context_tokens=2048,
            prefetch_policy="best_effort",
            **storage,
        )
    )
    try:
        warm = second.generate([prompt], GREEDY)[0]
        stats = second.cache_stats()
    finally:
        second.shutdown()
    assert warm.cached_tokens["storage"] < 1488
    assert stats["prefetch"] == {"waits": 0, "wait_rounds": 0, "not_waited": 0}  # best_effort never asks


def test_file_l3(tmp_path):
    check_fresh_engine_takes_the_whole_stored_prefix(storage_backend="file", storage_dir=str(tmp_path / "l3"))
