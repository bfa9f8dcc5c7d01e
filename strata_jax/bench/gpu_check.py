"""The summary of ``scripts/gpu_check.sh`` and its MoE step.

``python -m strata_jax.bench.gpu_check summarize OUT_DIR`` reads what the script's steps
wrote into OUT_DIR (``tests.xml``, ``transfer.json``, ``roofline.json``,
``calibrated_profile.json``, ``moe.json``; a missing or broken file is reported, never
raised) and prints a few lines per step: GPU-test counts, L2->L1 load GB/s per path and page
size against the link's measured peak, TTFT cold/L1/L2, decode step time and HBM utilisation
per batch, prefill MFU, the calibrated profile, and the MoE step's verdict and times.
Imports no jax: it runs in a second.

``python -m strata_jax.bench.gpu_check moe OUT_JSON [--dry-run]`` is the MoE step (the
only part that imports jax, lazily): a tiny random ``qwen2_moe`` model (2 layers, 8 experts,
top-2, a shared expert; float32, matmuls at ``highest`` precision) served by the real
``Engine`` on the default device (the GPU), its greedy tokens and teacher-forced logits
compared with the same model's on jax's CPU backend (a child process with
``JAX_PLATFORMS=cpu``, ``moe-reference``, started first so the two overlap; the weights are
drawn with numpy, so both processes hold the very same numbers), the decode and prefill
step times, then ``bench moe``'s layer comparison at a Qwen3-30B-A3B layer shape (bf16;
``--dry-run``: tiny float32 shapes) while time is left.  Each part is recorded (or its
error) in OUT_JSON, rewritten after every part, so a step cut short keeps what it measured;
exit 1 if a part failed or the tokens differ beyond a near tie.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pallas_kernels.dispatch import KernelBackend

# Result files of the script's steps (with summary.txt, devices.txt and log.txt: 8 files).
TESTS_XML = "tests.xml"
TRANSFER_JSON = "transfer.json"
ROOFLINE_JSON = "roofline.json"
PROFILE_JSON = "calibrated_profile.json"
MOE_JSON = "moe.json"


def _load(path: Path) -> tuple[dict | None, str | None]:
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"{path.name}: missing"
    except (OSError, ValueError) as exc:
        return None, f"{path.name}: unreadable ({type(exc).__name__}: {exc})"


def _pct(value: float, peak: float | None) -> str:
    return f" ({100 * value / peak:.0f}%)" if peak else ""


def tests_lines(out: Path) -> list[str]:
    path = out / TESTS_XML
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        return [f"tests: {TESTS_XML} missing"]
    except (OSError, ET.ParseError) as exc:
        return [f"tests: {TESTS_XML} unreadable ({exc})"]
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    line = (
        f"tests (pytest -m gpu): {passed} passed, {total['failures']} failed, {total['errors']} errors, "
        f"{total['skipped']} skipped of {total['tests']}"
    )
    lines = [line]
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            lines.append(f"  FAILED {case.get('classname')}::{case.get('name')}")
    return lines


def transfer_lines(out: Path) -> list[str]:
    report, problem = _load(out / TRANSFER_JSON)
    if report is None:
        return [f"transfer: {problem}"]
    peak_info = report.get("link_peak", {})
    peak = peak_info.get("gbps")
    lines = ["L2->L1 load (KV pages, host -> device), GB/s and % of the link's peak:"]
    if peak:
        pinned = f", pinned {peak_info['pinned_gbps']:.1f}" if "pinned_gbps" in peak_info else ""
        lines.append(
            f"  link peak {peak:.1f} GB/s: one contiguous {peak_info['mb']:.0f} MiB copy "
            f"(pageable {peak_info['pageable_gbps']:.1f}{pinned})"
        )
    if report.get("pinned", {}).get("memory_kind") is None and "pinned" in report:
        lines.append(f"  pinned_host: unavailable ({report['pinned'].get('note', '')})")
    for size, row in report.get("page_sizes", {}).items():
        nbytes = row["bytes"]
        link = nbytes / (row["split_ms"]["transfer"] * 1e-3) / 1e9 if row["split_ms"]["transfer"] > 0 else float("inf")
        parts = [
            f"staging {row['coalesced_gbps']:.2f}{_pct(row['coalesced_gbps'], peak)} [its device_put "
            f"{link:.1f}{_pct(link, peak)}]"
        ]
        if "pinned_pages_gbps" in row:
            t = row["pinned_split_ms"]["transfer"]
            plink = nbytes / (t * 1e-3) / 1e9 if t > 0 else float("inf")
            parts.append(f"pinned pages {row['pinned_pages_gbps']:.2f}{_pct(row['pinned_pages_gbps'], peak)}")
            parts.append(
                f"pinned staging {row['pinned_staging_gbps']:.2f}{_pct(row['pinned_staging_gbps'], peak)} "
                f"[its device_put {plink:.1f}{_pct(plink, peak)}]"
            )
        parts.append(f"per-page {row['naive_gbps']:.2f}{_pct(row['naive_gbps'], peak)}")
        parts.append(f"engine pipelined {row['pipelined_gbps']:.2f}{_pct(row['pipelined_gbps'], peak)}")
        lines.append(f"  page {size:>3} ({row['pages']} pages, {nbytes >> 20} MiB): " + " | ".join(parts))
    return lines


def roofline_lines(out: Path) -> list[str]:
    r, problem = _load(out / ROOFLINE_JSON)
    if r is None:
        return [f"roofline: {problem}"]
    from strata_jax.bench.roofline import format_report

    return ["engine (random weights):"] + ["  " + line for line in format_report(r).splitlines()]


def profile_lines(out: Path) -> list[str]:
    p, problem = _load(out / PROFILE_JSON)
    if p is None:
        return [f"calibrate: {problem}"]
    return [
        f"calibrated profile ({p.get('name')}): link peak {p['link_peak_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"coalesced efficiency {p['coalesced_efficiency']:.2f}, naive copy overhead "
        f"{p['naive_copy_overhead_s'] * 1e6:.1f} us, "
        f"HBM {p['hbm_bytes_per_s'] / 1e9:.0f} GB/s, matmul {p['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s"
    ]


# ------------------------------------------------------------------------------ the MoE step
MOE_PROMPT_LENGTHS = (21, 9)
MOE_NEW_TOKENS = 16
MOE_PAGE_SIZE = 16
# A generated token may differ from the CPU's only where the CPU's two best logits are closer
# than this (a near tie that rounding may flip: the GPU's attention kernel need not compute
# float32 dots at full precision); anywhere else a different token is a failure.
MOE_NEAR_TIE = 0.05
# Teacher-forced logits, max |device - CPU| over the positions both computed from the same
# tokens, as a share of the largest |logit|: rounding gives ~1e-6..1e-3, a wrong expert O(1).
MOE_LOGIT_TOL = 1e-2
# bench moe's layer comparison: Qwen3-30B-A3B's MoE layer in bf16 on the GPU, a tiny one on --dry-run.
MOE_LAYER: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "gpu": ({"hidden": 2048, "experts": 128, "top_k": 8, "intermediate": 768, "dtype": "bfloat16"}, (16, 2048)),
    "tiny": ({"hidden": 64, "experts": 8, "top_k": 2, "intermediate": 32, "dtype": "float32"}, (8, 64)),
}
MOE_LAYER_REPEATS = 3
MOE_LAYER_TIME_LIMIT_S = 2.0  # seconds of timed rounds per token count (each round: 4 calls)


def tiny_moe_config() -> Any:
    """A tiny ``qwen2_moe``: 2 layers, 8 experts, top-2 without renormalization, a gated shared
    expert, qkv bias -- every part of ``moe.MoEBlock`` and the attention around it."""
    from strata_jax.models.config import ModelConfig, MoEConfig

    return ModelConfig(
        model_type="qwen2_moe",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        attention_bias=True,
        moe=MoEConfig(8, 2, 32, norm_topk_prob=False, shared_expert_intermediate_size=48),
    )


def tiny_moe_model(config: Any, seed: int = 0) -> Any:
    """``random_model(config)`` with every weight but the norms redrawn by numpy: N(0, 0.1)
    (0.02 leaves the router near uniform), the LM head N(0, 0.5) (logits wide apart, so the
    greedy pick is rarely a near tie).  numpy's draws are the same numbers in the device's
    process and the CPU reference's; jax.random's normal need not be bit-equal across backends."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from strata_jax.models.weights import random_model

    model = random_model(config, dtype=jnp.float32, seed=seed)
    rng = np.random.default_rng(seed)
    flat = sorted(nnx.to_flat_state(nnx.state(model)), key=lambda item: tuple(map(str, item[0])))
    for path, var in flat:
        if "norm" in str(path[-2]):
            continue  # RMSNorm weights stay ones
        std = 0.5 if path[0] == "lm_head" else 0.1
        shape = tuple(var.get_value().shape)
        var.set_value(jnp.asarray(rng.normal(0.0, std, size=shape).astype(np.float32)))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def moe_prompts(config: Any) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, config.vocab_size, size=n)] for n in MOE_PROMPT_LENGTHS]


