"""explain()'s predicted peak memory against the peak measured on 2 gloo ranks (profiler memory events)."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.explaining import predicted_vs_measured_per_reuse

# Both came within 0.01% (docs/planning.md). The measurement is the least of a few steps: a step
# that allocates while gloo's worker thread still holds a finished collective's tensors peaks up to 12% higher.
TOLERANCE = 0.05


# The GPT's blocks share one compiled body by default (reuse on: the estimate looks into the body's graph) and are
# traced one by one with reuse_blocks=False; the HF-style model is planned with the default only.
@pytest.mark.parametrize("name, batch_size, reuse_settings", [("gpt", 8, (None, False)), ("hf", 64, (None,))])
def test_predicted_peak_memory_matches_measured(name, batch_size, reuse_settings):
    results = spawn(predicted_vs_measured_per_reuse, 2, (name, batch_size, reuse_settings))
    for per_rank in results:
        for reuse, r in zip(reuse_settings, per_rank):
            assert abs(r["error"]) < TOLERANCE, (reuse, r)
            assert r["predicted"] > 5 * r["persistent"], (reuse, r)  # the step's own memory, not just the shards
