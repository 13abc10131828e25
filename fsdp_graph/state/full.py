"""Full (unsharded) state dicts of a sharded model, for single-file exports and comparisons."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.runtime.unit import flat_params


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every sharded parameter as its full tensor, under the original FQNs (each name
    of a tied parameter). Collective: every rank must call it. `rank0_only`: other ranks get `{}`.
    `cpu_offload`: the tensors are copied to CPU memory.

    It streams: flat parameters are gathered one at a time, and with `cpu_offload` (or on the ranks `rank0_only`
    leaves out) each gathered one is copied out (or dropped) before the next gather, so the device never holds
    more than one unsharded flat parameter (plus, on CPU offload's host, the result)."""
    if not flat_params(model):
        raise RuntimeError("full_state_dict: the model is not sharded; call fsdp_graph.fully_shard(model) first.")
    root = model.__dict__["_fsdp_root"]
    keep = not rank0_only or dist.get_rank() == 0
    root.full_state_dict = _copy_to_cpu if cpu_offload and keep else (lambda full: full) if keep else _drop
    try:
        state = model.state_dict()
    finally:
        root.full_state_dict = None
    if not keep:
        return {}
    return {
        key: value.cpu() if cpu_offload else value for key, value in state.items()
    }  # buffers: the hook copied the rest


def _copy_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    # A copy even from CPU memory: a view would keep its whole gathered flat parameter alive.
    return tensor.to("cpu", copy=True)


def _drop(full: torch.Tensor) -> None:
    return None
