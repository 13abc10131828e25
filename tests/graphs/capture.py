"""Capture the stages of the pipeline on tiny models, for pass snapshots."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from fsdp_graph.ir import UNSHARD_TARGETS


class TwoBlock(nn.Module):
    """Two linear blocks and a head: three units (blocks.0, blocks.1, root)."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


class ReadsTwice(nn.Module):
    """Reads its weight twice per forward: the Dynamo graph gets two unshard calls for one unit."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.lin.weight + x @ self.lin.weight.t()


@dataclass
class Stages:
    dynamo: fx.GraphModule | None = None
    joint: fx.GraphModule | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    extra: dict = field(default_factory=dict)


def dynamo_graph(model: nn.Module, *inputs) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(copy.deepcopy(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def aot_stages(model: nn.Module, *inputs, tag=None, dedup: bool = True) -> Stages:
    """Joint graph (optionally tagged by `tag` before partitioning) and the unlowered fw/bw graphs,
    with the Dynamo graph deduplicated first as the backend does (unless `dedup=False`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from passes import dedup_unshard

    stages = Stages()

    def partition(joint, joint_inputs, **kwargs):
        if tag is not None:
            tag(joint.graph)
        stages.joint = copy.deepcopy(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def keep(name):
        def compile_graph(gm, example_inputs):
            setattr(stages, name, copy.deepcopy(gm))
            return make_boxed_func(gm.forward)

        return compile_graph

    torch._dynamo.reset()
    aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition)

    def backend(gm, example_inputs):
        if dedup:
            dedup_unshard(gm)
        stages.dynamo = copy.deepcopy(gm)
        return aot(gm, example_inputs)

    out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    out.sum().backward()
    return stages


def code(gm: fx.GraphModule) -> str:
    return gm.code.strip()


def unshard_count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in UNSHARD_TARGETS)
