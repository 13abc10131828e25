"""Optimizer state dicts in FSDP2's layout: keyed by parameter FQN, per-parameter state as dim-0 DTensors."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_graph.runtime.dtensor_views import like, local_of
from fsdp_graph.runtime.unit import FlatParamState, flat_params
from fsdp_graph.state.sharded import gather_flat, gathered_dtensor, local_dtensor, local_range_of


def _fqns(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _slots(model: nn.Module) -> dict[int, tuple[FlatParamState, int]]:
    return {id(view): (state, i) for state in flat_params(model) for i, view in enumerate(state.views)}


def _is_per_element(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0


@torch.no_grad()
def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}` where every per-element
    state of a sharded parameter (Adam's exp_avg, ...) is a DTensor of the parameter's full shape, as torch's
    `get_optimizer_state_dict` returns for FSDP2. Collective: every rank must call it.

    A fresh optimizer (no state yet) is given its state first, as torch's `get_optimizer_state_dict` does, so the
    standard DCP recipe (`sd = optim_state_dict(...)`, `dcp.load(sd, ...)`, `load_optim_state_dict(...)`) has
    tensors for DCP to load into instead of silently loading nothing."""
    init_optimizer_state(optimizer)
    fqns, slots = _fqns(model), _slots(model)
    state_out: dict[str, dict] = {}
    for param, param_state in optimizer.state.items():
        if id(param) not in fqns:
            raise ValueError("optim_state_dict: the optimizer holds a parameter that is not in the model.")
        state_out[fqns[id(param)]] = {
            k: v for k, v in param_state.items() if not _is_per_element(v, param) or id(param) not in slots
        }
    for state in flat_params(model):
        keys = sorted(
            {k for v in state.views for k, val in optimizer.state.get(v, {}).items() if _is_per_element(val, v)}
        )
        for key in keys:
            if state.layout.kind == "rows":  # each state tensor is its parameter's Shard(0) local piece already
                for index, view in enumerate(state.views):
                    if key in optimizer.state.get(view, {}):
                        local = local_of(optimizer.state[view][key])
                        state_out[fqns[id(view)]][key] = local_dtensor(local, state, index)
                continue
            dtype = next(optimizer.state[v][key].dtype for v in state.views if key in optimizer.state.get(v, {}))
            local = torch.zeros(state.layout.shard_numel, dtype=dtype, device=state.flat_shard.device)
            for slot, view in zip(state.layout.slots, state.views):
                if key in optimizer.state.get(view, {}):
                    state.layout.local_view(local, slot).copy_(optimizer.state[view][key])
            full = gather_flat(state, local)
            for index, (view, value) in enumerate(zip(state.views, state.layout.unflatten(full))):
                if key in optimizer.state.get(view, {}):
                    state_out[fqns[id(view)]][key] = gathered_dtensor(value, state, index)
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": [fqns[id(p)] for p in group["params"]]}
        )
    return {"state": state_out, "param_groups": groups}


@torch.no_grad()
def load_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a state dict of `optim_state_dict`'s layout (DTensors or full tensors, any world size)."""
    fqns, slots = _fqns(model), _slots(model)
    by_fqn = {fqn: p for p in (p for g in optimizer.param_groups for p in g["params"]) if (fqn := fqns.get(id(p)))}
    index = {
        fqn: i
        for i, fqn in enumerate(fqn for g in optimizer.param_groups for fqn in (fqns[id(p)] for p in g["params"]))
    }
    converted_state = {}
    for fqn, param_state in state_dict["state"].items():
        if fqn not in by_fqn:
            raise KeyError(f"load_optim_state_dict: '{fqn}' is not a parameter of this optimizer.")
        param = by_fqn[fqn]
        entry = {}
        for key, value in param_state.items():
            if id(param) in slots and isinstance(value, torch.Tensor) and value.dim() > 0:
                slot_state, slot_index = slots[id(param)]
                entry[key] = like(local_range_of(value, slot_state, slot_index).to(value.dtype), param)
            else:
                entry[key] = value.full_tensor() if isinstance(value, DTensor) else value
        converted_state[index[fqn]] = entry
    groups = []
    for saved, current in zip(state_dict["param_groups"], optimizer.param_groups):
        groups.append({**saved, "params": [index[fqns[id(p)]] for p in current["params"]]})
    optimizer.load_state_dict({"state": converted_state, "param_groups": groups})


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state without changing any parameter (a step at learning rate 0 on zero
    gradients), so a fresh optimizer has a state dict for a checkpoint to load into."""
    if optimizer.state:
        return
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    grads = {}
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            grads[p] = p.grad
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
    for p, grad in grads.items():
        p.grad = grad
