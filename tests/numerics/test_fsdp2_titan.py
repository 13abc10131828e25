"""Issue 28: torchtitan 0.3.0's `apply_fsdp_to_decoder`, unmodified, with `fsdp_graph.fsdp2.fully_shard` in place
of torch's (the one-import change), trains as torchtitan with torch's FSDP2 does: 2 gloo ranks, 5 SGD-with-momentum
steps, compiled into one graph (fullgraph)."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.fsdp2_titan import titan_parity


# Qwen3's debugmodel_moe has 64 experts in each of 8 layers (316 M parameters): its first layer keeps the suite short.
@pytest.mark.parametrize("family, flavor, layers", [("llama3", "debugmodel", None), ("qwen3", "debugmodel_moe", 1)])
def test_torchtitan_apply_fsdp_matches_fsdp2(family, flavor, layers):
    if (why := titan.available()) is not None:
        pytest.skip(why)
    for r in spawn(titan_parity, 2, (family, flavor, layers)):
        assert r["loss_moved"] > 0.0, r
        assert r["compiled_fsdp_modules"] == r["ref_fsdp_modules"], r
        assert r["graphs"] == 1.0, r
        assert r["compiled_same_names"] == r["compiled_same_shapes"] == 1.0, r
        assert r["compiled_loss_diff"] < 1e-5 and r["compiled_weight_diff"] < 1e-5, r  # measured: 0
