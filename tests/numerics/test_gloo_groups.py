"""Issue 10: the graph's collectives on gloo run on single-thread gloo groups (fsdp_graph.runtime.gloo), for every
strategy, and sharding again reuses them."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph.train.launch import GLOO_THREADS_ENV, spawn
from tests.workers.models import OddMLP


def _threads(name: str) -> tuple[int, float]:
    """(worker threads, collective timeout in seconds) of a group's gloo backend."""
    options = dist.distributed_c10d._resolve_process_group(name)._get_backend(torch.device("cpu")).options
    return options._threads, options._timeout.total_seconds()


def _groups_of_each_strategy(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {"world_threads": _threads(dist.group.WORLD.group_name)}
    meshes = {
        "FULL_SHARD": None,
        "NO_SHARD": None,
        "HYBRID_SHARD": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }
    out["mesh_groups"] = {_threads(g.group_name) for g in meshes["HYBRID_SHARD"].get_all_groups()}
    for name, mesh in meshes.items():
        names = set()
        for i in range(2):  # sharding a second model reuses the shard groups of the first
            torch.manual_seed(0)
            strategy = fsdp_graph.ShardingStrategy[name]
            model = fsdp_graph.fully_shard(OddMLP(), mesh=mesh, strategy=strategy, separate_reduce_group=i == 0)
            for state in model._fsdp_root.flat_params:
                names |= {state.group_name, state.replicate_group, state.reduce_group} - {""}
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
            model(x).sum().backward()  # the eager path runs the same ops on these groups
        out[name] = sorted(
            (dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(n)), _threads(n)) for n in names
        )
    return out


def test_graph_collectives_run_on_single_thread_gloo_groups(monkeypatch):
    """Each copy has one worker thread and keeps the timeout of the group it copies (spawn's 77 s for the world
    group here, not new_group's 30 minutes: a hung peer must end the run as soon as the user asked). The ranks'
    own groups get the launcher's FSDP_GRAPH_GLOO_THREADS (3 here; the suite runs with 1), and keep it."""
    one = (1, 77.0)
    monkeypatch.setenv(GLOO_THREADS_ENV, "3")
    results = spawn(_groups_of_each_strategy, 4, timeout_s=77.0)
    for rank, r in enumerate(results):
        assert r["world_threads"] == (3, 77.0), r  # the user's own group is left as it is
        assert r["FULL_SHARD"] == [([0, 1, 2, 3], one), ([0, 1, 2, 3], one)], r  # shard group + reduce duplicate
        assert r["NO_SHARD"] == [([0, 1, 2, 3], one)], r
        row = [0, 1] if rank < 2 else [2, 3]
        column = [rank % 2, rank % 2 + 2]
        ((mesh_threads, mesh_timeout),) = r["mesh_groups"]  # DeviceMesh's groups carry their own timeout
        assert mesh_threads == 3, r
        mesh_one = (1, mesh_timeout)
        assert sorted(r["HYBRID_SHARD"]) == sorted([(row, mesh_one), (row, mesh_one), (column, mesh_one)]), r
