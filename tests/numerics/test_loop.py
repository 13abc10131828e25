"""Issue 5's training-loop features on gloo ranks, against single-process PyTorch doing the same."""

import pytest

from fsdp_graph.launch import spawn
from tests.loop import clip_matches_pytorch


@pytest.mark.parametrize("strategy, mode", [("FULL_SHARD", "aot"), ("NO_SHARD", "eager"), ("SHARD_GRAD_OP", "eager")])
def test_clip_grad_norm_equals_single_process(strategy, mode):
    for r in spawn(clip_matches_pytorch, 2, (strategy, mode)):
        assert r["clipped_2.0"] == 1.0 and r["clipped_inf"] == 1.0 and r["clipped_1.0"] == 0.0  # both paths run
        for norm in ("2.0", "inf", "1.0"):
            assert r[f"norm_{norm}"] < 1e-5, r
            assert r[f"grads_{norm}"] < 1e-7, r
