"""Issue 35: torchtitan 0.3.0's expert-parallel recipe, its own `parallelize_qwen3` (experts as DTensors on its
"ep" mesh, token dispatch and combine by all-to-all with data-dependent split sizes, `torch._grouped_mm` in bf16,
then `apply_fsdp_to_decoder(..., ep_degree=2, edp_mesh=efsdp)`), with `fsdp_graph.fsdp2.fully_shard` in place of
torch's, trains as torchtitan with torch's FSDP2 + EP does: 4 gloo ranks (ep 2 x efsdp 2), SGD-with-momentum
steps whose routing differs, eager and compiled into one graph (fullgraph) in the same spawn."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.titan_ep import ep_parity

# Qwen3's debugmodel_moe, 2 of its 8 layers (every layer is a MoE one), its 64 experts (top-8 routing) of hidden
# size 32 instead of 768: 16 experts per ep rank, each sharded over efsdp by rows (64 >= ep x efsdp: Shard(0)).
LAYERS, EXPERT_HIDDEN, STEPS = 2, 32, 5


def test_torchtitan_expert_parallel_matches_fsdp2():
    if (why := titan.available()) is not None:
        pytest.skip(why)
    for r in spawn(ep_parity, 4, (2, LAYERS, EXPERT_HIDDEN, STEPS)):
        assert r["loss_moved"] > 0.0, r
        assert r["routing_changed"] == 1.0, r  # the steps route differently: the compiled graph must not recompile
        # FSDP2's spmd mesh for the experts: efsdp then ep, rows of each ep piece
        assert r["experts_on"] == [(("efsdp", "ep"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))")], r
        for mode in ("eager", "compiled"):
            assert r[f"{mode}_same_names"] == r[f"{mode}_same_specs"] == r[f"{mode}_routing_same"] == 1.0, (mode, r)
            # measured: eager 5e-7, compiled 5e-7 (loss); weights 0 / ~1e-8
            assert r[f"{mode}_loss_diff"] < 1e-5 and r[f"{mode}_weight_diff"] < 1e-5, (mode, r)
            assert r[f"{mode}_buffer_diff"] == 0.0, (mode, r)  # the routed-token counts as FSDP2's, exactly
        assert r["graphs"] == 1, r  # fullgraph, and no recompile across steps whose routing differs
        # dispatch: counts + tokens, combine: tokens, per MoE layer; backward: the tokens' two, reversed
        assert r["ep_all_to_alls"] == {"fw": 3 * LAYERS, "bw": 2 * LAYERS}, r
        assert r["ep_group_in_graphs"] == {"fw": True, "bw": True}, r
