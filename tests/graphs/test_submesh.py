"""fully_shard over named dimensions of a larger mesh (issue 14), graph shapes on fake process groups."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp_graph
from fsdp_graph.runtime.unit import flat_params
from tests.graphs.capture import TwoBlock


def _fingerprint(model, mesh, strategy: str = "FULL_SHARD") -> list[str]:
    torch._dynamo.reset()
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    fsdp_graph.fully_shard(model, mesh, strategy=fsdp_graph.ShardingStrategy[strategy], reuse_blocks=False)
    backend = fsdp_graph.make_backend(inductor=False)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 4)).sum().backward()
    assert backend.dynamo_graphs == 1
    return [f"{r.stage}: {line}" for r in backend.reports for line in r.fingerprint]


def _group_ranks(name: str) -> list[int]:
    return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))


def test_dp_dimension_of_a_2d_mesh_gathers_over_that_dimension(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TwoBlock()
    lines = _fingerprint(model, mesh["dp"])  # 3 gathers, 2 re-gathers (not blocks.0: x needs no grad), 3 scatters
    assert len(lines) == 8 and all("group_size=2," in line for line in lines), lines
    state = flat_params(model)[0]
    assert (state.world, _group_ranks(state.group_name)) == (2, [0, 2])  # rank 0's dp group: column 0 of [[0,1],[2,3]]


def test_hybrid_over_two_dimensions_of_a_3d_mesh(fake_world_8):
    """HSDP x TP's data-parallel part: HYBRID_SHARD over mesh["replicate", "shard"] of (2, 2, 2); rank 5 is at
    (1, 0, 1), so it shards over [5, 7] and all-reduces over [1, 5]."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = TwoBlock()
    lines = _fingerprint(model, mesh["replicate", "shard"], "HYBRID_SHARD")
    assert sum("all_reduce" in line for line in lines) == 3, lines
    assert all("group_size=2," in line for line in lines if "all_reduce" not in line), lines
    state = flat_params(model)[0]
    assert _group_ranks(state.group_name) == [5, 7] and _group_ranks(state.replicate_group) == [1, 5]
    assert (state.world, state.replicate_world) == (2, 2)


def test_error_mesh_over_part_of_the_world_not_a_named_dimension(fake_pg):
    with pytest.raises(ValueError, match=r'mesh has 2 ranks but the process group has 4.*\["dp"\]'):
        fsdp_graph.fully_shard(TwoBlock(), DeviceMesh("cpu", torch.arange(2), _init_backend=False))


def test_unflattened_and_flattened_views_of_a_world_mesh(fake_world_8):
    """Issue 35: torchtitan's `ParallelDims` makes every mesh as an `_unflatten`ed (or flattened) view of a 1-D world
    mesh, whose names are not the root's. Rank 5 at (dp_replicate, fsdp, tp) = (1, 0, 1) of (2, 2, 2): its fsdp
    group is [5, 7], its replicate group [1, 5], and the flattened (fsdp, tp) group [4, 5, 6, 7]."""
    world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (2, 2, 2), ("dp_replicate", "fsdp", "tp"))
    for mesh, strategy, shard, replicate in [
        (dense["fsdp"], "FULL_SHARD", [5, 7], None),
        (dense["dp_replicate", "fsdp"], "HYBRID_SHARD", [5, 7], [1, 5]),
        (dense["fsdp", "tp"]._flatten("fsdp_tp"), "FULL_SHARD", [4, 5, 6, 7], None),
    ]:
        model = TwoBlock()
        if strategy == "HYBRID_SHARD":  # one compile: the groups below are what the graphs' collectives use
            lines = _fingerprint(model, mesh, strategy)
            assert sum("all_reduce" in line for line in lines) == 3, lines
            assert all("group_size=2," in line for line in lines if "all_reduce" not in line), lines
        else:
            fsdp_graph.fully_shard(model, mesh, reuse_blocks=False)
        state = flat_params(model)[0]
        assert _group_ranks(state.group_name) == shard, mesh
        assert (state.replicate_world > 1) == (replicate is not None)
        if replicate is not None:
            assert _group_ranks(state.replicate_group) == replicate


def test_groups_are_named_alike_on_every_rank_and_never_re_pointed(fake_pg):
    """Where a mesh dimension has several groups, the name fully_shard's graphs use is an alias of this rank's group
    (`groups.rank_independent_name`): a function of the partition, not of the rank, resolving to this rank's group.
    A second mesh of the same shape gets its own alias (the first keeps resolving to its group); a group alone in its
    partition keeps its own name."""
    from fsdp_graph.api.groups import resolve_groups

    hybrid = fsdp_graph.ShardingStrategy.HYBRID_SHARD
    first, second = (init_device_mesh("cpu", (2, 2)) for _ in range(2))
    a, b = resolve_groups(first, hybrid), resolve_groups(second, hybrid)
    assert a.shard_name.startswith("fsdp_graph:shard:") and a.replicate_name.startswith("fsdp_graph:replicate:"), a
    assert resolve_groups(first, hybrid) == a  # the same groups, the same names
    assert b.shard_name == f"{a.shard_name}:1" and b.replicate_name == f"{a.replicate_name}:1", (a, b)
    for groups, mesh in ((a, first), (b, second)):
        resolve = dist.distributed_c10d._resolve_process_group
        assert resolve(groups.shard_name) is mesh.get_group(1) and resolve(groups.replicate_name) is mesh.get_group(0)
    assert _group_ranks(a.shard_name) == [0, 1] and _group_ranks(a.replicate_name) == [0, 2]
    world = resolve_groups(None, fsdp_graph.ShardingStrategy.FULL_SHARD)
    assert world.shard_name == dist.group.WORLD.group_name, world
