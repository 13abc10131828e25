"""Issue 12: an optimizer built before fully_shard raises instead of training silently wrong; requires_grad changed
after fully_shard reaches the flat shards (issue 32; its numerics: tests/numerics/test_fsdp2_semantics.py)."""

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


def test_requires_grad_change_after_fully_shard_reaches_the_flat_shard(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    state = model.blocks[1]._fsdp_states[0]
    bias = state.layout.slots.index(next(s for s in state.layout.slots if s.fqns == ("blocks.1.bias",)))
    model.blocks[1].bias.requires_grad_(False)
    assert state.detached_slots == (bias,) and state.flat_shard.requires_grad  # read detached; others train
    model.blocks[1].requires_grad_(False)
    assert state.detached_slots == () and not state.flat_shard.requires_grad  # nothing of it trains: no gradient
    model.blocks[1].weight.requires_grad = True
    assert state.flat_shard.requires_grad and state.detached_slots == (bias,)
    model.requires_grad_(True)
    assert all(p.requires_grad for p in model.parameters())
    assert all(s.flat_shard.requires_grad and not s.detached_slots for s in flat_params(model))


def test_frozen_view_can_be_unfrozen_and_copies_work(fake_pg):
    model = TwoBlock()
    model.blocks[0].bias.requires_grad_(False)
    fsdp_graph.fully_shard(model)
    frozen = next(s for s in flat_params(model) if s.name.endswith("[frozen]"))
    assert not frozen.flat_shard.requires_grad
    model.blocks[0].bias.requires_grad_(True)  # its shard, frozen at fully_shard, now gets a gradient
    assert frozen.flat_shard.requires_grad
    model(torch.randn(2, 4)).sum().backward()
    assert model.blocks[0].bias.grad is not None and model.blocks[0].bias.grad.shape == model.blocks[0].bias.shape
    copied = copy.deepcopy(model.blocks[0].weight)
    assert copied.requires_grad and torch.equal(copied, model.blocks[0].weight)
