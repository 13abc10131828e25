"""Rank-side workers for `fully_shard(separate_reduce_group=...)`: which process groups it creates, and how."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_graph
from fsdp_graph.api import groups


def reduce_groups(rank: int, world: int, scenarios: list[tuple[str, bool | None, bool]]) -> list[dict]:
    """`_reduce_groups` for each (strategy, separate, split), in order, on fresh models."""
    return [_reduce_groups(*scenario) for scenario in scenarios]


def _reduce_groups(strategy: str, separate: bool | None, split: bool) -> dict:
    """Shard a two-unit model and report, per flat parameter, the ranks of its shard and reduce groups, plus every
    `new_group` / `split_group` call this rank made. `separate=None` leaves the option at its default. `split=True`
    pretends the backend can split (as NCCL with a bound device): `split_group` is recorded and then served by an
    equivalent `new_group`, because gloo on CPU cannot split."""
    from torch.distributed.device_mesh import init_device_mesh

    strategy = fsdp_graph.ShardingStrategy[strategy]
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2)) if strategy.is_hybrid else None
    calls: list[tuple] = []
    new_group = dist.new_group

    def record_new_group(ranks, **kwargs):
        calls.append(("new_group", list(ranks), kwargs.get("use_local_synchronization", False)))
        return new_group(ranks, **kwargs)

    def record_split(parent_pg, split_ranks, **kwargs):
        calls.append(("split_group", dist.get_process_group_ranks(parent_pg), split_ranks))
        ranks = [dist.get_global_rank(parent_pg, r) for r in split_ranks[0]]
        return new_group(ranks, use_local_synchronization=True)

    groups.resolve_groups(mesh, strategy)  # the single-thread gloo copies of the shard groups (made once, then reused)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    options = {} if separate is None else {"separate_reduce_group": separate}
    with (
        mock.patch.object(dist, "new_group", record_new_group),
        mock.patch.object(dist, "split_group", record_split),
        mock.patch.object(groups, "_splittable", lambda pg: split),
    ):
        fsdp_graph.fully_shard(model, mesh=mesh, strategy=strategy, wrap=[model[0]], **options)
    resolve = dist.distributed_c10d._resolve_process_group
    states = model._fsdp_root.flat_params
    return {
        "shard_ranks": [dist.get_process_group_ranks(resolve(s.group_name)) for s in states],
        "reduce_ranks": [
            dist.get_process_group_ranks(resolve(s.reduce_group)) if s.reduce_group else None for s in states
        ],
        "same_name": [s.reduce_group == s.group_name for s in states],
        "calls": calls,
    }
