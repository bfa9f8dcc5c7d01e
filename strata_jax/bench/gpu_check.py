"""The summary of ``scripts/gpu_check.sh``: the numbers a human wants, from its result files.

``python -m strata_jax.bench.gpu_check summarize OUT_DIR`` reads what the script's steps
wrote into OUT_DIR (``tests.xml``, ``transfer.json``, ``roofline.json``,
``calibrated_profile.json``; a missing or broken file is reported, never raised) and
prints a few lines per step: GPU-test counts, L2->L1 load GB/s per path and page size
against the link's measured peak, TTFT cold/L1/L2, decode step time and HBM utilisation
per batch, prefill MFU, and the calibrated profile.  Imports no jax: it runs in a second.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Result files of the script's steps (with summary.txt, devices.txt and log.txt: 7 files).
TESTS_XML = "tests.xml"
TRANSFER_JSON = "transfer.json"
ROOFLINE_JSON = "roofline.json"
PROFILE_JSON = "calibrated_profile.json"


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


def summarize(out: Path) -> str:
    lines: list[str] = []
    for part in (tests_lines, transfer_lines, roofline_lines, profile_lines):
        try:
            lines += part(out)
        except Exception as exc:  # a summary of what is there, whatever is not
            lines.append(f"{part.__name__}: could not summarise ({type(exc).__name__}: {exc})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "summarize":
        print("usage: python -m strata_jax.bench.gpu_check summarize OUT_DIR", file=sys.stderr)
        return 2
    print(summarize(Path(argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
