"""What the backend hooks into AOT autograd and Inductor, and what it reports: the joint graph's reshard tagging,
the forward/backward graphs' lowering, bucketing and scheduling (`passes`), and each lowered graph's `GraphReport`."""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import passes
from fsdp_graph import compat, ir
from fsdp_graph.api.config import Compression
from fsdp_graph.compiler.dump import GraphDumper
from fsdp_graph.compiler.rank_check import GraphCollectives
from passes.collective_counts import CollectiveSummary
from passes.fx_nodes import bind_args


@dataclass
class GraphReport:
    """What one lowered graph communicates. `stage` is "fw", "bw" or "inference"; `code` is the graph's
    Python code after lowering (before Inductor); `graph` a copy of it when the backend keeps graphs;
    `fingerprint` its collective sequence (`passes.collective_fingerprint`) on the process `groups` it uses.
    `loaded_from`: where torch's compile caches served the graph (our passes did not run), the rank whose passes
    made this report when they compiled the cached code (`rank_check.STORE`): the rank that compiled it for this one
    (one compile per job, `compiler.shared_compile`), this rank in an earlier compile, or a checkpoint's; None where
    the passes ran in this compile."""

    graph_index: int
    stage: str
    collectives: CollectiveSummary
    code: str
    graph: fx.GraphModule | None = None
    fingerprint: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    loaded_from: int | None = None

    def collectives_to_compare(self) -> GraphCollectives:
        return GraphCollectives(f"{self.stage} {self.graph_index}", self.fingerprint, self.groups)

    def to_json(self) -> dict:
        """The report as JSON (without `graph`), as the compiling rank publishes it with its compiled files."""
        summary = self.collectives
        return {
            "stage": self.stage,
            "counts": dict(summary.counts),
            "bytes": dict(summary.bytes),
            "units": [list(unit) for unit in summary.units],
            "fsdp_ops_left": summary.fsdp_ops_left,
            "code": self.code,
            "fingerprint": list(self.fingerprint),
            "groups": list(self.groups),
        }

    @staticmethod
    def from_json(data: dict, graph_index: int, loaded_from: int) -> GraphReport:
        """`to_json`'s report of rank `loaded_from`, for this rank's graph `graph_index` (the same graph)."""
        summary = CollectiveSummary(
            Counter(data["counts"]), Counter(data["bytes"]), [tuple(u) for u in data["units"]], data["fsdp_ops_left"]
        )
        fingerprint, groups = tuple(data["fingerprint"]), tuple(data["groups"])
        return GraphReport(graph_index, data["stage"], summary, data["code"], None, fingerprint, groups, loaded_from)


class ReshardPass(CustomGraphPass):
    def __init__(self, uuid: str, dumper: GraphDumper, pass_seconds: Counter):
        self._uuid, self.dumper, self.pass_seconds = uuid, dumper, pass_seconds

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        passes.tag_reshard(graph)
        # a complex body's saved conjugates cross its region (passes/conjugates.py)
        passes.materialize_conjugates(graph)
        self.pass_seconds["reshard"] += time.perf_counter() - start
        self.dumper.graph("02_joint_tagged", graph)

    def uuid(self) -> str:
        return self._uuid


@dataclass(frozen=True)
class ScheduleOptions:
    """What the forward/backward-graph passes after lowering do (see `make_backend`)."""

    prefetch: bool = True
    max_inflight_bytes: int | None = None
    bucket_bytes: int = 0
    reduce_scatter: str = "auto"  # "auto": all-to-all over gloo groups; "native": always reduce_scatter_tensor
    activation_memory_budget: float | None = None  # the partitioner's budget (None: torch's default, 1.0)
    compress: Compression | None = None  # quantized gathers / gradient all-to-alls (`passes.compress`; None: off)


DEFAULT_SCHEDULE = ScheduleOptions()


class LowerPass(CustomGraphPass):
    def __init__(
        self,
        uuid: str,
        dumper: GraphDumper,
        reports: list[GraphReport],
        options: ScheduleOptions,
        keep_graphs: bool = False,
        all_to_all_groups: frozenset[str] = frozenset(),
        pass_seconds: Counter | None = None,
        serial_groups: frozenset[str] = frozenset(),
        piece_rows: Mapping[str, int] | None = None,
    ):
        self.pass_seconds = pass_seconds if pass_seconds is not None else Counter()
        self._uuid, self.dumper, self.reports, self.keep_graphs = uuid, dumper, reports, keep_graphs
        self.options, self.all_to_all_groups, self.serial_groups = options, all_to_all_groups, serial_groups
        self.stage = "fw"
        # The stages Inductor compiled, cache hits included (a hit runs no pass): a stage here without a report
        # came from the FX graph cache, whose entry another process may have written in the middle of this compile
        self.stages_compiled: list[str] = []
        self.piece_rows = piece_rows or {}  # `reshard_after_forward=k`: node group -> shards in its input piece

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        timed = self.pass_seconds
        start = time.perf_counter()
        passes.cat_flat_grads(gm)
        compress = self.options.compress
        # read before lowering: the lowered all-reduce names its group only
        replica_sizes = _replica_sizes(gm) if compress is not None else {}
        passes.lower_fsdp_ops(gm)
        lowered = time.perf_counter()
        passes.bucket_collectives(gm, self.options.bucket_bytes)
        if compress is not None:
            units = None if compress.units is None else frozenset(compress.units)
            passes.compress_collectives(
                gm, compress.weights, compress.grads, compress.block_size, units, replica_sizes, self.piece_rows
            )
        passes.reduce_scatter_as_all_to_all(gm, self.all_to_all_groups)
        bucketed = time.perf_counter()
        passes.schedule_collectives(gm, self.options.prefetch, self.options.max_inflight_bytes, self.serial_groups)
        passes.check_collectives(gm, self.serial_groups)
        timed["lower"] += lowered - start
        timed["bucket+all_to_all"] += bucketed - lowered
        timed["schedule"] += time.perf_counter() - bucketed
        summary = passes.collective_summary(gm)
        # A copy of the graph, sharing the module's tensors: deep-copying a graph's constant tensors (Hugging Face
        # Llama has some) fails under the fake mode compiling it, and `explain` only reads the nodes' metadata, so
        # the copy's code is never generated (at 70B shapes x 80 layers, 0.1 s a graph).
        kept = compat.graph_module_generating_code_on_use(gm, copy.deepcopy(gm.graph)) if self.keep_graphs else None
        fingerprint = tuple(passes.collective_fingerprint(gm))
        groups = tuple(sorted({g for n in gm.graph.nodes if (g := passes.fx_nodes.collective_group(n)) is not None}))
        index = self.dumper.graph_index
        self.reports.append(GraphReport(index, self.stage, summary, gm.code.strip(), kept, fingerprint, groups))
        number = {"fw": "03", "inference": "03", "bw": "04"}[self.stage]
        self.dumper.graph(f"{number}_{self.stage}_lowered", gm, header=summary.to_text())
        stage = self.stage
        self.dumper.text("summary.txt", lambda: f"{stage}: {summary.to_text()}\n")

    def uuid(self) -> str:
        return self._uuid


def _replica_sizes(gm: fx.GraphModule) -> dict[str, int]:
    """{replicate group: its size} of the gradient reductions in `gm` (HYBRID_SHARD's replicas, NO_SHARD's world)."""
    sizes = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ir.REDUCE_GRAD_TARGETS:
            a = bind_args(node)
            if a["replicate_world"] > 1:
                sizes[a["replicate_group"]] = a["replicate_world"]
    return sizes
