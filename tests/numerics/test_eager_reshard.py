"""Issue 12: eager FULL_SHARD frees each unit's gathered parameters after its forward and gathers them again in its
backward (FSDP's memory), SHARD_GRAD_OP keeps them; both train as single-process SGD does."""

from fsdp_graph.train.launch import spawn
from tests.workers.eager_reshard import BLOCKS, eager_reshard_parity, unit_bytes

UNITS = BLOCKS + 1  # the blocks and the root (the head)


def test_eager_full_shard_regathers_in_backward_and_saves_memory():
    results = {s: spawn(eager_reshard_parity, 2, (s,)) for s in ("FULL_SHARD", "SHARD_GRAD_OP")}
    for strategy, ranks in results.items():
        for r in ranks:
            assert r["param_diff"] < 1e-5 and r["moved"] > 1e-2, (strategy, r)
            # FULL_SHARD re-gathers in backward every unit whose parameters autograd saved: all but blocks.0 (its
            # input needs no gradient, so its weight is not saved)
            assert r["all_gathers"] == (2 * UNITS - 1 if strategy == "FULL_SHARD" else UNITS), (strategy, r)
    for full_shard, zero2 in zip(results["FULL_SHARD"], results["SHARD_GRAD_OP"]):
        saved = {k: (zero2[k] - full_shard[k]) / unit_bytes() for k in ("forward_peak_bytes", "step_peak_bytes")}
        print(f"units of memory saved by eager FULL_SHARD over SHARD_GRAD_OP: {saved}, {full_shard}, {zero2}")
        # SHARD_GRAD_OP keeps every block gathered from its forward to its backward; FULL_SHARD holds the root
        # and the block computing (forward), or one block's re-gather, full gradient and reduction (backward).
        # Measured 5 blocks less in forward and 4 over the step (each the least of 5 steps: gloo lets go of a
        # finished collective's buffers a moment late); each bound leaves slack.
        assert saved["forward_peak_bytes"] >= BLOCKS - 2.5, saved
        assert saved["step_peak_bytes"] >= BLOCKS - 3.5, saved
