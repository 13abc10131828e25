"""`full_state_dict` streams (issue 13): with `cpu_offload`, or on the ranks `rank0_only` leaves out, each full tensor
is copied out or dropped before the next is made; and the flat layout's sharded state dict holds at most one gathered
unit at a time (`state/module_state.py`)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor

import fsdp_graph
from fsdp_graph.state import module_state
from tests.graphs.capture import TwoBlock


def _counting(record: list[int]):
    """A wrapper recording, at each call, how many results of earlier calls are still alive."""
    made: list[weakref.ref] = []

    def wrap(real):
        def counted(*args, **kwargs):
            record.append(sum(ref() is not None for ref in made))
            result = real(*args, **kwargs)
            made.append(weakref.ref(result))
            return result

        return counted

    return wrap


@pytest.fixture
def live_full(monkeypatch):
    """At each `DTensor.full_tensor`, how many earlier full tensors are still alive."""
    record: list[int] = []
    monkeypatch.setattr(DTensor, "full_tensor", _counting(record)(DTensor.full_tensor))
    return record


@pytest.fixture
def live_gathers(monkeypatch):
    """At each gather of a flat parameter for a state dict, how many earlier gathered ones are still alive."""
    record: list[int] = []
    monkeypatch.setattr(module_state, "gather_flat", _counting(record)(module_state.gather_flat))
    return record


def _sharded(layout: str = "rows") -> torch.nn.Module:
    torch.manual_seed(0)
    return fsdp_graph.fully_shard(TwoBlock(dim=8), layout=layout)


@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_cpu_offload_holds_one_full_tensor_at_a_time(fake_pg, live_full, layout):
    state = fsdp_graph.full_state_dict(_sharded(layout), cpu_offload=True)
    assert live_full == [0, 0, 0, 0, 0]  # five parameters, none alive when the next is made
    assert set(state) == {"blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias", "head.weight"}
    assert all(value.device.type == "cpu" for value in state.values())
    assert state["blocks.1.weight"].shape == (8, 8)


def test_without_offload_the_result_keeps_every_full_tensor(fake_pg, live_full):
    """What the streaming avoids: without `cpu_offload` the result is the full tensors themselves."""
    state = fsdp_graph.full_state_dict(_sharded("flat"))
    assert live_full == [0, 1, 2, 3, 4]
    assert state["head.weight"].shape == (2, 8)


def test_rank0_only_drops_what_other_ranks_gather(fake_pg, live_full, monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert fsdp_graph.full_state_dict(_sharded(), rank0_only=True) == {}
    assert live_full == [0, 0, 0, 0, 0]


def test_flat_layout_gathers_one_unit_at_a_time(fake_pg, live_gathers):
    """The flat layout's sharded state dict gathers each unit once, and frees it when the unit's own call returns."""
    state = _sharded("flat").state_dict()
    assert live_gathers == [0, 0, 0]  # three units
    assert all(isinstance(v, DTensor) for v in state.values())
