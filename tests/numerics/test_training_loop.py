"""Gradient semantics and graph stability over steps, on 2 gloo ranks."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.training import grad_semantics, inference_outputs, step_counts


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_grads_accumulate_and_zero_like_pytorch(mode):
    for result in spawn(grad_semantics, 2, (mode,)):
        assert result["grad_norm"] > 1e-3  # the comparison below is not vacuous
        assert result["accumulated"] < 1e-6, result
        assert result["after_zero_grad_none"] < 1e-6, result
        assert result["after_zero_grad_zeros"] < 1e-6, result


def test_full_shard_one_graph_and_collectives_per_unit():
    for r in spawn(step_counts, 2, ("FULL_SHARD",)):
        units = r["units"]
        assert units == 3
        assert (r["dynamo_graphs"], r["graph_breaks"]) == (1, 0)  # 10 steps: no recompile, no break
        assert r["reports"] == [("fw", {"all_gather": units}), ("bw", {"all_gather": units, "all_to_all": units})]


def test_shard_grad_op_no_backward_gathers():
    for r in spawn(step_counts, 2, ("SHARD_GRAD_OP",)):
        units = r["units"]
        assert (r["dynamo_graphs"], r["graph_breaks"]) == (1, 0)
        assert r["reports"] == [("fw", {"all_gather": units}), ("bw", {"all_to_all": units})]


@pytest.mark.parametrize("mode", ["eager", "aot"])
def test_inference_under_no_grad(mode):
    for diff in spawn(inference_outputs, 2, (mode,)):
        assert diff < 1e-5
