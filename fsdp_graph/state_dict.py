"""Full (unsharded) state dicts of a sharded model."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.unit import UnitState, flat_params


def _gather_flat(state: UnitState) -> torch.Tensor:
    shard = state.flat_shard.detach()
    if state.world == 1:
        return shard.clone()
    full = shard.new_empty(state.layout.padded_numel)
    group = dist.distributed_c10d._resolve_process_group(state.group_name)
    dist.all_gather_single(full, shard.contiguous(), group=group)
    return full


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every sharded parameter replaced by its full tensor, on every rank.

    Collective: every rank must call it. Keys are the original FQNs (each name of a tied parameter).
    """
    states = flat_params(model)
    if not states:
        raise RuntimeError("full_state_dict: the model is not sharded; call fsdp_graph.fully_shard(model) first.")
    result = model.state_dict()
    for state in states:
        layout = state.layout
        for slot, full in zip(layout.slots, layout.unflatten(_gather_flat(state))):
            for fqn in slot.fqns:
                if fqn in result:
                    result[fqn] = full.clone()
    return result
