"""The real Gemma 3 270M (32K context) on long documents: 8K, 16K and 30K-token prompts.

Greedy tokens equal transformers' (teacher-forced on the engine's tokens: greedy agrees iff
every argmax does) cold and from L1, L2 and L3, with window-aware tiers (``kv_layer_groups``:
the local layers' KV trimmed to their window in L1, L2 and L3).  The reference runs
transformers' Gemma 3 in chunks over its own cache (its sliding layers keep their window), so
a 30K-token reference costs minutes, not the hour a one-shot forward over the full attention
matrix of every layer takes on two cores.

The documents are LooGLE's (``../shared/data/loogle``) when present, concatenated to the
length; else this repository's docs.  Heavy: ~3 min (8K), ~6 min (16K), ~12 min (30K) on 2
cores; ``python -m pytest -q -m heavy tests/test_gemma_long_context.py``.  TTFT per tier and
the engine's peak memory per length are printed (docs/runtime.md has the table).
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
LOOGLE = REPO.parent / "shared" / "data" / "loogle"
NEW_TOKENS = 8
PAGE = 16
CHUNK = 2048  # the engine's prefill chunk and the reference's


def _document_text() -> str:
    if LOOGLE.is_dir():
        texts = [json.loads(line)["input"] for f in sorted(LOOGLE.glob("*.jsonl")) for line in f.open()]
        seen: list[str] = []
        for t in texts:  # the same documents appear in both files
            if t not in seen:
                seen.append(t)
        return "\n\n".join(seen)
    return "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))


@pytest.fixture(scope="module")
def gemma3_gguf() -> str:
    pytest.importorskip("gguf", reason="the real-model tests need the gguf extra: pip install -e '.[gguf]'")
    from real_model import FetchError, gemma3_gguf_path

    try:
        return str(gemma3_gguf_path())
    except FetchError as exc:
        pytest.skip(f"real model unavailable: {exc}")


@pytest.fixture(scope="module")
def long_engine(gemma3_gguf, tmp_path_factory):
    from strata_jax.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=gemma3_gguf,
            warmup=False,
            show_progress=False,
            tiers="L1+L2+L3",
            page_size=PAGE,
            dtype="float32",
            device_tokens=32768,
            hicache_ratio=1.0,
            max_batch_tokens=CHUNK,
            max_batch_size=2,
            max_context_tokens=32768,
            prefetch_policy="wait_complete",
            prefetch_min_tokens=0,
            storage_dir=str(tmp_path_factory.mktemp("kv")),
            kv_layer_groups=True,
            kv_local_ratio=0.25,
        )
    )
    yield engine
    engine.shutdown()


def _reference_logits(hf, ids: list[int], keep: int) -> np.ndarray:
    """transformers' log-probabilities at the last ``keep`` positions of ``ids``, computed in
    chunks over its own cache (what its chunked prefill does)."""
    import transformers

    cache = transformers.DynamicCache(config=hf.config)
    head = len(ids) - keep  # the last ``keep`` tokens go in one final chunk: their logits are the ones kept
    with torch.no_grad():
        for start in range(0, head, CHUNK):
            hf(
                input_ids=torch.tensor([ids[start : min(head, start + CHUNK)]]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        out = hf(input_ids=torch.tensor([ids[head:]]), past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return torch.log_softmax(out.logits[0].float(), dim=-1).numpy()


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("length", [8192, 16384, 30720])
def test_real_gemma3_long_documents_match_transformers_from_every_tier(long_engine, gemma3_gguf, length):
    from hf_reference import hf_gemma3_270m_from_gguf

    from strata_jax.api import SamplingParams

    engine = long_engine
    ids = engine.tokenizer.encode(_document_text())
    assert len(ids) >= length, f"the documents hold {len(ids)} tokens, fewer than {length}"
    ids = ids[:length]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.flush_cache("all")
    runs, ttft = {}, {}
    for tier, flush in (("cold", ()), ("L1", ()), ("L2", ("device",)), ("L3", ("device", "host"))):
        for t in flush:
            engine.flush_cache(t)
        (runs[tier],) = engine.generate([ids], params)
        ttft[tier] = runs[tier].ttft_s
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # before the reference loads
    full = (length - 1) // PAGE * PAGE  # the last token is always computed (a sample needs it)
    assert runs["L1"].cached_tokens["device"] == full
    assert runs["L2"].cached_tokens["host"] == full and runs["L2"].cached_tokens["device"] == 0
    assert runs["L3"].cached_tokens["storage"] == full
    tokens = runs["cold"].token_ids
    assert tokens == runs["L1"].token_ids == runs["L2"].token_ids == runs["L3"].token_ids

    hf = hf_gemma3_270m_from_gguf(gemma3_gguf)
    ref = _reference_logits(hf, ids + tokens, NEW_TOKENS + 1)[:-1]
    assert tokens == ref.argmax(-1).tolist()
    kv_gib = _kv_bytes(engine, length) / 2**30
    print(
        f"\n{length} tokens: TTFT cold {ttft['cold']:.2f} s, L1 {ttft['L1']:.2f} s, L2 {ttft['L2']:.2f} s, "
        f"L3 {ttft['L3']:.2f} s; peak RSS {peak_gib:.2f} GiB; the prompt's KV {kv_gib:.3f} GiB "
        f"(float32, global layers whole + local layers' window)"
    )


def _kv_bytes(engine, tokens: int) -> int:
    """The model's KV arithmetic for one ``tokens``-long sequence held window-aware: every
    global layer's KV for every token, each local layer's for its window (plus a page)."""
    c = engine.model_config
    per_layer_token = 2 * c.num_kv_heads * c.head_dim * 4
    return sum(per_layer_token * (tokens if w <= 0 else min(tokens, w + PAGE)) for w in c.layer_windows)
