"""Issue 35: torchtitan 0.3.0's expert-parallel recipe, its own `parallelize_qwen3` (experts as DTensors on its
"ep" mesh, token dispatch and combine by all-to-all with data-dependent split sizes, `torch._grouped_mm` in bf16,
then `apply_fsdp_to_decoder(..., ep_degree=2, edp_mesh=efsdp)`), with `fsdp_graph.fsdp2.fully_shard` in place of
torch's, trains as torchtitan with torch's FSDP2 + EP does: 4 gloo ranks (ep 2 x efsdp 2), SGD-with-momentum
steps whose routing differs, eager and compiled into one graph (fullgraph) in the same spawn; its DCP checkpoints
move to and from torch's FSDP2 + EP and to other EP degrees (1 and 4)."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.titan_ep import ep_recipes

# Qwen3's debugmodel_moe with 2 of its 8 layers (every layer is a MoE one) and experts of hidden size 32 instead of
# 768. "rows": its 64 experts (top-8 routing), 32 per ep rank, each ep piece sharded over efsdp by rows
# (64 >= ep x efsdp: torchtitan picks Shard(0)). "dim1": 2 experts (top-1), one per ep rank, which torchtitan shards
# over efsdp on dim 1 (2 < ep x efsdp: Shard(1)). "hsdp": dp_replicate 2 x dp_shard 2 with ep 2 (efsdp of one
# rank): the experts' HSDP mesh (dp_replicate, efsdp) beside the dense (dp_replicate, fsdp); eager only.
LAYERS, STEPS = 2, 5
CASES = {
    "rows": dict(layers=LAYERS, expert_hidden=32, steps=STEPS),
    "dim1": dict(layers=LAYERS, expert_hidden=32, steps=STEPS, experts=2, top_k=1),
    "hsdp": dict(layers=LAYERS, expert_hidden=32, steps=STEPS, replicate=2, modes=("eager",)),
}
EXPERTS_ON = {
    "rows": [(("efsdp", "ep"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))")],
    "dim1": [(("efsdp", "ep"), "(Shard(dim=1), Shard(dim=0))")],
    "hsdp": [(("dp_replicate", "efsdp", "ep"), "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))")],
}


def test_torchtitan_expert_parallel_matches_fsdp2(tmp_path):
    if (why := titan.available()) is not None:
        pytest.skip(why)
    for results in spawn(ep_recipes, 4, (2, CASES, ("rows", str(tmp_path), (1, 4)))):
        saved = results.pop("checkpoint")
        # DCP: saved at ep 2 (64 experts, trained, compiled), loaded by torch's FSDP2 + EP and by ours at ep 1 (plain
        # experts over the dense mesh) and ep 4 (efsdp of 1 rank); torch's FSDP2 + EP's checkpoint loaded by ours
        assert saved["ep1_experts_on"] == ("fsdp",) and saved["ep4_experts_on"] == ("efsdp", "ep"), saved
        assert max(v for k, v in saved.items() if not k.endswith("_on")) == 0.0, saved
        for case, r in results.items():
            modes = CASES[case].get("modes", ("eager", "compiled"))
            assert r["loss_moved"] > 0.0, (case, r)
            assert r["routing_changed"] == 1.0, (case, r)  # the steps route differently: no recompile allowed
            assert r["experts_on"] == EXPERTS_ON[case], (case, r)  # FSDP2's spmd mesh and placements
            for mode in modes:
                same = (r[f"{mode}_same_names"], r[f"{mode}_same_specs"], r[f"{mode}_routing_same"])
                assert same == (1.0, 1.0, 1.0), (case, mode, r)
                # measured: rows 1e-6 (losses) and 4e-7 (weights), eager and compiled; dim1 3e-6; hsdp 0
                assert r[f"{mode}_loss_diff"] < 1e-5 and r[f"{mode}_weight_diff"] < 1e-5, (case, mode, r)
                assert r[f"{mode}_buffer_diff"] == 0.0, (case, mode, r)  # the routed-token counts, exactly
            if "compiled" in modes:
                assert r["graphs"] == 1, r  # fullgraph, and no recompile across steps whose routing differs
                # forward: dispatch (counts, then tokens) and combine per MoE layer; backward: the tokens' two
                assert r["ep_all_to_alls"] == {"fw": 3 * LAYERS, "bw": 2 * LAYERS}, r
                assert r["ep_group_in_graphs"] == {"fw": True, "bw": True}, r
                assert r["ep_fingerprint"] == r["ep_all_to_alls"], r  # compared across ranks on the first call
                assert r["group_roles"] == ["efsdp", "ep", "fsdp"], r  # explain()'s bytes by group name these
