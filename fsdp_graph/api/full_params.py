"""`summon_full_params`: the full parameters of a sharded model, outside forward, for inspection or edits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.runtime.dtensor_views import local_of
from fsdp_graph.runtime.unit import FlatParamState, flat_params
from fsdp_graph.state.sharded import gather_flat


def _local_grad(state: FlatParamState) -> torch.Tensor | None:
    if not any(v.grad is not None for v in state.views):
        return None
    local = torch.zeros_like(state.flat_shard)
    for slot, view in zip(state.layout.slots, state.views):
        if view.grad is not None:
            state.layout.local_view(local, slot).copy_(local_of(view.grad))
    return local


def _owners(model: nn.Module, state: FlatParamState) -> list[list[tuple[nn.Module, str]]]:
    """For each slot of `state`, every (module, name) holding its view."""
    by_view = {id(v): [] for v in state.views}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in by_view:
                by_view[id(p)].append((module, name))
    return [by_view[id(v)] for v in state.views]


@contextlib.contextmanager
def summon_full_params(
    model: nn.Module,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context every sharded parameter is its full tensor: `module.weight`, `named_parameters()`
    and `state_dict()` show full shapes. Collective: every rank must enter it.

    - writeback: on exit, changes made to the full parameters are copied back into this rank's shards.
    - rank0_only: only rank 0 sees full parameters (others keep their shards); needs writeback=False.
    - offload_to_cpu: the full parameters live on the CPU (then writeback copies back across devices).
    - with_grads: each full parameter's `.grad` is its full gradient (None where no rank has one).
    Not for use inside forward or backward.
    """
    states = flat_params(model)
    if not states:
        raise RuntimeError("summon_full_params: the model is not sharded; call fsdp_graph.fully_shard(model) first.")
    if rank0_only and writeback:
        raise ValueError("summon_full_params: rank0_only=True needs writeback=False (other ranks get no full params).")
    if any(s.root.forward_depth for s in states):
        raise RuntimeError("summon_full_params: not allowed inside forward; call it between training steps.")
    keep = not rank0_only or dist.get_rank() == 0
    if states[0].root.exposure is not None:  # fsdp2's unsharded parameters after a forward: the views again first
        states[0].root.exposure.restore_all()
    swapped = []
    with torch.no_grad():
        for state in states:
            full = gather_flat(state, state.flat_shard.detach())
            local_grad = _local_grad(state) if with_grads else None
            has_grad = torch.tensor([int(local_grad is not None)])
            if with_grads and state.world > 1:
                group = dist.distributed_c10d._resolve_process_group(state.group_name)
                has_grad = has_grad.to(collective_device(group, state.flat_shard.device))
                dist.all_reduce(has_grad, group=group)
            full_grad = None
            if has_grad.item():
                full_grad = gather_flat(
                    state, local_grad if local_grad is not None else torch.zeros_like(state.flat_shard)
                )
            if not keep:
                continue
            if offload_to_cpu:
                full = full.cpu()
                full_grad = None if full_grad is None else full_grad.cpu()
            params = []
            for slot, view, owners in zip(state.layout.slots, state.views, _owners(model, state)):
                param = nn.Parameter(state.layout.param_of(full, slot), requires_grad=view.requires_grad)
                if full_grad is not None:
                    param.grad = state.layout.param_of(full_grad, slot)
                for module, name in owners:
                    module._parameters[name] = param
                params.append((param, view, owners))
            swapped.append((state, params))
    try:
        yield
    finally:
        with torch.no_grad():
            for state, params in swapped:
                if writeback:
                    shard = state.layout.shard_of([p.detach() for p, _, _ in params])
                    state.flat_shard.detach().copy_(shard)
                for _, view, owners in params:
                    for module, name in owners:
                        module._parameters[name] = view
