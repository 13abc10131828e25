"""The tables and the chart of `benchmarks/suite.py`'s report (docs/benchmarks.md), from its measured figures."""

from __future__ import annotations

import statistics
from pathlib import Path

BASELINE = "FSDP2 eager"
SINGLE = "single process (torch.compile)"


def peer_table(results: dict, zero_min: float) -> list[str]:
    base = results[BASELINE]
    ddp = results["DDP"]
    lines = [
        "| peer | median step | vs FSDP2 eager | vs DDP | peak MiB/rank | vs FSDP2 eager | MiB sent/rank/step "
        "| vs ZeRO-3 min | cold compile | warm compile |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['median']:.3f} s | {r['median'] / base['median']:.2f}x | {r['median'] / ddp['median']:.2f}x "
            f"| {r['peak'] / 2**20:.1f} | {r['peak'] / base['peak']:.2f}x | {r['bytes'] / 2**20:.2f} "
            f"| {r['bytes'] / zero_min:.4f} | {r['cold_compile']:.1f} s | {r['warm_compile']:.1f} s |"
        )
    return lines


def ratio_table(rows: list[tuple[str, list[float], float | None]]) -> list[str]:
    lines = ["| ratio | runs | min | median | max | target | met (median) |", "|---|---|---|---|---|---|---|"]
    for label, values, target in rows:
        med = statistics.median(values)
        goal, met = ("-", "-") if target is None else (f"<= {target}", "yes" if med <= target else "no")
        lines.append(
            f"| {label} | {len(values)} | {min(values):.2f} | {med:.2f} | {max(values):.2f} | {goal} | {met} |"
        )
    return lines


def parity_table(results: dict) -> list[str]:
    """Each peer's global loss in its cold phase (same data, same initial weights) against FSDP2 eager's."""
    ref = results[BASELINE]["losses"]
    lines = ["| peer | loss, first -> last step | max abs diff vs FSDP2 eager |", "|---|---|---|"]
    for name, r in results.items():
        diff = (
            "- (each rank trains its own copy)"
            if name == SINGLE
            else f"{max(abs(a - b) for a, b in zip(r['losses'], ref)):.2e}"
        )
        lines.append(f"| {name} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {diff} |")
    return lines


def chart(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results)
    base = results[BASELINE]
    metrics = [("median step", "median"), ("peak memory", "peak"), ("bytes sent", "bytes")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (title, key) in zip(axes, metrics):
        values = [results[n][key] / base[key] if base[key] else 0.0 for n in names]
        ax.barh(names, values, color=["tab:blue" if n.startswith("fsdp_graph") else "tab:gray" for n in names])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title} (x FSDP2 eager)")
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
