"""Issue 12: FSDP2's per-module controls on sharded unit modules, on 2 gloo ranks, eager and compiled."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.controls import divide_factor, forward_method, replica_all_reduce, unshard_reshard


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
    for r in spawn(forward_method, 2):
        assert r["unregistered_fails"] == 1.0, r
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
