"""Quality of quantized KV (issue 20) on the real SmolLM2-135M-Instruct, against full width.

    python scripts/kv_tier_quality.py [--model GGUF_OR_HF_DIR] [--prompts 32] [--prompt-tokens 640]
                                      [--positions 32] [--formats fp8,int8] [--json PATH]

Protocol (everything greedy, float32 weights, float32 L1 unless said otherwise):

* prompts: ``--prompts`` windows of ``--prompt-tokens`` tokens of the embedded LooGLE
  document (``strata_jax/demo_data``), starting 40 tokens apart (no two share a page);
* reference (full width): a cold run generates ``--positions`` tokens per prompt with
  their logprobs (cold = nothing cached: no tier format is involved yet);
* **from L2** (each ``--formats`` entry, ``--kv-tier-format``): the same engine's cold
  run wrote every prompt to L2 in that format (write-through); L1 is then flushed, and
  each position j is asked again teacher-forced (prompt + the reference's first j
  tokens, one token, top-20 logprobs): the prompt's pages come from L2, dequantized on
  load (the run checks every prompt's full pages were L2 hits);
* ``full`` in ``--formats`` is the control: the same teacher-forced protocol from a
  full-width L2 (bit-identical KV), so what it loses is the protocol's own noise (a
  teacher-forced position runs as an extend, the reference's as a decode step);

Reported per configuration: greedy top-1 agreement over all prompts x positions (the
quantized run's argmax == the reference's token), and the mean |delta logprob| of the
reference's chosen tokens (the quantized run's logprob of that token, from its top-20;
a token outside the top 20 counts with the 20th logprob, a lower bound on the gap, and
is counted in ``outside_top``).  Targets: agreement >= 0.97 and mean |delta| <= 0.05.

* ``l1-fp8`` in ``--formats``: an fp8 L1 (``--kv-dtype fp8``: e4m3fn, clipped, no
  scales) and no other tier, the same teacher-forced protocol: every prompt's KV, and
  the teacher-forced tokens', is held in fp8 (it must come after an L2 format, whose
  cold run is its reference).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TOP = 20


def demo_prompts(tokenizer, n: int, length: int, stride: int = 40) -> list[list[int]]:
    doc = json.loads((ROOT / "strata_jax" / "demo_data" / "loogle_picardo.json").read_text())["text"]
    ids = tokenizer.encode(doc)
    if (n - 1) * stride + length > len(ids):
        raise SystemExit(
            f"the demo document has {len(ids)} tokens: too few for {n} prompts of {length} at stride {stride}"
        )
    return [ids[i * stride : i * stride + length] for i in range(n)]


def _engine(model: str, **kw):
    from strata_jax.engine import Engine, EngineConfig

    base = dict(
        model=model,
        warmup=False,
        show_progress=False,
        page_size=16,
        max_context_tokens=1024,
        dtype="float32",
        max_batch_tokens=512,
        max_batch_size=8,
        compilation_cache_dir="none",
    )
    base.update(kw)
    return Engine(EngineConfig(**base))


def _chosen_logprob(lp, token: int) -> tuple[float, bool]:
    """The logprob of ``token`` at a position (from the top list) and whether it was in it."""
    if lp.token_id == token:
        return lp.logprob, True
    for tid, value in lp.top:
        if tid == token:
            return value, True
    return (lp.top[-1][1] if lp.top else lp.logprob), False


class Tally:
    def __init__(self) -> None:
        self.agree = self.total = self.outside = 0
        self.deltas: list[float] = []
        self.flips: list[dict] = []

    def add(self, argmax: int, ref_token: int, ref_logprob: float, lp, where=None, ref_margin=None) -> None:
        self.total += 1
        self.agree += argmax == ref_token
        value, inside = _chosen_logprob(lp, ref_token)
        self.outside += not inside
        self.deltas.append(abs(value - ref_logprob))
        if argmax != ref_token:  # how close the reference itself was to choosing otherwise
            self.flips.append(
                {"at": where, "reference_top1_minus_top2": ref_margin, "delta_logprob": abs(value - ref_logprob)}
            )

    def merge(self, other: Tally, prompt_offset: int = 0) -> None:
        """Add ``other``'s positions (asked of prompts numbered from ``prompt_offset``)."""
        self.agree += other.agree
        self.total += other.total
        self.outside += other.outside
        self.deltas += other.deltas
        for flip in other.flips:
            i, j = flip["at"]
            self.flips.append(flip | {"at": (i + prompt_offset, j)})

    def result(self) -> dict:
        return {
            "positions": self.total,
            "top1_agreement": self.agree / self.total if self.total else None,
            "mean_abs_delta_logprob": sum(self.deltas) / len(self.deltas) if self.deltas else None,
            "max_abs_delta_logprob": max(self.deltas) if self.deltas else None,
            "outside_top": self.outside,
            "flips": self.flips,
        }


