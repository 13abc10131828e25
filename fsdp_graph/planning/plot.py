"""Draw an `ExplainReport`: compute lane, communication lane (bars labelled with units) and the memory curve."""

from __future__ import annotations

from typing import TYPE_CHECKING

from passes.cost import unit_name

if TYPE_CHECKING:
    from fsdp_graph.planning.explain import ExplainReport

_MIB = 2**20


def _time_scale(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def draw(report: ExplainReport, path: str) -> None:
    """Save the timeline of `report` to `path` (format from the extension, e.g. .png) with matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "ExplainReport.save() draws with matplotlib: pip install matplotlib (or pip install fsdp_graph[plot])"
        ) from e

    scale, time_unit = _time_scale(report.step_time)
    fig = Figure(figsize=(14, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    lanes, memory = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1.4))
    units = [row.unit for row in report.units]
    palette = _colors(len(units) + 1)
    color_of = {unit: palette[i] for i, unit in enumerate(units)}

    sims = [report.forward] + ([report.backward] if report.backward is not None else [])
    events = [e for sim in sims for e in sim.events]
    y_of = {"compute": 1.0, "comm": 0.0}
    char_width = 0.0035 * report.step_time  # a 7 pt character, as a fraction of the axis
    for event in events:
        start, width = event.start * scale, (event.end - event.start) * scale
        y = y_of[event.lane]
        if event.kind == "wait":
            lanes.barh(y, width, left=start, height=0.6, color="#d62728", hatch="//", edgecolor="#7f0000", lw=0.3)
            continue
        color = color_of.get(event.unit, palette[-1])
        hatch = "xx" if event.kind == "reduce_scatter" else ("++" if event.kind == "all_reduce" else None)
        lanes.barh(y, width, left=start, height=0.6, color=color, edgecolor="black", lw=0.3, hatch=hatch)
        text = event.label if event.unit is None else unit_name(event.unit)  # the kind is in the hatch
        if event.end - event.start >= char_width * (len(text) + 2):
            box = {"facecolor": "white", "alpha": 0.75, "pad": 1, "lw": 0}
            lanes.text(start + width / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True, bbox=box)
    legend = [
        Patch(facecolor="white", edgecolor="black", label="all-gather"),
        Patch(facecolor="white", edgecolor="black", hatch="xx", label="reduce-scatter"),
        Patch(facecolor="white", edgecolor="black", hatch="++", label="all-reduce"),
        Patch(facecolor="#d62728", edgecolor="#7f0000", hatch="//", label="compute waits (exposed)"),
    ]
    lanes.legend(handles=legend, loc="upper right", fontsize=7, ncols=4, framealpha=0.9)
    lanes.set_yticks([1.0, 0.0], ["compute", "communication"])
    lanes.set_ylim(-0.6, 1.9)
    lanes.set_title(
        f"{report.world} ranks on {report.hardware.name}: step {report.step_time * scale:.3g} {time_unit}, "
        f"exposed communication {report.exposed_comm * scale:.3g} {time_unit} "
        f"({100 * report.exposed_fraction:.1f}%, red); peak memory {report.peak_memory_bytes / _MIB:.3f} MiB "
        f"({report.executor})",
        fontsize=10,
    )

    times, values = [], []
    for sim, stage in zip(sims, ("fw", "bw")):
        points = [p for p in report.memory.curve if p.stage == stage]
        for (start, _), point in zip(sim.node_times, points):
            times.append(start * scale)
            values.append((report.memory.persistent_bytes + point.bytes) / _MIB)
    times.append(report.step_time * scale)
    values.append(values[-1] if values else 0.0)
    memory.step(times, values, where="post", color="#1f77b4")
    memory.fill_between(times, values, step="post", alpha=0.25, color="#1f77b4")
    memory.axhline(report.memory.persistent_bytes / _MIB, color="gray", ls=":", lw=1)
    peak = report.memory.peak
    peak_sim = report.forward if peak.stage == "fw" or report.backward is None else report.backward
    peak_time = peak_sim.node_times[peak.index][0] * scale
    memory.annotate(
        f"peak {report.peak_memory_bytes / _MIB:.3f} MiB at {peak.node} ({unit_name(peak.unit)})",
        (peak_time, report.peak_memory_bytes / _MIB),
        xytext=(10, -14),
        textcoords="offset points",
        fontsize=8,
        arrowprops={"arrowstyle": "->", "lw": 0.8},
    )
    memory.set_ylabel("MiB per rank")
    memory.set_xlabel(f"time ({time_unit})")
    memory.set_ylim(bottom=0)
    if report.backward is not None:
        for ax in (lanes, memory):
            ax.axvline(report.forward.end * scale, color="black", ls="--", lw=0.8)
        lanes.text(report.forward.end * scale, 1.45, " backward", fontsize=8, va="center")
        lanes.text(report.forward.end * scale, 1.45, "forward ", fontsize=8, va="center", ha="right")
    fig.savefig(path, dpi=120)


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]
