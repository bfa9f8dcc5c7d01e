"""Decode tokens/s on the real SmolLM2: layers under scan (the default) vs unrolled over
per-layer weight arrays (``scan_layers=False``), two engines side by side, alternating
rounds; batch 1 and 16, 300-token prompts already in L1, 64 decode tokens.

    python scripts/bench_layer_weights.py
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_model import smollm2_gguf_path

from strata_jax.api import SamplingParams
from strata_jax.engine import Engine, EngineConfig

model = str(smollm2_gguf_path())
engines = {}
for scan in (True, False):
    t = time.perf_counter()
    engines[scan] = Engine(
        EngineConfig(
            model=model,
            show_progress=False,
            scan_layers=scan,
            max_batch_size=16,
            max_batch_tokens=256,
            max_context_tokens=2048,
        )
    )
    print("start", "scan" if scan else "split", f"{time.perf_counter() - t:.1f}s", flush=True)
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 40000, size=300).tolist() for _ in range(16)]
rates = {s: {1: [], 16: []} for s in engines}
toks = {}
for _ in range(3):
    for scan, e in engines.items():
        for b in (1, 16):
            e.flush_cache("all")
            e.generate(prompts[:b], SamplingParams(max_tokens=1, ignore_eos=True))  # prefill, cached in L1
            t = time.perf_counter()
            o = e.generate(prompts[:b], SamplingParams(max_tokens=65, ignore_eos=True))
            dt = time.perf_counter() - t
            t = time.perf_counter()
            e.generate(prompts[:b], SamplingParams(max_tokens=1, ignore_eos=True))
            d1 = time.perf_counter() - t
            rates[scan][b].append(64 * b / (dt - d1))
            toks[(scan, b)] = [x.token_ids for x in o]
for scan in engines:
    print(
        "scan " if scan else "split",
        {b: f"{np.median(v):.1f} tok/s" for b, v in rates[scan].items()},
        {b: [round(x, 1) for x in v] for b, v in rates[scan].items()},
    )
print("ratio split/scan:", {b: round(np.median(rates[False][b]) / np.median(rates[True][b]), 2) for b in (1, 16)})
print("identical tokens:", all(toks[(True, b)] == toks[(False, b)] for b in (1, 16)))
