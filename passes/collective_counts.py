"""Read-only analysis: how many collectives of each kind a graph issues, their bytes, and for which units."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx

from fsdp_graph.ir import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    META_UNIT,
    REDUCE_GRAD_TARGETS,
    REDUCE_SCATTER,
    UNSHARD_TARGETS,
)
from passes.fx_nodes import node_bytes

_KIND = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce", ALL_TO_ALL: "all_to_all"}


@dataclass
class CollectiveSummary:
    """Counts and unsharded bytes of each collective kind; `units` lists (kind, unit) in graph order."""

    counts: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    units: list[tuple[str, str]] = field(default_factory=list)
    fsdp_ops_left: int = 0

    def to_text(self) -> str:
        kinds = sorted(self.counts)
        parts = [f"{k}: {self.counts[k]} ({self.bytes[k] / 2**20:.3f} MiB)" for k in kinds] or ["no collectives"]
        if self.fsdp_ops_left:
            parts.append(f"fsdp ops not lowered: {self.fsdp_ops_left}")
        return "; ".join(parts)


def collective_summary(gm: fx.GraphModule) -> CollectiveSummary:
    """Counts `_c10d_functional` collectives (bytes of the unsharded side: gather output, scatter / all-to-all input)
    and any `fsdp` op not yet lowered. Pure; changes nothing."""
    summary = CollectiveSummary()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in UNSHARD_TARGETS or node.target in REDUCE_GRAD_TARGETS:
            summary.fsdp_ops_left += 1
        kind = _KIND.get(node.target)
        if kind is None:
            continue
        summary.counts[kind] += 1
        summary.bytes[kind] += node_bytes(node if kind == "all_gather" else node.args[0])
        summary.units.append((kind, node.meta.get(META_UNIT, "?")))
    return summary
