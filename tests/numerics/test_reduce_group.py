"""`fully_shard(separate_reduce_group=...)` on gloo ranks: off by default; when on, one duplicate of this rank's
shard group, created by the shard group's members only (HYBRID: no world-wide groups)."""

import inspect

import fsdp_graph
from fsdp_graph.train.launch import spawn
from tests.workers.groups import reduce_groups


def test_default_off_and_opt_in_duplicates_the_shard_group():
    assert inspect.signature(fsdp_graph.fully_shard).parameters["separate_reduce_group"].default is False
    scenarios = [("FULL_SHARD", None, False), ("FULL_SHARD", True, False), ("FULL_SHARD", True, True)]
    for rank, (default, opt_in, split) in enumerate(spawn(reduce_groups, 2, (scenarios,))):
        assert default["reduce_ranks"] == [None, None] and default["calls"] == [], default
        for r in (opt_in, split):
            assert r["shard_ranks"] == [[0, 1], [0, 1]], r
            assert r["reduce_ranks"] == [[0, 1], [0, 1]] and r["same_name"] == [False, False], r
        # one group for the whole model, not one per unit; split from the shard group with its group-local ranks
        assert opt_in["calls"] == [("new_group", [0, 1], True)], (rank, opt_in)
        assert split["calls"] == [("split_group", [0, 1], [[0, 1]])], (rank, split)


def test_hybrid_duplicates_each_replica_shard_group_locally():
    # mesh (replicate=2, shard=2): ranks {0, 1} and {2, 3} shard; each rank makes only its own row's duplicate
    for rank, (r,) in enumerate(spawn(reduce_groups, 4, ([("HYBRID_SHARD", True, False)],))):
        row = [0, 1] if rank < 2 else [2, 3]
        assert r["shard_ranks"] == [row, row] and r["reduce_ranks"] == [row, row], (rank, r)
        assert r["same_name"] == [False, False], (rank, r)
        assert r["calls"] == [("new_group", row, True)], (rank, r)
