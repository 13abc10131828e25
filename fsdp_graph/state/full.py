"""Full (unsharded) state dicts of a sharded model, for single-file exports and comparisons."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_graph.runtime.unit import flat_params


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every DTensor entry as its full tensor, under the state dict's own keys (each name of
    a tied parameter; the keys the modules' own state-dict hooks made). Collective: every rank must call it.
    `rank0_only`: other ranks get `{}`. `cpu_offload`: the tensors are copied to CPU memory.

    The modules' own state-dict code sees DTensors first, as with FSDP2's full state dict before its gather
    (`state/module_state.py`). The entries are then made full one at a time, and with `cpu_offload` (or on the ranks
    `rank0_only` leaves out) each one is copied out (or dropped) before the next, so the device never holds more
    than one full parameter beyond the sharded state dict (rows layout: views of the shards) and the result."""
    if not flat_params(model):
        raise RuntimeError("full_state_dict: the model is not sharded; call fsdp_graph.fully_shard(model) first.")
    keep = not rank0_only or dist.get_rank() == 0
    state = model.state_dict()
    for key, value in state.items():
        if isinstance(value, DTensor):
            value = _unaliased(value.full_tensor(), value)
        if not keep:
            state[key] = None
        elif cpu_offload:
            state[key] = value.to("cpu", copy=True)  # a copy even from CPU memory: a view would keep its base alive
        else:
            state[key] = value
    return state if keep else {}


def _unaliased(full: torch.Tensor, entry: DTensor) -> torch.Tensor:
    """`full`, copied where it is the entry's own local tensor (a one-rank mesh's `full_tensor()`): a full state dict
    must not change when training goes on."""
    if full.untyped_storage().data_ptr() == entry._local_tensor.untyped_storage().data_ptr():
        return full.clone()
    return full
