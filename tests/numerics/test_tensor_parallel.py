"""Tensor parallel x FSDP (issue 14) on 4 gloo ranks as (dp=2, tp=2): parity with single-process training."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.tensor_parallel import tp_fsdp_parity


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_tp_colwise_rowwise_inside_fsdp_matches_single_process(mode):
    results = spawn(tp_fsdp_parity, 4, (mode,))
    for r in results:
        # 2 blocks x (q, k, v, o, up, down) x (weight, bias) are DTensors; the optimizer holds plain row blocks.
        assert r["tp_params"] == 24.0 and r["plain_views"] == 1.0, r
        assert r["max_diff"] < 1e-6, r
        if mode == "aot":
            assert r["graphs"] == 1.0, r


def test_tp_parity_fails_without_the_dp_mean():
    """The parity check can fail: the dp gradients summed instead of averaged (divide factor 1) must show."""
    results = spawn(tp_fsdp_parity, 4, ("eager", True))
    assert all(r["max_diff"] > 1e-3 for r in results), results
