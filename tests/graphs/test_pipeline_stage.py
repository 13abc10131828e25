"""fsdp_graph.PipelineStage refuses what it cannot run, naming it (fake process group, world 4)."""

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from tests.graphs.capture import TwoBlock


def _stage(module: nn.Module, **kwargs) -> fsdp_graph.PipelineStage:
    return fsdp_graph.PipelineStage(module, 0, 4, torch.device("cpu"), **kwargs)


def test_unsharded_module_is_refused(fake_pg):
    with pytest.raises(ValueError, match=r"stage module \(TwoBlock\) is not sharded.*fully_shard"):
        _stage(torch.compile(TwoBlock()))


def test_split_backward_and_weight_builder_are_refused(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    with pytest.raises(NotImplementedError, match="dw_builder"):
        _stage(model, dw_builder=lambda: lambda: None)
    stage = _stage(torch.compile(model, backend=fsdp_graph.make_backend(inductor=False)))
    for kind in ("input", "weight"):
        with pytest.raises(NotImplementedError, match=f"split backward \\('{kind}' only\\).*ScheduleZBVZeroBubble"):
            stage.backward_maybe_with_nosync(kind, {})


def test_stage_turns_sync_off_and_last_backward_turns_it_back_on(fake_pg):
    """Sync is off from construction (the schedule's shape inference runs forward outside the stage's own
    forward), and the last backward of a step restores it for use outside the schedule."""
    model = fsdp_graph.fully_shard(TwoBlock())
    root = model.__dict__["_fsdp_root"]
    stage = _stage(model)
    assert root.requires_gradient_sync is False
    x = torch.randn(2, 4, requires_grad=True)
    out = stage.forward_maybe_with_nosync(x)
    stage.backward_maybe_with_nosync("full", {"stage_output": out.sum(), "output_grads": None, "input_values": [x]})
    assert root.requires_gradient_sync is False and all(p.grad is None for p in model.parameters())
    out = stage.forward_maybe_with_nosync(x)
    stage.backward_maybe_with_nosync(
        "full", {"stage_output": out.sum(), "output_grads": None, "input_values": [x]}, last_backward=True
    )
    assert root.requires_gradient_sync is True
    assert all(p.grad is not None for p in model.parameters() if p.numel())
    assert all(s.unsynced.grad is None for s in root.flat_params if s.unsynced is not None)
