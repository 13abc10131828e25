"""`full_state_dict` streams (issue 13): with `cpu_offload`, or on the ranks `rank0_only` leaves out, each gathered
flat parameter is copied out or dropped before the next gather, so at most one unsharded unit is alive at a time."""

from __future__ import annotations

import weakref

import pytest
import torch

import fsdp_graph
from fsdp_graph.state import sharded as checkpoint
from tests.graphs.capture import TwoBlock


@pytest.fixture
def live_gathers(monkeypatch):
    """Counts, at each gather, how many earlier gathered flat parameters are still alive."""
    gathered: list[weakref.ref] = []
    alive_at_gather: list[int] = []
    real = checkpoint.gather_flat

    def gather(state, local):
        alive_at_gather.append(sum(ref() is not None for ref in gathered))
        full = real(state, local)
        gathered.append(weakref.ref(full))
        return full

    monkeypatch.setattr(checkpoint, "gather_flat", gather)
    return alive_at_gather


def _sharded(layout: str = "rows") -> torch.nn.Module:
    torch.manual_seed(0)
    return fsdp_graph.fully_shard(TwoBlock(dim=8), layout=layout)


def test_cpu_offload_holds_one_unsharded_unit_at_a_time(fake_pg, live_gathers):
    state = fsdp_graph.full_state_dict(_sharded(), cpu_offload=True)
    assert live_gathers == [0, 0, 0]  # three units, none alive when the next is gathered
    assert set(state) == {"blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias", "head.weight"}
    assert all(value.device.type == "cpu" for value in state.values())
    assert state["blocks.1.weight"].shape == (8, 8)


def test_without_offload_the_result_keeps_every_gathered_unit(fake_pg, live_gathers):
    """What the streaming avoids: with the flat layout the result's tensors are views of the gathered flat
    parameters (the rows layout copies each parameter out of its rank-major gathered flat, so none stays alive)."""
    state = fsdp_graph.full_state_dict(_sharded("flat"))
    assert live_gathers == [0, 1, 2]
    assert state["head.weight"].shape == (2, 8)


def test_rank0_only_drops_what_other_ranks_gather(fake_pg, live_gathers, monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert fsdp_graph.full_state_dict(_sharded(), rank0_only=True) == {}
    assert live_gathers == [0, 0, 0]
