"""Results of a sweep: the sustained rate at a TTFT target, the text table, the plot (paper Fig. 8 shape)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from strata_jax.sim.runner import RunResult


def sustained_rate(runs: Sequence[RunResult], ttft_target: float) -> float | None:
    """Highest offered rate at which mean TTFT stays within ``ttft_target`` (linear between swept rates).

    None when even the lowest rate misses the target.  Only rates where every
    request finished count (an overloaded run's TTFT is the backlog's).
    """
    pts = sorted((r.rate, r.ttft_mean) for r in runs)
    best: float | None = None
    for k, (r0, t0) in enumerate(pts):
        if t0 > ttft_target:
            break
        best = r0
        if k + 1 < len(pts):
            r1, t1 = pts[k + 1]
            if t1 > ttft_target:
                best = r0 + (r1 - r0) * (ttft_target - t0) / (t1 - t0)
                break
    return best


def table(runs: Sequence[RunResult]) -> str:
    head = (
        f"{'system':<17}{'rate':>7}{'TTFT mean':>11}{'TTFT p99':>10}{'req/s':>8}{'out tok/s':>11}{'stall':>7}{'hit':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r.system:<17}{r.rate:>7.2f}{r.ttft_mean:>10.2f}s{r.ttft_p99:>9.2f}s{r.throughput_rps:>8.2f}"
            f"{r.output_tps:>11.0f}{r.load_stall_fraction:>7.0%}{r.hit_rate:>6.0%}"
        )
    return "\n".join(lines)


def ablation_table(by_system: dict[str, list[RunResult]], ttft_target: float, baseline: str = "hicache") -> str:
    base = sustained_rate(by_system.get(baseline, []), ttft_target)
    lines = [
        f"sustained rate at mean TTFT <= {ttft_target:g} s (x {baseline})",
        f"{'system':<17}{'req/s':>8}{'x':>7}{'stall':>8}",
    ]
    for name, runs in by_system.items():
        rate = sustained_rate(runs, ttft_target)
        stall = max((r.load_stall_fraction for r in runs), default=0.0)
        ratio = f"{rate / base:.2f}" if rate is not None and base else "-"
        lines.append(f"{name:<17}{(f'{rate:.2f}' if rate is not None else '<min'):>8}{ratio:>7}{stall:>8.0%}")
    return "\n".join(lines)


def plot(by_system: dict[str, list[RunResult]], path: Path, title: str) -> None:
    """Mean TTFT against achieved throughput, one line per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'strata-jax[sim]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in by_system.items():
        runs = sorted(runs, key=lambda r: r.rate)
        ax.plot([r.throughput_rps for r in runs], [r.ttft_mean for r in runs], marker="o", label=name)
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
