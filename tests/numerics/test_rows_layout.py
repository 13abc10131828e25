"""`fully_shard(layout="rows")` (issue 13 item 1): optimizers see FSDP2's Shard(0) row blocks, on 2 gloo ranks."""

import pytest
import torch

from fsdp_graph.train.launch import spawn
from tests.workers.rows import reference, train_rows

WORLD = 2


def _local_rows(d0: int, rank: int) -> int:
    rows = -(-d0 // WORLD)
    return max(0, min(rows, d0 - rank * rows))


@pytest.mark.parametrize("mode", ["eager", "compiled", "bucketed"])
def test_rows_layout_trains_like_one_process(mode):
    ref = reference(WORLD)
    results = spawn(train_rows, WORLD, (mode,))
    for rank, r in enumerate(results):
        # The optimizer holds each parameter's row block with its original ndim and trailing dims; the second
        # rank holds no row of the 1-row gate (and an empty piece of its bias).
        for name, full in ref["params"].items():
            shape, ndim = r["shapes"][name] if name in r["shapes"] else r["shapes"]["emb.weight"]
            assert ndim == full.ndim, name
            assert shape == (_local_rows(full.shape[0], rank), *full.shape[1:]), (name, shape)
        assert r["shapes"]["blocks.0.gate.weight"][0] == ((1, 6) if rank == 0 else (0, 6))
        assert r["groups"] == ref["groups"] == [7, 8]  # weight decay on the matrices only, as in one process
        assert r["is_shard0"] and r["full_shapes"] == {k: tuple(v.shape) for k, v in ref["params"].items()}
        for name, value in ref["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-6, atol=1e-6, msg=name)
        for name, value in ref["momentum"].items():
            torch.testing.assert_close(r["momentum"][name], value, rtol=1e-6, atol=1e-6, msg=name)
        assert r["state_dict_gathers"] == 0  # the views are the Shard(0) locals: nothing moves
        assert r["round_trip"] == 0.0


def test_flat_layout_state_dict_gathers():
    """The same measurement sees the flat layout's gathers (so the rows assertion above can fail)."""
    for r in spawn(train_rows, WORLD, ("eager", "flat")):
        assert r["state_dict_gathers"] > 0
        assert r["shapes"]["blocks.0.fc1.weight"][1] == 1  # 1-D slices: the ndim grouping breaks
