"""Issue 28: torchtitan 0.3.0's `apply_fsdp_to_decoder`, unmodified, with `fsdp_graph.fsdp2.fully_shard` in place
of torch's (the one-import change), trains as torchtitan with torch's FSDP2 does: 2 gloo ranks, SGD-with-momentum
steps, compiled into one graph (fullgraph). Issue 32: Qwen3's `debugmodel_moe` at its full depth, with the default
options (its 8 layers share one block body), both through that path and through `fsdp_graph.fully_shard(model)`:
its MoE layers count their tokens per expert in a buffer, in place, which the shared body must do exactly.
Issue 36: Llama3 and DeepSeek-V3 (6 layers: 1 dense, 5 MoE with MLA attention) keep a complex RoPE cache in every
layer, and their layers share a body too (`passes.materialize_conjugates`).
"""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.fsdp2_titan import titan_parity

# Qwen3's debugmodel_moe has 64 experts of hidden size 768 in each of 8 layers (316 M parameters, 4 minutes here for
# 2 steps): its experts' hidden size 32 keeps the 8 layers, the 64 experts, the top-8 routing and the load-balancing
# buffers at 25 M parameters.
CASES = {  # shared: how many layers call the one body the layers share
    "llama3": dict(family="llama3", flavor="debugmodel", steps=5, modes=("fsdp2", "native"), shared=6),
    # torchtitan's own path only: the native path of a complex body is Llama3's and tests/numerics/test_block_reuse.py's
    "deepseek_v3": dict(family="deepseek_v3", flavor="debugmodel", steps=3, modes=("fsdp2",), shared=5),
    "qwen3_moe": dict(
        family="qwen3",
        flavor="debugmodel_moe",
        steps=2,
        expert_hidden=32,
        modes=("fsdp2", "native"),
        layers=8,
        shared=8,
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
            # the layers call one body; a unit of its own structure (the embedding) calls one of its own
            assert max(r[f"{mode}_body_uses"]) == c["shared"] and set(r[f"{mode}_body_uses"]) <= {1, c["shared"]}, r
            assert r[f"{mode}_buffer_diff"] == 0.0, (mode, r)  # MoE's token counts as FSDP2's, exactly
        if case != "llama3":
            assert r["tokens_counted"] > 0, r  # the MoE layers counted tokens in their buffers
        if case == "qwen3_moe":
            for mode in c["modes"]:
                assert r[f"{mode}_body_uses"] == [c["layers"]], (mode, r)  # all layers call one body
