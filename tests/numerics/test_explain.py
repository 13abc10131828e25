"""explain()'s predicted peak memory against the peak measured on 2 gloo ranks (profiler memory events)."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.explaining import predicted_vs_measured

# Both came within 0.01% (docs/planning.md). The measurement is the least of a few steps: a step
# that allocates while gloo's worker thread still holds a finished collective's tensors peaks up to 12% higher.
TOLERANCE = 0.05


@pytest.mark.parametrize("name, batch_size", [("gpt", 8), ("hf", 64)])
def test_predicted_peak_memory_matches_measured(name, batch_size):
    results = spawn(predicted_vs_measured, 2, (name, batch_size))
    for r in results:
        assert abs(r["error"]) < TOLERANCE, r
        assert r["predicted"] > 5 * r["persistent"], r  # the step's own memory, not just the shards, is compared