def _median_ms(call: Any, reps: int) -> float:
    import statistics

    call()  # compiles a shape the engine did not run
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def moe_greedy(reps: int = 10, kernel_backend: KernelBackend = "auto") -> dict[str, Any]:
    """The tiny MoE model on this process's default device: greedy tokens of ``moe_prompts``
    through the real ``Engine`` (L1 only, float32, pages of 16, ``kernel_backend``), then on
    its ``ModelRunner`` (after shutdown) the teacher-forced logits of prompt + tokens, the
    median time of a decode step (batch 4, 32 tokens of context) and of a 64-token prefill
    step.  Matmuls at ``highest`` precision while it runs (set globally: the engine's threads
    trace its programs; restored after)."""
    import jax

    saved = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # a flag read as an attribute
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        return _moe_greedy(reps, kernel_backend)
    finally:
        jax.config.update("jax_default_matmul_precision", saved)


def _moe_greedy(reps: int, kernel_backend: KernelBackend) -> dict[str, Any]:
    import jax
    import numpy as np

    from strata_jax.api import SamplingParams
    from strata_jax.engine import Engine, EngineConfig, factory
    from strata_jax.models.loader import LoadedModel
    from strata_jax.runtime.model_runner import SeqInput
    from strata_jax.tokenizer import ByteTokenizer

    config = tiny_moe_config()
    model = tiny_moe_model(config)
    prompts = moe_prompts(config)
    ps = MOE_PAGE_SIZE

    def load(spec: str, *, dtype: Any = None, show_progress: bool = True) -> LoadedModel:
        return LoadedModel("tiny-moe", config, model, ByteTokenizer())

    start = time.perf_counter()
    original = factory.load_model
    factory.load_model = load  # the seam bench roofline uses: the engine takes this model
    try:
        engine = Engine(
            EngineConfig(
                model="tiny-moe",
                dtype="float32",
                kv_dtype="float32",
                page_size=ps,
                device_tokens=1024,
                tiers="L1",
                max_batch_tokens=64,
                max_batch_size=4,
                max_context_tokens=256,
                warmup=False,
                compilation_cache_dir="none",
                show_progress=False,
                freeze_gc=False,
                kernel_backend=kernel_backend,
            )
        )
    finally:
        factory.load_model = original
    build_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MOE_NEW_TOKENS, ignore_eos=True))
        generate_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    runner = engine.runner
    tokens = [[int(t) for t in out.token_ids] for out in outputs]
    # teacher-forced: every prompt + its tokens in one step (one program), pages of their own
    start = time.perf_counter()
    seqs, first_page = [], 0
    for prompt, new in zip(prompts, tokens):
        seq = prompt + new[:-1]
        pages = -(-len(seq) // ps)
        seqs.append(SeqInput(seq, 0, list(range(first_page, first_page + pages))))
        first_page += pages
    rows = np.asarray(runner.step(seqs, all_logits=True).logits, np.float32)  # packed: sequence after sequence
    ends = np.cumsum([len(s.token_ids) for s in seqs])
    logits = [rows[end - len(s.token_ids) : end].tolist() for s, end in zip(seqs, ends)]
    logits_s = time.perf_counter() - start
    decode = [SeqInput([1 + i], 32, list(range(3 * i, 3 * i + 3))) for i in range(4)]
    prefill = [SeqInput(list(range(64)), 0, list(range(64 // ps)))]
    start = time.perf_counter()
    decode_ms, prefill_ms = (
        _median_ms(lambda: runner.step(decode), reps),
        _median_ms(lambda: runner.step(prefill), reps),
    )
    device = jax.devices()[0]
    return {
        "device": {"platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__},
        "kernel_backend": runner.kernel_backend,
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": MOE_NEW_TOKENS,
        "tokens": tokens,
        "logits": logits,
        "build_s": build_s,
        "generate_s": generate_s,
        "logits_s": logits_s,
        "step_times_s": time.perf_counter() - start,  # compiles of the two step shapes included
        "decode_step_ms": decode_ms,
        "decode_batch": len(decode),
        "prefill_step_ms": prefill_ms,
        "prefill_tokens": 64,
    }


def compare_moe(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The device's greedy run against the CPU's: per prompt, whether the tokens are equal, else
    the first differing one and the CPU's gap between its two best logits there (a near tie
    below ``MOE_NEAR_TIE`` is reported, not failed); the teacher-forced logits' max difference
    over the rows both computed from the same tokens (those up to the first difference).
    ``ok``: every prompt equal or a near tie, and that difference within ``MOE_LOGIT_TOL`` of
    the largest |logit|."""
    import numpy as np

    prompts, worst, scale = [], 0.0, 0.0
    for length, mine, theirs, my_logits, ref_logits in zip(
        got["prompt_tokens"], got["tokens"], ref["tokens"], got["logits"], ref["logits"], strict=True
    ):
        a, b = np.asarray(my_logits, np.float32), np.asarray(ref_logits, np.float32)
        differ = [i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y]
        first = differ[0] if differ else (None if len(mine) == len(theirs) else min(len(mine), len(theirs)))
        rows = min(len(a), len(b), length + first if first is not None else len(a))
        worst = max(worst, float(np.max(np.abs(a[:rows] - b[:rows]))))
        scale = max(scale, float(np.max(np.abs(b[:rows]))))
        row: dict[str, Any] = {"prompt_tokens": length, "tokens_equal": first is None, "first_mismatch": first}
        if first is not None and length - 1 + first < len(b):
            top = np.sort(b[length - 1 + first])[::-1]
            row["ref_top2_gap"] = float(top[0] - top[1])
            row["near_tie"] = row["ref_top2_gap"] < MOE_NEAR_TIE
        prompts.append(row)
    rel = worst / scale if scale > 0 else float("inf")
    tokens_ok = all(p["tokens_equal"] or p.get("near_tie", False) for p in prompts)
    return {
        "prompts": prompts,
        "tokens_equal": all(p["tokens_equal"] for p in prompts),
        "max_abs_logit_diff": worst,
        "max_abs_logit": scale,
        "rel_logit_diff": rel,
        "ok": tokens_ok and rel <= MOE_LOGIT_TOL,
    }


def moe_step(out_json: Path, *, dry_run: bool, budget_s: float) -> int:
    """The MoE step of gpu_check.sh (see the module doc).  Every part is time-boxed by
    ``budget_s`` from the start: the layer comparison starts no token count but its first
    after ``budget_s - 8`` s, the CPU reference is waited for until ``budget_s``."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"budget_s": budget_s, "dry_run": dry_run, "phases": [], "errors": {}}

    def save() -> None:
        out_json.write_text(json.dumps(report, indent=2))

    def failed(phase: str, exc: BaseException) -> None:
        traceback.print_exc()
        report["errors"][phase] = f"{type(exc).__name__}: {exc}"

    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-moe-"))
    ref_json, ref_log = tmp / "reference.json", tmp / "reference.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = None
    try:
        config = tiny_moe_config()
        moe = config.moe
        report["model"] = {
            "model_type": config.model_type,
            "layers": config.num_layers,
            "hidden": config.hidden_size,
            "experts": moe.num_experts,
            "top_k": moe.num_experts_per_tok,
            "expert_width": moe.expert_intermediate_size,
            "shared_expert_width": moe.shared_expert_intermediate_size,
            "dtype": "float32",
            "matmul_precision": "highest",
        }
        with open(ref_log, "w") as log:  # started first: the CPU reference runs beside the device's work
            child = subprocess.Popen(
                [sys.executable, "-m", "strata_jax.bench.gpu_check", "moe-reference", str(ref_json)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        save()
        got = None
        # the platform's own kernels first; should they fail, the XLA ones, so the MoE part is still checked
        backends: tuple[KernelBackend, ...] = ("auto", "xla")
        for backend in backends:
            print(f"[moe] the tiny MoE model through the engine on this device (kernels {backend}) ...", flush=True)
            try:
                got = moe_greedy(kernel_backend=backend)
                report["device"] = got["device"]
                report["engine"] = {k: v for k, v in got.items() if k not in ("logits", "device")}
                report["phases"].append("engine")
                break
            except Exception as exc:
                failed(f"engine_{backend}", exc)
            save()
        save()
        report["engine_phase_s"] = time.perf_counter() - t0
        print("[moe] bench moe's layer comparison ...", flush=True)
        try:
            from strata_jax.bench.moe import LayerShape, run_layer_bench

            kind = "tiny" if dry_run else "gpu"
            fields, counts = MOE_LAYER[kind]

            def partial(layer: dict[str, Any]) -> None:
                report["layer"] = layer
                save()

            report["layer"] = run_layer_bench(
                LayerShape(**fields),
                counts,
                repeats=MOE_LAYER_REPEATS,
                time_limit_s=MOE_LAYER_TIME_LIMIT_S,
                deadline=t0 + budget_s - 8,
                on_point=partial,
            )
            report["phases"].append("layer")
        except Exception as exc:
            failed("layer", exc)
        save()
        report["layer_phase_end_s"] = time.perf_counter() - t0
        print("[moe] waiting for the CPU reference ...", flush=True)
        try:
            try:
                rc = child.wait(timeout=max(1.0, t0 + budget_s - time.perf_counter()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"the CPU reference did not finish within the step's {budget_s:.0f} s") from None
            if rc != 0:
                tail = ref_log.read_text()[-3000:]
                raise RuntimeError(f"the CPU reference exited {rc}:\n{tail}")
            ref = json.loads(ref_json.read_text())
            report["reference"] = {k: v for k, v in ref.items() if k not in ("logits", "tokens")}
            if got is not None:
                report["compare"] = compare_moe(got, ref)
                report["phases"].append("compare")
                if not report["compare"]["ok"]:
                    report["errors"]["compare"] = "the device's greedy tokens or logits differ from the CPU's"
        except Exception as exc:
            failed("compare", exc)
    except BaseException as exc:  # the step's time limit (SIGINT) included: keep what was measured
        failed("moe", exc)
        raise
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        report["seconds"] = time.perf_counter() - t0
        save()
        for path in (ref_json, ref_log):
            path.unlink(missing_ok=True)
        tmp.rmdir()
    print(moe_summary(report))
    return 1 if report["errors"] else 0


def moe_reference(out_json: Path) -> int:
    """The CPU side of the MoE step (run with ``JAX_PLATFORMS=cpu``): ``moe_greedy`` as JSON."""
    out_json.write_text(json.dumps(moe_greedy(reps=3)))
    return 0


def moe_summary(r: dict[str, Any]) -> str:
    """The MoE step's lines for a human: verdict, logit difference, step times, the layer table."""
    lines = []
    m, e, c = r.get("model", {}), r.get("engine"), r.get("compare")
    where = r.get("device", {}).get("device_kind", "?")
    head = (
        f"MoE: tiny random {m.get('model_type')} ({m.get('experts')} experts, top-{m.get('top_k')}, "
        f"shared expert {m.get('shared_expert_width')}, {m.get('dtype')}), engine on {where} vs jax's CPU backend"
    )
    lines.append(head)
    if c is not None:
        n = len(c["prompts"])
        if c["tokens_equal"]:
            verdict = f"greedy tokens equal ({n} prompts x {e['new_tokens'] if e else '?'} tokens)"
        else:
            verdict = "greedy tokens DIFFER: " + ", ".join(
                f"prompt {i} at token {p['first_mismatch']} (CPU top-2 gap {p.get('ref_top2_gap', float('nan')):.3g}"
                f"{', a near tie' if p.get('near_tie') else ''})"
                for i, p in enumerate(c["prompts"])
                if not p["tokens_equal"]
            )
        lines.append(
            f"  {'ok' if c['ok'] else 'FAILED'}: {verdict}; teacher-forced logits max |diff| "
            f"{c['max_abs_logit_diff']:.2e} (of |logit| <= {c['max_abs_logit']:.2f})"
        )
    if e is not None:
        lines.append(
            f"  decode step (batch {e['decode_batch']}) {e['decode_step_ms']:.2f} ms, prefill step "
            f"({e['prefill_tokens']} tokens) {e['prefill_step_ms']:.2f} ms, kernels {e['kernel_backend']}; "
            f"engine built in {e['build_s']:.1f} s, generate {e['generate_s']:.1f} s (compiles included)"
        )
    layer = r.get("layer")
    if layer:
        s = layer["shape"]
        lines.append(
            f"  MoE layer (bench moe): hidden {s['hidden']}, {s['experts']} experts, top-{s['top_k']}, width "
            f"{s['intermediate']}, {s['dtype']}; expert GFLOP/s grouped / dense same-FLOPs / masked loop:"
        )
        for p in layer["points"]:
            g, ratio = p["expert_gflops"], p["ratios"]
            lines.append(
                f"    {p['tokens']:>5} tokens: {g['grouped']:.1f} / {g['dense']:.1f} / {g['loop']:.1f}; "
                f"grouped/dense {ratio['grouped_vs_dense']:.2f}x (target >= {layer['target_grouped_vs_dense']}), "
                f"grouped/loop {ratio['grouped_vs_loop']:.2f}x; rel err vs loop {p['rel_err']['grouped_vs_loop']:.1e}"
            )
        if layer.get("skipped"):
            lines.append(f"    skipped (out of time): tokens {layer['skipped']}")
    for phase, error in r.get("errors", {}).items():
        lines.append(f"  {phase}: {error.splitlines()[0] if error else ''}")
    return "\n".join(lines)


def moe_lines(out: Path) -> list[str]:
    r, problem = _load(out / MOE_JSON)
    if r is None:
        return [f"moe: {problem}"]
    return moe_summary(r).splitlines()


def summarize(out: Path) -> str:
    lines: list[str] = []
    for part in (tests_lines, transfer_lines, roofline_lines, profile_lines, moe_lines):
        try:
            lines += part(out)
        except Exception as exc:  # a summary of what is there, whatever is not
            lines.append(f"{part.__name__}: could not summarise ({type(exc).__name__}: {exc})")
    return "\n".join(lines)


USAGE = (
    "usage: python -m strata_jax.bench.gpu_check summarize OUT_DIR\n"
    "       python -m strata_jax.bench.gpu_check moe OUT_JSON [--dry-run] [--budget-s S]\n"
    "       python -m strata_jax.bench.gpu_check moe-reference OUT_JSON"
)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "summarize":
        print(summarize(Path(argv[1])))
        return 0
    if len(argv) == 2 and argv[0] == "moe-reference":
        return moe_reference(Path(argv[1]))
    if len(argv) >= 2 and argv[0] == "moe":
        dry_run, budget_s, rest = False, 35.0, argv[2:]
        while rest:
            flag = rest.pop(0)
            if flag == "--dry-run":
                dry_run = True
            elif flag == "--budget-s" and rest:
                budget_s = float(rest.pop(0))
            else:
                print(USAGE, file=sys.stderr)
                return 2
        return moe_step(Path(argv[1]), dry_run=dry_run, budget_s=budget_s)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
