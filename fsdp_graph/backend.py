"""`fsdp_backend`: THE pipeline (DESIGN §5). Dynamo graph -> dedup -> joint: reshard tags -> partition
-> forward/backward: lower to `_c10d_functional` -> Inductor (or eager kernels with `inductor=False`)."""

from __future__ import annotations

import hashlib
import inspect
import itertools
from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import passes
from fsdp_graph import ir, ops
from fsdp_graph.dump import GraphDumper, no_caches_when_dumping
from passes.inspect import CollectiveSummary


@dataclass
class GraphReport:
    """What one lowered graph communicates. `stage` is "fw", "bw" or "inference"; `code` is the graph's
    Python code after lowering (before Inductor)."""

    graph_index: int
    stage: str
    collectives: CollectiveSummary
    code: str


def _source_hash(options: dict) -> str:
    """Code of every pass and of the op semantics, plus options: a changed pass never reuses stale code."""
    modules = [ops, ir, passes.dedup, passes.reshard, passes.lower, passes.inspect]
    h = hashlib.sha256(repr(sorted(options.items())).encode())
    for module in modules:
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()


class _ReshardPass(CustomGraphPass):
    def __init__(self, uuid: str, dumper: GraphDumper):
        self._uuid, self.dumper = uuid, dumper

    def __call__(self, graph: fx.Graph) -> None:
        passes.tag_reshard(graph)
        self.dumper.graph("02_joint_tagged", graph)

    def uuid(self) -> str:
        return self._uuid


class _LowerPass(CustomGraphPass):
    def __init__(self, uuid: str, dumper: GraphDumper, reports: list[GraphReport]):
        self._uuid, self.dumper, self.reports = uuid, dumper, reports
        self.stage = "fw"

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        passes.lower_fsdp_ops(gm)
        summary = passes.collective_summary(gm)
        self.reports.append(GraphReport(self.dumper.graph_index, self.stage, summary, gm.code.strip()))
        number = {"fw": "03", "inference": "03", "bw": "04"}[self.stage]
        self.dumper.graph(f"{number}_{self.stage}_lowered", gm, header=summary.to_text())
        stage = self.stage
        self.dumper.text("summary.txt", lambda: f"{stage}: {summary.to_text()}\n")

    def uuid(self) -> str:
        return self._uuid


class FSDPBackend:
    """A torch.compile backend. `reports` lists each lowered graph's collectives; `dynamo_graphs` counts
    the Dynamo graphs compiled (graph breaks and recompiles each add one)."""

    def __init__(self, *, inductor: bool = True, dump_dir: str | None = None):
        self.inductor = inductor
        self.dump_dir = dump_dir
        self.reports: list[GraphReport] = []
        self.dynamo_graphs = 0
        self._counter = itertools.count()
        self._uuid = _source_hash({"inductor": inductor})

    def __call__(self, gm: fx.GraphModule, example_inputs):
        dumper = GraphDumper(self.dump_dir, next(self._counter))
        self.dynamo_graphs += 1
        dumper.graph("00_dynamo", gm)
        _check_sharded(gm, example_inputs)
        passes.dedup_unshard(gm)
        dumper.graph("01_dedup", gm)
        reshard = _ReshardPass(self._uuid, dumper)
        lower = _LowerPass(self._uuid, dumper, self.reports)
        with no_caches_when_dumping(dumper.enabled):
            if self.inductor:
                return _compile_inductor(gm, example_inputs, reshard, lower, dumper.enabled)
            return _compile_eager(gm, example_inputs, reshard, lower)

    def __repr__(self) -> str:
        return f"fsdp_backend(inductor={self.inductor}, dump_dir={self.dump_dir!r})"


def _compile_inductor(gm, example_inputs, reshard: _ReshardPass, lower: _LowerPass, dumping: bool):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph, inputs, **kwargs):
        lower.stage = "bw" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "fw")
        return compile_fx_inner(graph, inputs, **kwargs)

    patches = {"joint_custom_pre_pass": reshard, "post_grad_custom_pre_pass": lower}
    if dumping:
        patches["fx_graph_cache"] = False
    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def _compile_eager(gm, example_inputs, reshard: _ReshardPass, lower: _LowerPass):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        reshard(joint.graph)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(stage: str):
        def compile_graph(graph: fx.GraphModule, inputs):
            lower.stage = stage
            lower(graph.graph)
            return make_boxed_func(graph.forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("fw"),
        bw_compiler=compiler("bw"),
        inference_compiler=compiler("inference"),
        partition_fn=partition,
    )(gm, example_inputs)


def _check_sharded(gm: fx.GraphModule, example_inputs) -> None:
    if any(n.op == "call_function" and n.target in ir.UNSHARD_TARGETS for n in gm.graph.nodes):
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    unsharded = []
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, nn.Parameter):
            grapharg = node.meta.get("grapharg")
            unsharded.append(grapharg.source.name if grapharg is not None else node.target)
    if unsharded:
        names = ", ".join(str(n) for n in unsharded[:5]) + (" ..." if len(unsharded) > 5 else "")
        raise RuntimeError(
            f"fsdp_backend: the compiled model uses parameters that fully_shard never sharded ({names}). "
            "Call fsdp_graph.fully_shard(model) before torch.compile(model, backend=fsdp_backend)."
        )


def make_backend(*, inductor: bool = True, dump_dir: str | None = None) -> FSDPBackend:
    """A new backend. `inductor=False` runs the same passes and executes with eager kernels (fast compile).
    `dump_dir` (or env FSDP_GRAPH_DUMP) writes each stage's graph as code plus a collective summary."""
    return FSDPBackend(inductor=inductor, dump_dir=dump_dir)


fsdp_backend = make_backend()
