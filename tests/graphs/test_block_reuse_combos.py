"""`fully_shard(reuse_blocks=True)` with the options its first tests left out (issue 15): bucketing, HYBRID_SHARD,
CPU offload, `set_reshard_after_backward(False)` and an activation checkpoint around each unit. Each compiles the
same 3-block model with and without `reuse_blocks` on the fake process group (world 4) and checks that the Dynamo
graph calls one body per block and that every lowered graph has the same collectives as without reuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdp_graph

BLOCKS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(4, 2)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def _bodies(gm: torch.fx.GraphModule) -> list[str]:
    """The body each `invoke_subgraph` call of `gm` runs, in graph order, also inside activation-checkpoint regions (their bodies are graph attributes of `gm`)."""
    calls = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.tag_activation_checkpoint:
            calls += _bodies(getattr(gm, node.args[0].target))
        elif node.target is torch.ops.higher_order.invoke_subgraph:
            calls.append(str(node.args[0].target))
    return calls


def _steps(shard, steps: int = 1, checkpointed: bool = False, **backend_options) -> tuple[list, list]:
    """Per reuse setting (False, True): the bodies each Dynamo graph calls, and every lowered graph's collectives."""
    results = []
    for reuse in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = shard(Stack(checkpointed), reuse)
        backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True, **backend_options)
        graphs: list[torch.fx.GraphModule] = []

        def capture(gm, example_inputs, backend=backend, graphs=graphs):
            graphs.append(gm)
            return backend(gm, example_inputs)

        compiled = torch.compile(model, backend=capture, fullgraph=True)
        x = torch.randn(3, 4)
        for _ in range(steps):
            compiled(x).sum().backward()
        results.append(([_bodies(gm) for gm in graphs], [(r.stage, r.collectives.to_text()) for r in backend.reports]))
    (plain_bodies, plain_collectives), (bodies, collectives) = results
    assert plain_bodies == [[]] * len(plain_bodies)
    assert bodies and all(calls == [calls[0]] * BLOCKS for calls in bodies), bodies
    assert collectives == plain_collectives
    return bodies, collectives


def test_bucketing(fake_pg):
    _, collectives = _steps(lambda m, reuse: fsdp_graph.fully_shard(m, reuse_blocks=reuse), bucket_bytes=1 << 20)
    fw = dict(collectives)["fw"]
    assert fw.startswith("all_gather: 1 "), fw  # the units' gathers share one bucket, outside the bodies


def test_hybrid_shard(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2))
    hybrid = fsdp_graph.ShardingStrategy.HYBRID_SHARD
    _, collectives = _steps(lambda m, reuse: fsdp_graph.fully_shard(m, mesh, strategy=hybrid, reuse_blocks=reuse))
    assert "all_reduce" in dict(collectives)["bw"]  # the replicas' reduction, outside the bodies


def test_cpu_offload(fake_pg):
    offload = fsdp_graph.CPUOffload(offload_params=True)
    _steps(lambda m, reuse: fsdp_graph.fully_shard(m, cpu_offload=offload, device="cpu", reuse_blocks=reuse))


def test_reshard_after_backward_false(fake_pg):
    """Two steps keeping the gathers: the second step's graph gathers nothing, with or without reuse."""

    def shard(model, reuse):
        fsdp_graph.fully_shard(model, reuse_blocks=reuse)
        model.set_reshard_after_backward(False)
        return model

    bodies, collectives = _steps(shard, steps=2)
    assert len(bodies) == 2  # the first step (gathers and keeps) and the next (reads the kept gathers)
    assert "all_gather" not in [text for stage, text in collectives if stage == "fw"][-1]


def test_checkpoint_around_each_unit(fake_pg):
    _, collectives = _steps(lambda m, reuse: fsdp_graph.fully_shard(m, reuse_blocks=reuse), checkpointed=True)
    assert dict(collectives)["bw"].startswith("all_gather: "), collectives  # the recompute re-gathers


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
def test_other_strategies(fake_pg, strategy):
    strat = getattr(fsdp_graph.ShardingStrategy, strategy)
    _steps(lambda m, reuse: fsdp_graph.fully_shard(m, strategy=strat, reuse_blocks=reuse))


def test_explain_charges_the_block_bodies(fake_pg):
    """`explain()` prices a body call as the kernels of its body, so its FLOPs are the model's without
    `reuse_blocks` (before, a call was one kernel without FLOPs)."""
    idx = torch.randn(64, 4)
    reports = []
    for reuse in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = fsdp_graph.fully_shard(Stack(), reuse_blocks=reuse)
        reports.append(fsdp_graph.explain(model, idx, loss_fn=lambda out: out.sum(), hardware="nvlink"))
    plain, reused = reports
    assert reused.forward.flops == plain.forward.flops > 0
    assert reused.forward.compute_time == pytest.approx(plain.forward.compute_time)
    # One body serves every block, so its backward also computes the first block's input gradient, which the
    # model without reuse skips (its input needs none): one (64 x 8) @ (8 x 4) matmul more, 2 * 64 * 8 * 4 FLOPs.
    assert reused.backward.flops == plain.backward.flops + 2 * 64 * 8 * 4
