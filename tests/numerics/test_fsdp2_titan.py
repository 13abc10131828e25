"""Issue 28: torchtitan 0.3.0's `apply_fsdp_to_decoder`, unmodified, with `fsdp_graph.fsdp2.fully_shard` in place
of torch's (the one-import change), trains as torchtitan with torch's FSDP2 does: 2 gloo ranks, 5 SGD-with-momentum
steps, compiled into one graph (fullgraph)."""

import os

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.fsdp2_titan import titan_parity

_MOE = pytest.param(
    "qwen3",
    "debugmodel_moe",
    # Passes (measured: 223 s on 2 CPU ranks, most of it the MoE's experts on CPU): too long for the suite.
    marks=pytest.mark.skipif(not os.environ.get("FSDP_GRAPH_MOE_PARITY"), reason="4 min; FSDP_GRAPH_MOE_PARITY=1"),
)


@pytest.mark.parametrize("family, flavor", [("llama3", "debugmodel"), _MOE])
def test_torchtitan_apply_fsdp_matches_fsdp2(family, flavor):
    if (why := titan.available()) is not None:
        pytest.skip(why)
    for r in spawn(titan_parity, 2, (family, flavor)):
        assert r["loss_moved"] > 0.0, r
        assert r["compiled_fsdp_modules"] == r["ref_fsdp_modules"], r
        assert r["graphs"] == 1.0, r
        assert r["compiled_same_names"] == r["compiled_same_shapes"] == 1.0, r
        assert r["compiled_loss_diff"] < 1e-5 and r["compiled_weight_diff"] < 1e-5, r  # measured: 0
