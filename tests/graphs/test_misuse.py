"""Issue 12: an optimizer built before fully_shard, and requires_grad changed after it, raise instead of training
silently wrong."""

import copy

import pytest
import torch

import fsdp_graph
from fsdp_graph.runtime.unit import flat_params
from tests.graphs.capture import TwoBlock


def test_optimizer_built_before_fully_shard_refuses_to_step(fake_pg):
    model = TwoBlock()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp_graph.fully_shard(model)
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.weight'.*Build the optimizer after fully_shard"):
        stale.step()


def test_optimizer_built_after_fully_shard_steps(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(p, b - 0.5) for p, b in zip(model.parameters(), before))
    # a parameter group added later with a replaced parameter is caught too
    other = TwoBlock()
    stale_params = list(other.parameters())
    fsdp_graph.fully_shard(other)
    optimizer.add_param_group({"params": stale_params[:1]})
    with pytest.raises(RuntimeError, match="before fully_shard"):
        optimizer.step()


def test_requires_grad_change_after_fully_shard_raises(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.bias' cannot change after fully_shard.*before calling"):
        model.blocks[1].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'head\.weight'"):
        model.head.weight.requires_grad = False
    with pytest.raises(RuntimeError, match="cannot change after fully_shard"):
        model.requires_grad_(False)
    model.requires_grad_(True)  # no change: allowed
    assert all(p.requires_grad for p in model.parameters())
    assert all(s.flat_shard.requires_grad for s in flat_params(model))


def test_frozen_view_cannot_be_unfrozen_and_copies_work(fake_pg):
    model = TwoBlock()
    model.blocks[0].bias.requires_grad_(False)
    fsdp_graph.fully_shard(model)
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.bias'.*frozen"):
        model.blocks[0].bias.requires_grad_(True)
    copied = copy.deepcopy(model.blocks[0].weight)
    assert copied.requires_grad and torch.equal(copied, model.blocks[0].weight)
