"""The engine with the Pallas kernels (not the references) in the loop.

On the CPU the kernels run in interpret mode (``EngineConfig(kernel_backend="interpret")``):
the model's attention, the L2->L1 page scatter and the L1->L2 backup gather all go
through the Pallas code the GPU compiles.  The greedy tokens must equal the
reference-kernel engine's and be identical whether the prefix came from L1, L2, L3
or was recomputed.  ``test_pallas_gpu.py`` runs the same check compiled on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import dispatch
from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def tier_tokens(
    backend: str,
    storage_dir: str,
    *,
    prepare: Callable[[Engine], None] | None = None,
    inspect: Callable[[Engine], None] | None = None,
    **overrides: object,
) -> dict:
    """Generate one prompt cold, then with its prefix from L1, L2 and L3: the tokens and
    cache hits of each, and the names of the Pallas kernels traced meanwhile.
    ``prepare`` / ``inspect`` see the engine before the first request and after the last."""
    traced: set[str] = set()
    real_pallas_call = pl.pallas_call

    def recording_pallas_call(*args, name=None, **kwargs):
        traced.add(name)
        return real_pallas_call(*args, name=name, **kwargs)

    config = {
        "model": "tiny",
        "warmup": False,
        "show_progress": False,
        "tiers": "L1+L2+L3",
        "page_size": 16,
        "device_tokens": 2048,
        "max_batch_tokens": 64,
        "max_batch_size": 4,
        "max_context_tokens": 512,
        "prefetch_policy": "wait_complete",
        "prefetch_min_tokens": 0,
        "storage_dir": storage_dir,
        "kernel_backend": backend,
        **overrides,
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(dispatch.ENV_VAR, raising=False)
        patch.setattr(pl, "pallas_call", recording_pallas_call)
        engine = Engine(EngineConfig(**config))
        try:
            if prepare is not None:
                prepare(engine)
            rng = np.random.default_rng(11)
            doc = rng.integers(0, 256, size=150).tolist()
            prompts = [doc + [1, 2, 3], rng.integers(0, 256, size=37).tolist()]  # a prefix hit beside a cold request
            out = {"cold": engine.generate(prompts, GREEDY)}
            out["L1"] = engine.generate(prompts, GREEDY)
            engine.flush_cache("device")
            out["L2"] = engine.generate(prompts, GREEDY)
            engine.flush_cache("device")
            engine.flush_cache("host")
            out["L3"] = engine.generate(prompts, GREEDY)
            acc = engine.check_accounting()
            assert acc["locked_nodes"] == 0 and acc["live_requests"] == 0
            if inspect is not None:
                inspect(engine)
        finally:
            engine.shutdown()
    result = {tier: ([o.token_ids for o in outs], outs[0].cached_tokens) for tier, outs in out.items()}
    return {"tiers": result, "kernels": traced}


KERNELS = {"strata_ragged_paged_attention", "strata_scatter_pages", "strata_gather_pages"}


def assert_tiers_agree(got: dict, want_tokens: list[list[int]] | None = None) -> None:
    assert got["L1"][1]["device"] == 144 and got["L2"][1]["host"] == 144 and got["L3"][1]["storage"] == 144
    tokens = {tier: toks for tier, (toks, _) in got.items()}
    reference = want_tokens if want_tokens is not None else tokens["cold"]
    for tier, toks in tokens.items():
        assert toks == reference, (tier, toks, reference)


def test_interpreted_and_xla_kernels_give_the_reference_tokens_from_every_tier(tmp_path):
    reference = tier_tokens("reference", str(tmp_path / "ref"))
    assert reference["kernels"] == set()
    assert_tiers_agree(reference["tiers"])
    interpreted = tier_tokens("interpret", str(tmp_path / "interp"))
    assert interpreted["kernels"] == KERNELS  # attention, L2->L1 scatter and L1->L2 gather all ran as Pallas
    assert_tiers_agree(interpreted["tiers"], reference["tiers"]["cold"][0])
    blocked = tier_tokens("xla", str(tmp_path / "xla"))  # the CPU default: block-causal attention
    assert blocked["kernels"] == set()
    assert_tiers_agree(blocked["tiers"], reference["tiers"]["cold"][0])


def test_unknown_kernel_backend_is_a_clear_config_error():
    from strata_jax.api import InvalidRequestError

    with pytest.raises(
        InvalidRequestError, match="kernel_backend must be one of auto, xla, reference, pallas, interpret"
    ):
        EngineConfig(kernel_backend="triton")


def test_warmup_compiles_every_transfer_so_serving_compiles_nothing(tmp_path):
    """After warm-up, cold prefills, L1 hits, L2 loads, L3 prefetches and backups compile
    nothing: the first L2 hit used to compile its scatter while a request waited."""
    engine = Engine(
        EngineConfig(
            model="tiny",
            warmup=True,
            show_progress=False,
            tiers="L1+L2+L3",
            page_size=16,
            device_tokens=2048,
            max_batch_tokens=32,
            max_batch_size=2,
            max_context_tokens=512,
            prefetch_policy="wait_complete",
            prefetch_min_tokens=0,
            storage_dir=str(tmp_path),
            kernel_backend="reference",
        )
    )
    try:
        rng = np.random.default_rng(5)
        for size in (40, 200, 333):  # loads and backups of several chunk buckets
            prompt = rng.integers(0, 256, size=size).tolist()
            engine.generate([prompt], GREEDY)
            engine.flush_cache("device")
            assert engine.generate([prompt], GREEDY)[0].cached_tokens["host"] > 0
            engine.flush_cache("device")
            engine.flush_cache("host")
            assert engine.generate([prompt], GREEDY)[0].cached_tokens["storage"] > 0
        stats = engine.cache_stats()
        assert stats["compiles_after_warmup"] == 0
        assert stats["transfer_compiles_after_warmup"] == 0
        assert engine.transfer_compiles_at_warmup > 0
    finally:
        engine.shutdown()
