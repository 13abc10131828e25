"""`reshard_after_forward=2` on 4 gloo ranks: parity with single-process training (SGD with momentum), eager and
compiled (flat: compiled only), both layouts and the per-unit form; the backward gathers only within node groups (pairs of ranks); and
the bytes each rank sends per group, against `reshard_after_forward=True`."""

from fsdp_graph.train.launch import spawn
from tests.workers.reshard_int import reshard_int
from tests.workers.training import Case

TOL = 2e-5  # as tests/numerics/test_strategies.py: fp32, 5 steps


def test_reshard_after_forward_int_parity_and_groups():
    cases = [
        Case(
            "gpt", "sgd", reshard="int2"
        ),  # the default layout, rows (flat's pieces: tests/graphs/test_reshard_int.py)
        Case("gpt", "sgd", reshard="int2", mode="eager"),
        Case("gpt", "sgd", reshard="int2_root", steps=3),
    ]
    results = spawn(reshard_int, 4, (cases,))
    # The shard group is made once (world-wide); the piece and node groups by their members only, on real gloo.
    assert [r["counter_moves"] for r in results] == [[1, 0, 0]] * 4, results[0]["counter_moves"]
    for rank_result in results:
        for r in rank_result["cases"]:
            loss_gap = max(abs(a - b) for a, b in zip(r.losses, r.ref_losses))
            assert r.max_param_diff < TOL and loss_gap < TOL, (r.case, r.max_param_diff, loss_gap)
            assert r.param_change > 1e-3, (r.case, r.param_change)
    compiled = results[0]["cases"][0]
    fw, bw = compiled.reports
    units = len({unit for _, unit in fw.collectives.units})
    assert fw.collectives.counts == {"all_gather": 2 * units}  # the piece, then the pieces
    # The backward re-gathers (pieces only, over pairs) every unit (the test GPT's backward reads every unit's
    # weights: the first block's input is the embedding's output) and reduces every unit.
    assert bw.collectives.counts == {"all_gather": units, "all_to_all": units}
    for mode in ("aot", "eager"):
        for rank_result in results:
            g = rank_result["groups"][mode]
            assert g["uniform"], (mode, g)
            n = g["flat_params"]
            # Forward: each flat parameter gathers its piece over the strided pair and the pieces over the node pair.
            assert g["fw"] == {"piece": n, "node": n, "shard": 0}, (mode, g)
            assert g["fw_kinds"] == {"all_gather": 2 * n}, (mode, g)
            # Backward: gathers within the node group only, the reductions over the whole shard group of 4.
            assert g["bw"] == {"piece": 0, "node": n, "shard": n}, (mode, g)
            assert g["bw_kinds"] == {"all_gather": n, "all_to_all": n}, (mode, g)
    for rank_result in results:
        # Bytes sent per group (eager; the compiled graphs run the same collectives). fp32 over 4 ranks: a rank's
        # shards of the P padded elements are P bytes. k=2: the piece (P) over the strided pair, the pieces (2P)
        # over the node pair, the backward's 2P within the node; True: 3P over all 4 ranks, forward and backward.
        g, whole = rank_result["groups"]["eager"], rank_result["whole"]
        p = g["padded_numel"]
        assert g["fw_bytes"] == {"piece": {"all_gather": p}, "node": {"all_gather": 2 * p}, "shard": {}}, g
        assert g["bw_bytes"] == {"piece": {}, "node": {"all_gather": 2 * p}, "shard": {"all_to_all": 3 * p}}, g
        assert whole["padded_numel"] == p and whole["fw"] == {"piece": 0, "node": 0, "shard": 3}, whole
        assert whole["fw_bytes"]["shard"] == {"all_gather": 3 * p}, whole
        assert whole["bw_bytes"]["shard"] == {"all_gather": 3 * p, "all_to_all": 3 * p}, whole
