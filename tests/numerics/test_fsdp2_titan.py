"""Issue 28: torchtitan 0.3.0's `apply_fsdp_to_decoder`, unmodified, with `fsdp_graph.fsdp2.fully_shard` in place
of torch's (the one-import change), trains as torchtitan with torch's FSDP2 does: 2 gloo ranks, SGD-with-momentum
steps, compiled into one graph (fullgraph). Issue 32: Qwen3's `debugmodel_moe` at its full depth, with the default
options (its 8 layers share one block body), both through that path and through `fsdp_graph.fully_shard(model)`:
its MoE layers count their tokens per expert in a buffer, in place, which the shared body must do exactly."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.fsdp2_titan import titan_parity

# Qwen3's debugmodel_moe has 64 experts of hidden size 768 in each of 8 layers (316 M parameters, 4 minutes here for
# 2 steps): its experts' hidden size 32 keeps the 8 layers, the 64 experts, the top-8 routing and the load-balancing
# buffers at 25 M parameters.
CASES = {
    "llama3": dict(family="llama3", flavor="debugmodel", steps=5, modes=("fsdp2",)),
    "qwen3_moe": dict(
        family="qwen3", flavor="debugmodel_moe", steps=2, expert_hidden=32, modes=("fsdp2", "native"), layers=8
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchtitan_apply_fsdp_matches_fsdp2(case):
    if (why := titan.available()) is not None:
        pytest.skip(why)
    c = CASES[case]
    args = (c["family"], c["flavor"], None, c["steps"], c.get("expert_hidden"), c["modes"])
    for r in spawn(titan_parity, 2, args):
        assert r["loss_moved"] > 0.0, r
        assert r["fsdp2_fsdp_modules"] == r["ref_fsdp_modules"], r
        for mode in c["modes"]:
            assert r[f"{mode}_graphs"] == 1.0, r
            assert r[f"{mode}_same_names"] == r[f"{mode}_same_shapes"] == r[f"{mode}_same_buffer_names"] == 1.0, r
            # measured: 0
            assert r[f"{mode}_loss_diff"] < 1e-5 and r[f"{mode}_weight_diff"] < 1e-5, (mode, r)
        if case == "qwen3_moe":
            assert r["tokens_counted"] > 0, r  # the MoE layers counted tokens in their buffers
            for mode in c["modes"]:
                assert r[f"{mode}_body_uses"] == [c["layers"]], (mode, r)  # all layers call one body
                assert r[f"{mode}_buffer_diff"] == 0.0, (mode, r)  # the counts as FSDP2's, exactly
