"""Tensor-parallel parameters as the optimizer sees them (issue 14): DTensors on the (dp, tp) mesh whose local
tensors are their row blocks inside the unit's flat shard.

A rows-layout view of a tensor-parallel parameter is a `misuse.ShardedDTensor` with the placements its state-dict
entry has (`tensor_parallel.state_dict_placements`: fully_shard's, then the tp one), so `p.full_tensor()` is the
global parameter and an optimizer's in-place update of `p` writes the flat shard. Its `.grad` is a DTensor with
the same spec around the reduced gradient's piece. The flat layout keeps plain views: a 1-D slice of the
concatenated flat shard is no DTensor placement.

Stock optimizers given both these DTensors and the plain views of other parameters step them alike one by one,
but their foreach kernels take one list of both, which DTensor refuses ("mixed torch.Tensor and DTensor"). While
such an optimizer steps (global step pre/post hooks) DTensor's implicit replication is on: a plain tensor in a
list is read as replicated, which for the element-wise updates of one parameter's own tensors is exact (each
list position pairs a parameter with its own gradient and state, all plain or all of one spec).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp_graph.runtime.misuse import ShardedDTensor
from fsdp_graph.runtime.tensor_parallel import TPSpec, state_dict_placements

_MIXED = "_fsdp_mixed_dtensor"  # optimizer attribute: (parameter count, whether it mixes both kinds)
_turned_on: list[bool] = []  # one entry while a pre-hook turned implicit replication on and its post-hook has not run


def view_spec(
    spec: TPSpec, fsdp_mesh: DeviceMesh, fsdp_placements: tuple, local_rows: int, dtype: torch.dtype
) -> DTensorSpec | None:
    """The spec of a rows-layout view of a tensor-parallel parameter, or None where no DTensor describes its row
    block (the cases `state_dict_placements` refuses: uneven dp blocks of a dim-0 tp piece, a world mesh ordering
    tp before dp); such a view stays plain."""
    try:
        mesh, placements = state_dict_placements(spec, fsdp_mesh, fsdp_placements, local_rows)
    except ValueError:
        return None
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(spec.shape, spec.stride, dtype))


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the object itself, sharing storage), anything else as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def like(local: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """`local` (shaped like `view`'s local tensor) as a DTensor with `view`'s spec when `view` is one, no copy."""
    if not isinstance(view, DTensor):
        return local
    return DTensor.from_local(
        local, view.device_mesh, view.placements, run_check=False, shape=view.shape, stride=view.stride()
    )


def set_local(dtensor: DTensor, local: torch.Tensor) -> None:
    """Make `local` the local tensor of `dtensor` in place (the object stays, so optimizers and their state keep
    it). A new dtype or device (`.double()`, keep_low_precision_grads) also changes the wrapper's, through `.data`
    as for a plain tensor."""
    if local.dtype != dtensor.dtype or local.device != dtensor.device:
        meta = TensorMeta(dtensor.shape, tuple(dtensor.stride()), local.dtype)
        spec = DTensorSpec(dtensor.device_mesh, tuple(dtensor.placements), tensor_meta=meta)
        with torch.no_grad():
            dtensor.data = DTensor(local, spec, requires_grad=False)
        dtensor._spec = spec
    dtensor._local_tensor = local


def hide_views(unit: nn.Module) -> list[tuple[nn.Module, str, DTensor]]:
    """Take the DTensor views out of the modules under `unit` (put back with `restore_views`): nn.Module's `_apply`
    would swap each one's contents with a converted copy (`swap_tensors`: its class and attributes too), while the
    unit re-points it at the converted flat shard anyway."""
    hidden = []
    for module in unit.modules():
        for name in module.__dict__.get("_fsdp_views", {}):
            param = module._parameters.get(name)
            if isinstance(param, ShardedDTensor):
                hidden.append((module, name, param))
                module._parameters[name] = None
    return hidden


def restore_views(hidden: list[tuple[nn.Module, str, DTensor]]) -> None:
    for module, name, param in hidden:
        module._parameters[name] = param


def _mixes(optimizer: torch.optim.Optimizer) -> bool:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cached = optimizer.__dict__.get(_MIXED)
    if cached is None or cached[0] != len(params):
        ours = any(isinstance(p, ShardedDTensor) for p in params)
        cached = (len(params), ours and any(not isinstance(p, DTensor) for p in params))
        optimizer.__dict__[_MIXED] = cached
    return cached[1]


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    # `_turned_on` already set: a step that raised left it on (its post-hook did not run); this step's turns it off.
    if torch.compiler.is_compiling() or not _mixes(optimizer) or _turned_on:
        return
    if not DTensor._op_dispatcher._allow_implicit_replication:
        DTensor._op_dispatcher._allow_implicit_replication = True
        _turned_on.append(True)


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if _turned_on and not torch.compiler.is_compiling():
        DTensor._op_dispatcher._allow_implicit_replication = False
        _turned_on.clear()


register_optimizer_step_pre_hook(_before_step)
register_optimizer_step_post_hook(_after_step)
