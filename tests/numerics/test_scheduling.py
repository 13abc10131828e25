"""Issue 4 on gloo ranks: the schedule really executes (profiler op stream), and the collective choice for gloo."""

import pytest
import torch

from fsdp_graph.launch import spawn
from tests.scheduling import (
    activation_budget,
    forward_op_stream,
    reduce_scatter_bytes,
    separate_reduce_group_parity,
)


@pytest.mark.parametrize("inductor", [False, True])
def test_forward_prefetch_executes(inductor):
    """The test GPT has 3 units. Unscheduled, each wait follows its own gather; scheduled, gather k+1 has been
    issued before the wait of gather k (here all three: the root holds the tied embedding/head, so it is alive
    through the whole forward anyway and the default budget, one unit more, fits both blocks)."""
    scheduled = spawn(forward_op_stream, 2, (inductor, True))
    for stream in scheduled:
        assert len(stream) == 3 and all(issued >= min(k + 2, 3) for k, issued in enumerate(stream)), stream
    if not inductor:
        for stream in spawn(forward_op_stream, 2, (False, False)):
            assert stream == [1, 2, 3], stream


def test_gloo_reduce_scatter_as_all_to_all_halves_the_bytes():
    native = spawn(reduce_scatter_bytes, 2, ("native",))
    auto = spawn(reduce_scatter_bytes, 2, ("auto",))
    for a, n in zip(auto, native):
        assert "gloo:all_reduce" in n["backend_counts"] and "gloo:all_reduce" not in a["backend_counts"], (a, n)
        assert a["backend_counts"]["gloo:all_to_all"] == n["backend_counts"]["gloo:all_reduce"] == 3, (a, n)
        # ring all-reduce sends 2(N-1)/N of the gradient, the all-to-all (N-1)/N: half
        ratio = a["backend_wire_bytes"]["gloo:all_to_all"] / n["backend_wire_bytes"]["gloo:all_reduce"]
        assert ratio == 0.5, ratio
        for ga, gn in zip(a["grads"], n["grads"]):
            torch.testing.assert_close(ga, gn, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("strategy, world", [("FULL_SHARD", 2), ("HYBRID_SHARD", 4)])
def test_separate_reduce_group(strategy, world):
    for r in spawn(separate_reduce_group_parity, world, (strategy,)):
        assert r["diff"] < 2e-5, r
        assert len(r["gather_groups"]) == len(r["reduce_groups"]) == 1, r
        assert r["gather_groups"] != r["reduce_groups"], r


def test_activation_memory_budget():
    for r in spawn(activation_budget, 2):
        assert r["diff"] < 2e-5, r
        assert r["saved_budget"] < 0.8 * r["saved_default"], r
