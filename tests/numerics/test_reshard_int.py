"""`reshard_after_forward=2` on 4 gloo ranks: parity with single-process training (SGD with momentum), eager and
compiled, both layouts and the per-unit form; and the backward gathers only within node groups (pairs of ranks)."""

from fsdp_graph.train.launch import spawn
from tests.workers.reshard_int import reshard_int
from tests.workers.training import Case

TOL = 2e-5  # as tests/numerics/test_strategies.py: fp32, 5 steps


def test_reshard_after_forward_int_parity_and_groups():
    cases = [
        Case("gpt", "sgd", reshard="int2"),
        Case("gpt", "sgd", reshard="int2", mode="eager"),
        Case("gpt", "sgd", reshard="int2", layout="rows"),
        Case("gpt", "sgd", reshard="int2", layout="rows", mode="eager"),
        Case("gpt", "sgd", reshard="int2_root", steps=3),
    ]
    results = spawn(reshard_int, 4, (cases,))
    for rank_result in results:
        for r in rank_result["cases"]:
            loss_gap = max(abs(a - b) for a, b in zip(r.losses, r.ref_losses))
            assert r.max_param_diff < TOL and loss_gap < TOL, (r.case, r.max_param_diff, loss_gap)
            assert r.param_change > 1e-3, (r.case, r.param_change)
    compiled = results[0]["cases"][0]
    fw, bw = compiled.reports
    units = len({unit for _, unit in fw.collectives.units})
    assert fw.collectives.counts == {"all_gather": 2 * units}  # the piece, then the pieces
    # The backward re-gathers (pieces only, over pairs) the units whose weights it reads, and reduces every unit.
    assert bw.collectives.counts["all_to_all"] == units and 0 < bw.collectives.counts["all_gather"] <= units
    for mode in ("aot", "eager"):
        for rank_result in results:
            g = rank_result["groups"][mode]
            assert g["uniform"], (mode, g)
            n = g["flat_params"]
            # Forward: each flat parameter gathers its piece over the strided pair and the pieces over the node pair.
            assert g["fw"] == {"piece": n, "node": n, "shard": 0}, (mode, g)
            assert g["fw_kinds"] == {"all_gather": 2 * n}, (mode, g)
            # Backward: gathers within the node group only, the reductions over the whole shard group of 4.
            regathers = g["bw_kinds"]["all_gather"]
            assert 0 < regathers <= n and g["bw"] == {"piece": 0, "node": regathers, "shard": n}, (mode, g)
            assert g["bw_kinds"] == {"all_gather": regathers, "all_to_all": n}, (mode, g)
