"""Issue 14: pipeline parallelism with torch.distributed.pipelining, stages sharded over the dp dimension of a
(pp=2, dp=2) mesh of 4 gloo ranks, compiled with eager kernels. One spawn checks every schedule."""

from fsdp_graph.train.launch import spawn
from tests.workers.pipeline import MICROBATCHES, pipeline_checks

TOL = 1e-6


def test_pipeline_schedules_match_single_process_and_reduce_once_per_step():
    """Also the rank check with stages compiled on their own: each stage's graphs are compared within its dp group
    only (stages issue other collectives), and rank 3 recompiling alone (GPipe's last step) passes."""
    results = spawn(pipeline_checks, 4, (3,), timeout_s=300)
    assert [r["single"]["lone_recompiles"] for r in results] == [0, 0, 0, 1]
    for r in results:
        single, multi = r["single"], r["multi"]
        units = single["units"]
        for phase in ("gpipe", "1f1b"):
            assert single[f"{phase}_max_diff"] < TOL, r
            # One reduction per unit per step, not one per microbatch; the gathers are per microbatch.
            assert single[f"{phase}_reduce_scatters"] == units and single[f"{phase}_all_reduces"] == 0, r
            assert single[f"{phase}_all_gathers"] == single["torch_all_gathers"] > 0, r
            # The no-sync graph serves every microbatch, compiled once (twice on rank 3, which alone recompiled it).
            assert single[f"{phase}_graphs"] == 1 + single["lone_recompiles"], r
        # torch's own PipelineStage does not know our module: every microbatch's backward reduces (still correct).
        assert single["torch_reduce_scatters"] == MICROBATCHES * units and single["torch_max_diff"] < TOL, r
        assert single["torch_graphs"] == 2 + single["lone_recompiles"], r  # the synced variant, once more
        # The uncompiled module under fsdp_graph.PipelineStage: the eager path accumulates and reduces the same way.
        assert single["eager_max_diff"] < TOL and single["eager_reduce_scatters"] == units, r
        assert not single["pending"] and single["sync_after"], r
        # clip_grad_norm_ over the stages (pp group) = torch's on the whole model; it clipped every step.
        for part in (single, multi):
            assert part["clip_norm_diff"] < TOL and part["clipped"] == 1.0, r
        # Two stages per rank (Interleaved 1F1B, looped BFS): each stage module is its own graph, reduced once.
        for phase in ("interleaved", "looped_bfs"):
            assert multi[f"{phase}_max_diff"] < TOL and multi[f"{phase}_reduce_scatters"] == multi["units"], r
            assert multi[f"{phase}_graphs"] == 2, r
