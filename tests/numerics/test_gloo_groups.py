"""Issue 10: the graph's collectives on gloo run on single-thread gloo groups (fsdp_graph.gloo), for every
strategy, and sharding again reuses them."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph.launch import spawn
from tests.models import OddMLP


def _threads(name: str) -> int:
    group = dist.distributed_c10d._resolve_process_group(name)
    return group._get_backend(torch.device("cpu")).options._threads


def _groups_of_each_strategy(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {"world_threads": _threads(dist.group.WORLD.group_name)}
    meshes = {
        "FULL_SHARD": None,
        "NO_SHARD": None,
        "HYBRID_SHARD": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }
    for name, mesh in meshes.items():
        names = set()
        for _ in range(2):  # sharding a second model reuses the groups of the first
            torch.manual_seed(0)
            model = fsdp_graph.fully_shard(
                OddMLP(), mesh=mesh, strategy=fsdp_graph.ShardingStrategy[name], separate_reduce_group=True
            )
            for state in model._fsdp_root.flat_params:
                names |= {state.group_name, state.replicate_group, state.reduce_group} - {""}
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
            model(x).sum().backward()  # the eager path runs the same ops on these groups
        out[name] = sorted(
            (dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(n)), _threads(n)) for n in names
        )
    return out


def test_graph_collectives_run_on_single_thread_gloo_groups():
    results = spawn(_groups_of_each_strategy, 4)
    for rank, r in enumerate(results):
        assert r["world_threads"] == 2, r  # the user's own group is left as it is
        assert r["FULL_SHARD"] == [([0, 1, 2, 3], 1), ([0, 1, 2, 3], 1)], r  # shard group + reduce duplicate
        assert r["NO_SHARD"] == [([0, 1, 2, 3], 1)], r
        row = [0, 1] if rank < 2 else [2, 3]
        column = [rank % 2, rank % 2 + 2]
        assert sorted(r["HYBRID_SHARD"]) == sorted([(row, 1), (row, 1), (column, 1)]), r
