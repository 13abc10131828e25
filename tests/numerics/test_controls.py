"""Issue 12: FSDP2's per-module controls on sharded unit modules, on 2 gloo ranks, eager and compiled."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.controls import (
    divide_factor,
    forward_method,
    replica_all_reduce,
    reshard_after_backward,
    unshard_reshard,
)


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_unshard_then_reshard_exposes_full_weights(mode):
    for r in spawn(unshard_reshard, 2, (mode,)):
        assert r["is_fsdp_module"] == 1.0, r
        for step in range(3):
            assert r[f"gathers_{step}"] == 1.0 and r[f"full_shape_{step}"] == 1.0, (step, r)
            assert r[f"full_diff_{step}"] < 1e-6, (step, r)  # the trained weights, as single-process SGD has them
            assert r[f"others_sharded_{step}"] == 1.0 and r[f"resharded_{step}"] == 1.0, (step, r)
        if mode == "aot":  # unshard/reshard between steps never recompile
            assert r["graphs"] == 1.0, r


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_gradient_divide_factor(mode):
    for r in spawn(divide_factor, 2, (mode,)):
        for step in range(4):
            assert r[f"grad_diff_{step}"] < 1e-6, (step, r)
        assert r["factors"] == 1.0, r
        if mode == "aot":  # one graph per setting, compiled once: the mean, the sum, then the mean's again
            assert [r[f"graphs_{s}"] for s in range(4)] == [1.0, 2.0, 2.0, 2.0], r


def test_registered_forward_method_sees_full_parameters():
    results = spawn(forward_method, 2)
    # Unregistered, the method reads shards: with the rows layout rank 1 holds none of the 1-row head (a (3, 0)
    # result), while rank 0's row block is the whole head (right by accident); the flat layout's 1-D slice errors.
    assert results[1]["unregistered_wrong"] == 1.0, results
    for r in results:
        assert r["diff"] < 1e-6 and r["closed"] == 1.0 and r["sharded_after"] == 1.0, r


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_requires_all_reduce_accumulates_partial_sums_on_2x2_hybrid(mode):
    for r in spawn(replica_all_reduce, 4, (mode,)):
        for round_ in range(2):
            # 7 units (6 blocks and the root): no replica all-reduce while off, one per unit when back on
            assert [r[f"all_reduces_{round_}_{m}"] for m in range(3)] == [0.0, 0.0, 7.0], r
            assert r[f"grads_untouched_{round_}_0"] == r[f"grads_untouched_{round_}_1"] == 1.0, r
            assert r[f"grad_diff_{round_}"] < 1e-6 and r[f"partials_dropped_{round_}"] == 1.0, r
        if mode == "aot":  # accumulate without all-reduce; all-reduce with the partial sum: each compiled once
            assert r["graphs"] == 2.0, r


@pytest.mark.parametrize("strategy, mode", [("FULL_SHARD", "eager"), ("SHARD_GRAD_OP", "eager"), ("FULL_SHARD", "aot")])
def test_reshard_after_backward_false_skips_the_next_forwards_gathers(strategy, mode):
    for r in spawn(reshard_after_backward, 2, (strategy, mode)):
        units = r["units"]
        assert units == 7.0 and r["non_bool_refused"] == 1.0, r
        for round_ in range(2):
            # kept after microbatch 0's and 1's backwards: microbatches 1 and 2 gather nothing in forward
            assert [r[f"fwd_{round_}_{m}"] for m in range(1, 3)] == [0.0, 0.0], r
            assert r[f"grad_diff_{round_}"] < 1e-6 and r[f"kept_after_{round_}"] == 0.0, r
            if mode == "eager":  # backwards gather as by default (a unit resharded after forward frees what it used)
                assert r[f"bwd_{round_}_1"] == r[f"bwd_{round_}_2"] == r[f"bwd_{round_}_0"], r
            else:  # compiled, the forward's gather is kept, so no backward gathers (round 0's first call compiles)
                assert [r[f"bwd_{round_}_{m}"] for m in range(3)] == [0.0, 0.0, 0.0], r
        assert r["fwd_1_0"] == units, r
        if strategy == "FULL_SHARD" and mode == "eager":
            assert r["bwd_0_0"] > 0.0, r
        assert r["kept"] == units and r["kept_after_reshard"] == 0.0 and r["fwd_resharded"] == units, r
        assert r["grad_diff_resharded"] < 1e-6, r
        # stepped while kept: the shards changed, so the forward gathers the new values instead of stale ones
        assert r["fwd_stepped"] == units and r["grad_diff_stepped"] < 1e-6, r
        # True again: the next forward uses the kept gathers and frees them
        assert r["fwd_released"] == 0.0 and r["kept_released"] == 0.0 and r["grad_diff_released"] < 1e-6, r
        if mode == "aot":  # first, middle and last microbatch: one graph each, compiled once
            assert r["graphs"] == 3.0, r
