"""Issue 14: fully_shard over named dimensions of a larger mesh, on 4 gloo ranks."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.submesh import dp_submesh_parity


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_fully_shard_over_the_dp_dimension_of_a_2d_mesh(mode):
    results = spawn(dp_submesh_parity, 4, (mode,))
    assert sorted(r["other"] for r in results) == [0.0, 0.0, 1.0, 1.0]
    for r in results:
        assert r["max_diff"] < 1e-6 and r["placements_on_dp"] == 1.0, r
        assert r["all_gathers"] == 13.0, r  # FULL_SHARD: 7 units in forward, 6 re-gathered in backward
        if mode == "aot":
            assert r["graphs"] == 1.0, r
