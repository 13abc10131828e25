"""`make_backend(bucket_bytes=...)` on 2 gloo ranks: fewer collectives, the same numbers."""

from fsdp_graph.train.launch import spawn
from tests.numerics.test_strategies import BF16_TOL, FP32_TOL
from tests.workers.training import Case, run_cases

# The test GPT's units at 2 ranks in fp32: root 14.6 KB, each block 50.4 KB. 100 KB puts the root with the block
# next to it in graph order and leaves the other block alone (a bucket and a boundary in each graph).
PARTIAL = 100_000
EVERYTHING = 1 << 20


def _totals(result) -> dict[str, int]:
    return {r.stage: sum(r.collectives.counts.values()) for r in result.reports}


def test_bucketed_training_matches_single_process_and_unbucketed():
    plain, partial, merged = spawn(
        run_cases,
        2,
        (
            [
                Case("gpt", "adamw"),
                Case("gpt", "adamw", bucket_bytes=PARTIAL),
                Case("gpt", "sgd", "SHARD_GRAD_OP", mp=True, bucket_bytes=EVERYTHING),
            ],
        ),
    )[0]
    for r, tol, loss_tol in ((partial, FP32_TOL, FP32_TOL), (merged, BF16_TOL, 2 * 2**-5)):
        loss_gap = max(abs(a - b) for a, b in zip(r.losses, r.ref_losses))
        assert r.max_param_diff < tol and loss_gap < loss_tol, (r.case, r.max_param_diff, loss_gap)
        assert r.param_change > 1e-3 and r.dynamo_graphs == 1, r.case
    # A re-layout only: with 2 ranks every element is summed in the same order, so the runs agree bit for bit.
    assert partial.losses == plain.losses and partial.max_param_diff == plain.max_param_diff
    assert _totals(plain) == {"fw": 3, "bw": 6}  # a gather per unit; a re-gather and a reduction per unit
    assert _totals(partial) == {"fw": 2, "bw": 4}
    assert _totals(merged) == {"fw": 1, "bw": 1}  # SHARD_GRAD_OP: the backward only reduces
    for stage in range(2):
        assert partial.reports[stage].collectives.bytes == plain.reports[stage].collectives.bytes
    bucketed_units = [u for r in partial.reports for _, u in r.collectives.units if "+" in u]
    assert sorted(bucketed_units) == ["+blocks.0", "+blocks.1", "blocks.0+"], bucketed_units
