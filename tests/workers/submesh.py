"""Rank-side workers for FSDP over part of a larger mesh (issue 14): `fully_shard(model, world_mesh["dp"])`."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from tests.workers.eager_reshard import DeepMLP


def dp_submesh_parity(rank: int, world: int, mode: str) -> dict[str, float]:
    """A (dp=2, other=2) mesh of 4 ranks: the model is sharded over `mesh["dp"]` only, so the two dp groups
    (ranks {0, 2} and {1, 3}) are two independent data-parallel runs, each on its own data (seeded by the other
    coordinate, as tensor- or pipeline-parallel peers would be). Each must equal single-process SGD with momentum on
    its group's global batch (a reduction over all 4 ranks would mix the groups' gradients and fail that)."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "other"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    other = mesh["other"].get_local_rank()
    torch.manual_seed(0)
    model = DeepMLP()
    ref = copy.deepcopy(model)
    # without shared block bodies: a shared body re-gathers the first block in backward too (its input needs no
    # gradient, which one body for all blocks cannot know); the test counts the collectives of the submesh
    fsdp_graph.fully_shard(model, mesh["dp"], reuse_blocks=False)
    run = model
    backend = None
    if mode != "eager":
        backend = fsdp_graph.make_backend(inductor=False)
        run = torch.compile(model, backend=backend, fullgraph=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    gen = torch.Generator().manual_seed(100 + other)
    out: dict[str, float] = {"other": float(other)}
    for step in range(4):
        x, y = torch.randn(4 * dp_size, 256, generator=gen), torch.randn(4 * dp_size, 1, generator=gen)

        def train_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            nn.functional.mse_loss(run(x.chunk(dp_size)[dp_rank]), y.chunk(dp_size)[dp_rank]).backward()

        if step == 2:
            out["all_gathers"] = float(executed_collectives(train_step).counts["all_gather"])
        else:
            train_step()
        nn.functional.mse_loss(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    state = model.state_dict()
    out["placements_on_dp"] = float(all(v.device_mesh == mesh["dp"] for v in state.values()))
    out["max_diff"] = max((state[n].full_tensor() - p).abs().max().item() for n, p in ref.named_parameters())
    out["graphs"] = float(backend.dynamo_graphs if backend else 0)
    return out
