"""Full (unsharded) state dicts of a sharded model, for single-file exports and comparisons."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.unit import flat_params


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every sharded parameter as its full tensor, under the original FQNs (each name
    of a tied parameter). Collective: every rank must call it. `rank0_only`: other ranks get `{}`.
    `cpu_offload`: the tensors are moved to the CPU."""
    if not flat_params(model):
        raise RuntimeError("full_state_dict: the model is not sharded; call fsdp_graph.fully_shard(model) first.")
    root = model.__dict__["_fsdp_root"]
    root.full_state_dict = True  # the state-dict hook hands out the full tensors it gathers (one gather each)
    try:
        state = model.state_dict()
    finally:
        root.full_state_dict = False
    result = {key: value.cpu() if cpu_offload else value for key, value in state.items()}
    if rank0_only and dist.get_rank() != 0:
        return {}
    return result
