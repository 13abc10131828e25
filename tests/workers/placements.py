"""Models and meshes for the placement tests (issue 35): a mixture-of-experts block whose experts are one 3-D
parameter per projection (torchtitan's grouped experts, computed densely here: every token through every expert,
weighted by its router), and torchtitan-style meshes, every one an `_unflatten`ed view of a 1-D world mesh."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard


class Experts(nn.Module):
    """`num_experts` two-layer MLPs as [E, dim, hidden] and [E, hidden, dim] parameters (torchtitan's layout)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) / hidden**0.5)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        inner = torch.relu(torch.einsum("bd,edh->beh", h, self.w1))
        return (gate.unsqueeze(-1) * torch.einsum("beh,ehd->bed", inner, self.w2)).sum(1)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.experts(h, torch.softmax(self.router(h), dim=-1))


class MoEModel(nn.Module):
    def __init__(self, dim: int = 8, num_experts: int = 4, hidden: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(MoEBlock(dim, num_experts, hidden) for _ in range(depth))
        self.head = nn.Linear(dim, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def titan_meshes(world: int, ep: int, device: str = "cpu") -> tuple[DeviceMesh, DeviceMesh]:
    """(fsdp, efsdp): torchtitan's dense FSDP mesh over every rank and its expert FSDP mesh over world / ep ranks,
    both `_unflatten`ed from a 1-D world mesh as `ParallelDims.build_mesh` makes them."""
    world_mesh = init_device_mesh(device, (world,), mesh_dim_names=("world",))
    dense = world_mesh._unflatten(0, (world,), ("fsdp",))
    sparse = world_mesh._unflatten(0, (world // ep, ep), ("efsdp", "ep"))
    return dense["fsdp"], sparse["efsdp"]


def expert_placement(model: nn.Module, mesh_size: int) -> Shard:
    """torchtitan's choice: `Shard(1)` when the mesh has more ranks than there are experts, else `Shard(0)`."""
    experts = next(m for m in model.modules() if isinstance(m, Experts))
    return Shard(1) if mesh_size > experts.num_experts else Shard(0)


def shard_moe_fsdp2(model: MoEModel, fully_shard, fsdp_mesh, efsdp_mesh=None, expert_dim: Shard | None = None):
    """torchtitan's `apply_fsdp_to_decoder` calls on `model`, with `fully_shard` being torch's or fsdp_graph's
    `fsdp2.fully_shard`: each block one call whose `shard_placement_fn` puts the experts on `efsdp_mesh` (a
    `ShardPlacementResult`, torch's own mesh info) or, without one, on `expert_dim` of the dense mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    for layer in model.layers:
        experts = set(layer.experts.parameters())
        if efsdp_mesh is not None:
            placement = expert_dim or expert_placement(model, efsdp_mesh.size())
            dense_info, expert_info = (
                FSDPMeshInfo(fsdp_mesh, shard_mesh_dim=0),
                FSDPMeshInfo(efsdp_mesh, shard_mesh_dim=0),
            )

            def place(p, experts=experts, placement=placement, dense_info=dense_info, expert_info=expert_info):
                if p in experts:
                    return ShardPlacementResult(placement=placement, mesh_info=expert_info)
                return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)
        else:

            def place(p, experts=experts, placement=expert_dim):
                return placement if p in experts else None

        fully_shard(layer, mesh=fsdp_mesh, shard_placement_fn=place)
    fully_shard(model, mesh=fsdp_mesh)
    return model
