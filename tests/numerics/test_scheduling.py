"""Issue 4 on gloo ranks: the schedule really executes (profiler op stream), and the collective choice for gloo."""

import pytest
import torch

from fsdp_graph.train.launch import spawn
from tests.workers.scheduling import (
    activation_budget,
    forward_op_stream,
    reduce_scatter_bytes,
    separate_reduce_group_parity,
)


def _matmuls_before_each_gather(stream: list[str]) -> list[int]:
    """For every gather after the first: the matmuls executed between the previous wait and its issue."""
    counts, since_wait = [], None
    for kind in stream:
        if kind == "wait":
            since_wait = 0
        elif kind == "matmul" and since_wait is not None:
            since_wait += 1
        elif kind == "gather" and since_wait is not None:
            counts.append(since_wait)
    return counts


def _max_gathers_in_flight(stream: list[str]) -> int:
    flying = most = 0
    for kind in stream:
        flying += {"gather": 1, "wait": -1}.get(kind, 0)
        most = max(most, flying)
    return most


def test_forward_prefetch_executes():
    """The test GPT has 3 units on one gloo group. Scheduled, gather k+1 is issued as soon as gather k has
    arrived, before unit k computes (no matmul in between), and never two at once: gloo's worker threads corrupt
    the heap when two collectives finish together (issue 10). Unscheduled, unit k computes before gather k+1.
    Eager kernels: Inductor's code runs its collectives in the order the schedule gave them
    (tests/graphs/test_inductor_order.py reads the order from the code Inductor generates)."""
    for stream in spawn(forward_op_stream, 2, (True,)):
        assert stream.count("gather") == 3, stream
        assert _matmuls_before_each_gather(stream) == [0, 0], stream
        assert _max_gathers_in_flight(stream) == 1, stream
    for stream in spawn(forward_op_stream, 2, (False,)):
        assert any(n > 0 for n in _matmuls_before_each_gather(stream)), stream


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


# ("HYBRID_SHARD", 4): its duplicate shard groups are test_reduce_group.py::test_hybrid_duplicates_each_replica_shard_group_
# locally's, hybrid numerics test_strategies.py::test_hybrid_shard_world_4's; 4 ranks on 2 cores cost the suite 12 s.
@pytest.mark.parametrize("strategy, world", [("FULL_SHARD", 2)])
def test_separate_reduce_group(strategy, world):
    for r in spawn(separate_reduce_group_parity, world, (strategy,)):
        assert r["diff"] < 2e-5, r
        assert len(r["gather_groups"]) == len(r["reduce_groups"]) == 1, r
        assert r["gather_groups"] != r["reduce_groups"], r


def test_activation_memory_budget():
    for r in spawn(activation_budget, 2):
        assert r["diff"] < 2e-5, r
        assert r["saved_budget"] < 0.8 * r["saved_default"], r
