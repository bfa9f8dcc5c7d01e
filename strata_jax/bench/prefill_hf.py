"""``strata-jax bench prefill-hf``: one cold prefill through the engine vs Hugging Face
transformers (torch) on the same weights, the same prompt and the same chunk size, side by side.

Each round draws a fresh random ``--tokens``-token prompt (nothing cached) and runs it
through both, in alternating order:

* **strata-jax**: ``Engine(tiers="L1", max_batch_tokens=CHUNK)`` after warm-up,
  ``generate(..., max_tokens=1)``; the time is the request's TTFT.
* **transformers**: the model in float32 (``torch.set_num_threads(--threads)``) fed
  the prompt ``CHUNK`` tokens at a time with its KV cache (``past_key_values``), as a
  chunked-prefill server would, under ``torch.inference_mode``; the time is the wall
  time of all chunks up to the last position's logits.

The first round is a warm-up for both and is not kept; the medians of ``--repeats``
rounds and their ratio are printed, with every round's numbers.  Both must pick the
same greedy first token in every round (the prompt is the same): a mismatch is an
error, not a footnote.  Needs torch and transformers (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

DESCRIPTION = "cold prefill through the engine vs Hugging Face transformers (torch) on the same weights and chunks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a GGUF file or a Hugging Face folder (both servers load it)")
    parser.add_argument("--tokens", type=int, default=1952, help="prompt tokens prefilled cold (default 1952)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk of both (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def load_hf_model(model: str):
    """transformers' float32 model of ``model``: a GGUF (transformers' own dequantization)
    or a Hugging Face folder."""
    import torch
    import transformers

    if Path(model).is_dir():
        return transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    settings = dict(load_gguf_checkpoint(model)["config"])
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    state = load_gguf_checkpoint(model, return_tensors=True, model_to_load=skeleton)["tensors"]
    hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    hf.load_state_dict(state, strict=False)  # a tied LM head is the embedding
    hf.tie_weights()
    return hf.eval()


def hf_chunked_prefill(model, prompt: list[int], chunk: int) -> tuple[float, int]:
    """(seconds, greedy next token) of a chunked prefill of ``prompt`` with transformers."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([prompt], dtype=torch.long)
    # transformers 5.x renames past_key_values to cache; the DynamicCache fills in place either way
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = DynamicCache()
        logits = None
        for start in range(0, len(prompt), chunk):
            out = model(input_ids=ids[:, start : start + chunk], use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            logits = out.logits
        seconds = time.perf_counter() - t0
    assert logits is not None  # the prompt is not empty: at least one chunk ran
    return seconds, int(logits[0, -1].argmax())


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig

    if args.tokens <= 0 or args.chunk <= 0 or args.repeats <= 0 or args.threads <= 0:
        raise SystemExit("--tokens, --chunk, --repeats and --threads must be positive")
    torch.set_num_threads(args.threads)
    hf = load_hf_model(args.model)
    engine = Engine(
        EngineConfig(
            model=args.model,
            show_progress=False,
            tiers="L1",
            max_batch_tokens=args.chunk,
            device_tokens=max(8192, 4 * (args.tokens + args.chunk)),
        )
    )
    try:
        if args.tokens + 1 > engine.max_context_tokens:
            raise SystemExit(f"--tokens {args.tokens} exceeds the engine's context ({engine.max_context_tokens})")
        rng = np.random.default_rng(args.seed)
        high = min(engine.vocab_size, hf.config.vocab_size) - 2
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rounds = []
        for i in range(1 + args.repeats):
            prompt = rng.integers(3, high, size=args.tokens).tolist()
            order = ("engine", "hf") if i % 2 == 0 else ("hf", "engine")
            row: dict = {}
            for side in order:
                if side == "engine":
                    out = engine.generate([prompt], params)[0]
                    row["engine_s"], row["engine_token"] = float(out.ttft_s), int(out.token_ids[0])
                else:
                    row["hf_s"], row["hf_token"] = hf_chunked_prefill(hf, prompt, args.chunk)
            if row["engine_token"] != row["hf_token"]:
                raise SystemExit(
                    f"round {i}: greedy first tokens differ (engine {row['engine_token']}, transformers "
                    f"{row['hf_token']})"
                )
            if i:
                rounds.append(row)
    finally:
        engine.shutdown()
    engine_s = statistics.median(r["engine_s"] for r in rounds)
    hf_s = statistics.median(r["hf_s"] for r in rounds)
    print(f"{args.model}: cold prefill of {args.tokens} tokens in chunks of {args.chunk}; torch threads {args.threads}")
    print("| round | strata-jax TTFT s | transformers s | ratio | first token (both) |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in enumerate(rounds, 1):
        print(
            f"| {n} | {r['engine_s']:.3f} | {r['hf_s']:.3f} | {r['engine_s'] / r['hf_s']:.2f} | {r['engine_token']} |"
        )
    print(f"| median | {engine_s:.3f} | {hf_s:.3f} | {engine_s / hf_s:.2f} | |")
    print(f"strata-jax / transformers: {engine_s / hf_s:.2f}x the time (below 1 is faster)")
    if args.json:
        report = {
            "model": args.model,
            "tokens": args.tokens,
            "chunk": args.chunk,
            "threads": args.threads,
            "rounds": rounds,
            "engine_median_s": engine_s,
            "hf_median_s": hf_s,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
