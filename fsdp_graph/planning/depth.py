"""Plans of deep models from shallow ones: `explain()` of the same model at a few depths, one line per figure.

A model of N identical blocks costs the same per block: each adds its shards, its saved activations, its
gathers and reductions and its kernels, so every figure of the plan is `a + b * depth` once the depth is past
what the model's ends (embedding, head, loss) dominate. Planning 405B's 126 layers traces 126 blocks through
Dynamo, AOT autograd and the partitioner (minutes on a laptop); planning it at 4, 5 and 6 layers traces 15.
The line is not assumed: the samples must lie on it (the first two predict the third within `rtol`), otherwise
`explain_by_depth` raises and says which figure bent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsdp_graph.planning.explain import ExplainReport

FIGURES = (
    "params",
    "shard_bytes",
    "largest_unit_bytes",
    "gathers",
    "reduce_scatters",
    "peak_memory_bytes",
    "sent_bytes",
    "step_time",
    "comm_time",
    "exposed_comm",
)


def figures_of(report: ExplainReport) -> dict[str, float]:
    """The figures of one plan that `explain_by_depth` extrapolates (bytes and counts per rank, seconds)."""
    return {
        "params": sum(r.params for r in report.units),
        "shard_bytes": sum(r.shard_bytes for r in report.units),
        "largest_unit_bytes": max(r.unsharded_bytes for r in report.units),
        "gathers": sum(r.gathers for r in report.units),
        "reduce_scatters": sum(r.reduce_scatters for r in report.units),
        "peak_memory_bytes": report.peak_memory_bytes,
        "sent_bytes": report.sent_bytes,
        "step_time": report.step_time,
        "comm_time": report.comm_time,
        "exposed_comm": report.exposed_comm,
    }


@dataclass(frozen=True)
class DepthPlan:
    """The figures of a `layers`-deep model, extrapolated from plans at `samples` depths."""

    layers: int
    samples: tuple[int, ...]
    sampled: dict[int, dict[str, float]]  # depth -> figures_of(explain at that depth)
    per_layer: dict[str, float]  # each figure's slope, from the two deepest samples
    figures: dict[str, float]  # each figure at `layers`
    plan_seconds: float  # wall time of the sampled plans (building, sharding and explaining each)

    def __getitem__(self, name: str) -> float:
        return self.figures[name]


def explain_by_depth(
    plan: Callable[[int], ExplainReport],
    layers: int,
    samples: Sequence[int] = (4, 5, 6),
    rtol: float = 1e-3,
    figures: Callable[[ExplainReport], dict[str, float]] = figures_of,
) -> DepthPlan:
    """Extrapolate `plan(layers)` from `plan(n)` for each `n` in `samples`.

    `plan(n)` builds the model with `n` repeated blocks (and everything else unchanged), shards it and returns
    `explain(...)` of it; on the meta device with the fake process group it allocates nothing. At least three
    increasing depths, all below `layers`. Every figure of `FIGURES` must be linear over the samples: the line
    through the first two predicts each later sample within `rtol` of its value (or 1 unit for counts and
    bytes), else ValueError names the figure. Checked in `tests/graphs/test_depth_plan.py` against `explain()` of
    the whole model. `figures` picks what is extrapolated (default `figures_of`); only `FIGURES` are checked.
    """
    samples = tuple(samples)
    if len(samples) < 3 or list(samples) != sorted(set(samples)) or samples[0] < 1:
        raise ValueError(f"explain_by_depth: samples must be at least three increasing depths >= 1, got {samples}")
    if layers <= samples[-1]:
        raise ValueError(
            f"explain_by_depth: layers={layers} is not deeper than the samples {samples}; call explain() on the "
            "whole model instead."
        )
    start = time.perf_counter()
    sampled = {n: figures(plan(n)) for n in samples}
    seconds = time.perf_counter() - start
    per_layer, extrapolated = {}, {}
    for name in sampled[samples[0]]:
        values = [sampled[n][name] for n in samples]
        if name in FIGURES:
            _check_linear(name, samples, values, rtol)
        slope = (values[-1] - values[-2]) / (samples[-1] - samples[-2])
        per_layer[name] = slope
        extrapolated[name] = values[-1] + slope * (layers - samples[-1])
    return DepthPlan(layers, samples, sampled, per_layer, extrapolated, seconds)


def _check_linear(name: str, depths: tuple[int, ...], values: list[float], rtol: float) -> None:
    slope = (values[1] - values[0]) / (depths[1] - depths[0])
    for depth, value in zip(depths[2:], values[2:]):
        predicted = values[0] + slope * (depth - depths[0])
        if abs(predicted - value) > max(rtol * abs(value), 1.0 if isinstance(value, int) else 0.0):
            pairs = ", ".join(f"{d} layers: {v:.6g}" for d, v in zip(depths, values))
            raise ValueError(
                f"explain_by_depth: '{name}' is not linear in depth ({pairs}; the line through the first two "
                f"predicts {predicted:.6g} at {depth}). The blocks differ, or the model's ends still set the figure at "
                "these depths (the peak's place, the overlap): "
                "sample deeper (e.g. samples=(8, 10, 12)) or call explain() on the whole model."
            )