def _device_tokens(prompts: list[list[int]], positions: int) -> int:
    """An L1 that holds every prompt with its teacher-forced tokens (nothing evicted)."""
    return max(4096, len(prompts) * (len(prompts[0]) + positions + 32))


def teacher_forced(
    engine, prompts: list[list[int]], ref_tokens: list, ref_lps: list, margins: list, positions: int, check_first=None
) -> Tally:
    """Position j of every prompt asked as prompt + the reference's first j tokens, one token
    each; ``check_first(i, output)`` sees each prompt's first ask (where its pages came from)."""
    from strata_jax.api import SamplingParams

    tally = Tally()
    for j in range(positions):
        asks = [p + c[:j] for p, c in zip(prompts, ref_tokens)]
        outs = engine.generate(asks, SamplingParams(max_tokens=1, logprobs=TOP))
        for i, out in enumerate(outs):
            if j == 0 and check_first is not None:
                check_first(i, out)
            tally.add(out.token_ids[0], ref_tokens[i][j], ref_lps[i][j], out.logprobs[0], (i, j), margins[i][j])
    return tally


def reference_and_l2(model: str, fmt: str, prompts: list[list[int]], positions: int) -> tuple[dict, list, list, list]:
    """Cold run (the full-width reference) and the teacher-forced run from L2 in ``fmt``."""
    from strata_jax.api import SamplingParams

    engine = _engine(model, tiers="L1+L2", kv_tier_format=fmt, device_tokens=_device_tokens(prompts, positions))
    try:
        cold = engine.generate(prompts, SamplingParams(max_tokens=positions, ignore_eos=True, logprobs=TOP))
        ref_tokens = [o.token_ids for o in cold]
        ref_lps = [[lp.logprob for lp in o.logprobs] for o in cold]
        margins = [[lp.top[0][1] - lp.top[1][1] if len(lp.top) > 1 else None for lp in o.logprobs] for o in cold]
        engine.flush_cache("device")
        full_pages = [(len(p) - 1) // 16 * 16 for p in prompts]  # the last token is always computed

        def from_l2(i: int, out) -> None:
            if out.cached_tokens["host"] < full_pages[i]:
                raise RuntimeError(f"prompt {i}: {out.cached_tokens} - its pages did not come from L2")

        tally = teacher_forced(engine, prompts, ref_tokens, ref_lps, margins, positions, from_l2)
        stats = engine.ctl.stats()
        row = tally.result() | {
            "host_bytes_per_token": stats["host_bytes_per_token"],
            "device_bytes_per_token": stats["device_bytes_per_token"],
            "load_bytes_per_token": stats["load_bytes_per_token"],
        }
        return row, ref_tokens, ref_lps, margins
    finally:
        engine.shutdown()


def l1_fp8(
    model: str, prompts: list[list[int]], ref_tokens: list, ref_lps: list, margins: list, positions: int
) -> dict:
    """Teacher-forced positions on an engine whose L1 is fp8 (no other tier), one prompt at a
    time over a small pool: XLA:CPU rewrites a whole fp8 buffer on every update, so the
    pool is sized for one prompt (a pool for all of them made this row take hours)."""
    engine = _engine(model, tiers="L1", kv_dtype="fp8", device_tokens=1024 + 128)
    try:
        tally = Tally()
        for i in range(len(prompts)):
            one = teacher_forced(
                engine, prompts[i : i + 1], ref_tokens[i : i + 1], ref_lps[i : i + 1], margins[i : i + 1], positions
            )
            tally.merge(one, prompt_offset=i)
            engine.flush_cache("device")
        return tally.result() | {"device_bytes_per_token": engine.ctl.stats()["device_bytes_per_token"]}
    finally:
        engine.shutdown()


def _print_row(name: str, r: dict) -> None:
    print(
        f"{name:<9} {r['positions']:>9} {r['top1_agreement']:>7.4f} {r['mean_abs_delta_logprob']:>10.4f} "
        f"{r['max_abs_delta_logprob']:>9.4f} {r['outside_top']:>7} "
        f"{r.get('host_bytes_per_token') or r['device_bytes_per_token']:>11.0f} {r['seconds']:>8.0f}",
        flush=True,
    )


def _checkpoint(report: dict, name: str, json_path: str | None) -> None:
    _print_row(name, report["runs"][name])
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")


def run(
    model: str,
    *,
    prompts: int = 32,
    prompt_tokens: int = 640,
    positions: int = 32,
    formats: tuple[str, ...] = ("fp8", "int8"),
    json_path: str | None = None,
) -> dict:
    """Each configuration's row is printed (and the report so far written to ``json_path``)
    as soon as it finishes: a long run keeps what it measured."""
    from strata_jax.models.loader import load_model

    tokenizer = load_model(model, show_progress=False).tokenizer
    asks = demo_prompts(tokenizer, prompts, prompt_tokens)
    report: dict = {
        "model": model,
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "positions": positions,
        "runs": {},
    }
    ref = None
    print(
        f"{'run':<9} {'positions':>9} {'top-1':>7} {'mean|dlp|':>10} {'max|dlp|':>9} {'>top20':>7} {'B/token':>11} "
        f"{'seconds':>8}"
    )
    for fmt in formats:
        t0 = time.perf_counter()
        if fmt == "l1-fp8":
            if ref is None:
                raise SystemExit("--formats: l1-fp8 needs an L2 format before it (its cold run is the reference)")
            report["runs"]["L1 fp8"] = l1_fp8(model, asks, *ref, positions) | {"seconds": time.perf_counter() - t0}
            _checkpoint(report, "L1 fp8", json_path)
            continue
        row, tokens, lps, margins = reference_and_l2(model, fmt, asks, positions)
        if ref is not None and tokens != ref[0]:
            raise RuntimeError("two cold runs of the same prompts gave different tokens")
        ref = (tokens, lps, margins)
        report["runs"][f"L2 {fmt}"] = row | {"seconds": time.perf_counter() - t0}
        _checkpoint(report, f"L2 {fmt}", json_path)
    report["targets"] = {
        name: {
            "top1_ge_0.97": r["top1_agreement"] >= 0.97,
            "mean_abs_delta_le_0.05": r["mean_abs_delta_logprob"] <= 0.05,
        }
        for name, r in report["runs"].items()
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the test suite's SmolLM2 GGUF)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=640)
    parser.add_argument("--positions", type=int, default=32, help="teacher-forced positions per prompt (default 32)")
    parser.add_argument("--formats", default="fp8,int8")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from real_model import smollm2_gguf_path

        model = str(smollm2_gguf_path())
    formats = tuple(f for f in args.formats.split(",") if f)
    report = run(
        model,
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        positions=args.positions,
        formats=formats,
        json_path=args.json,
    )
    print("targets:", json.dumps(report["targets"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
