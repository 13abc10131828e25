"""Rank-side worker for `fully_shard(reuse_blocks=True)` (issue 15): one compiled block body, same training."""

from __future__ import annotations

from collections.abc import Callable

import torch

import fsdp_graph
from fsdp_graph.train.llama import Llama, LlamaConfig, llama_loss
from tests.workers.training import full_grads

CFG = LlamaConfig(dim=32, layers=3, heads=4, kv_heads=2, hidden=48, seq=16, vocab=64)
STEPS = 3


def body_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The body each `invoke_subgraph` call of `gm` runs, in graph order."""
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    return [str(node.args[0].target) for node in calls]


def sgd_momentum_steps(
    model: torch.nn.Module, step_loss: Callable[[], torch.Tensor], lr: float, steps: int
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`steps` steps of SGD with momentum 0.9 on `model`, each on the loss `step_loss()` returns (it draws its own
    batch): the losses, the last step's full gradients and the final full parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, grads = [], {}
    for _ in range(steps):
        loss = step_loss()
        loss.backward()
        grads = full_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with fsdp_graph.summon_full_params(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, grads, params


def train(
    rank: int,
    world: int,
    reuse: bool,
    inductor: bool = False,
    shard_options: dict | None = None,
    backend_options: dict | None = None,
) -> dict:
    """STEPS SGD steps of a 3-block Llama, compiled with eager kernels (or Inductor), `fully_shard` and the backend
    given the options: the losses, the last step's full gradients, the final full parameters, the bodies the Dynamo
    graph calls and each lowered graph's collectives."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(Llama(CFG), reuse_blocks=reuse, **(shard_options or {}))
    backend = fsdp_graph.make_backend(inductor=inductor, **(backend_options or {}))
    dynamo_graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        dynamo_graphs.append(gm)
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=capture, fullgraph=True)
    gen = torch.Generator().manual_seed(1 + rank)

    def step_loss() -> torch.Tensor:
        tokens = torch.randint(0, CFG.vocab, (2, CFG.seq + 1), generator=gen)
        return llama_loss(compiled, (tokens[:, :-1], tokens[:, 1:]))

    losses, grads, params = sgd_momentum_steps(model, step_loss, lr=0.5, steps=STEPS)
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "bodies": [body_calls(gm) for gm in dynamo_graphs],
        "collectives": [(r.stage, r.collectives.to_text()) for r in backend.reports],
    }


def train_both(rank: int, world: int, inductor: bool = False) -> tuple[dict, dict]:
    """`train` without, then with, `reuse_blocks`."""
    return train(rank, world, False, inductor), train(rank, world, True, inductor)


OPTIONS = {  # label: (fully_shard options, backend options)
    "bucketing + CPU offload": ({"cpu_offload": fsdp_graph.CPUOffload(offload_params=True)}, {"bucket_bytes": 1 << 20}),
    "SHARD_GRAD_OP + bf16": (
        {
            "strategy": fsdp_graph.ShardingStrategy.SHARD_GRAD_OP,
            "mixed_precision": fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        },
        {},
    ),
}


def train_both_with_options(rank: int, world: int) -> dict[str, tuple[dict, dict]]:
    """`train` without, then with, `reuse_blocks`, for each of OPTIONS."""
    return {
        label: tuple(train(rank, world, reuse, False, shard, backend) for reuse in (False, True))
        for label, (shard, backend) in OPTIONS.items()
    }
