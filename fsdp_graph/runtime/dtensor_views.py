"""Parameters as the optimizer sees them when a model has tensor-parallel parameters (issue 14): DTensors on ONE
mesh, the world's (dp..., tp), whose local tensors are their row blocks inside the units' flat shards.

With the rows layout, when a fully_shard call shards tensor-parallel parameters, every view it makes is a
`misuse.ShardedDTensor` on fully_shard's mesh dimensions followed by the tp one, as with FSDP2 + TP (torchtitan):

- a tensor-parallel parameter's view has the placements of its state-dict entry (`view_spec`:
  `tensor_parallel.state_dict_placements`, fully_shard's then the tp one) and the global shape;
- every other parameter of the call (a plain head, norms without SequenceParallel) has fully_shard's placements
  followed by `Replicate()` on tp and its own shape (`replicated_view_spec`): it is replicated over tp, and its
  dp row block (torch.chunk's, which is DTensor's `Shard(0)` split, uneven blocks included) is the local tensor.

So `p.full_tensor()` is the global parameter, an optimizer's in-place update of `p` writes the flat shard, and a
foreach optimizer's single list holds DTensors of one mesh only (DTensor refuses lists mixing them with plain
tensors). Each `.grad` is a DTensor with its parameter's spec around the reduced gradient's piece (`grads.py`).
State dicts do not change: they are built from the local tensors, a non-tp parameter's entry on fully_shard's own
mesh (`state/sharded.py`).

Where a DTensor cannot describe some tensor-parallel parameter's row block (`view_spec` is None: uneven dp blocks of
a dim-0 tp piece, a world mesh ordering tp before dp) or the call's tp parameters use different tp dimensions,
`dtensor_views_mesh` is None and EVERY view of the call stays plain, as with the flat layout (a 1-D slice of a
concatenation is no DTensor placement). All or nothing: one list of plain and DTensor tensors would break foreach
optimizers, while plain local tensors step exactly (element-wise updates of a parameter's own tensors).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_graph.runtime.misuse import ShardedDTensor
from fsdp_graph.runtime.tensor_parallel import TPSpec, state_dict_placements


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


def _tp_local_rows(spec: TPSpec) -> int:
    """Dim 0 of a tensor-parallel parameter's local piece (tp shards are even: `tp_spec_of` refuses others)."""
    return spec.shape[0] // spec.mesh.size() if spec.shard_dim == 0 else spec.shape[0]


def dtensor_views_mesh(
    specs: list[TPSpec], fsdp_mesh: DeviceMesh | None, fsdp_placements: tuple | list[tuple]
) -> DeviceMesh | None:
    """The tp dimension (of the world mesh) the DTensor views of one rows-layout fully_shard call add to fully_shard's
    mesh, or None when its views stay plain: no tensor-parallel parameters (`specs` empty), tp parameters on
    different tp dimensions (no one mesh holds them all), or one whose row block no DTensor describes.
    `fsdp_placements`: fully_shard's placements, or one tuple per spec (`Shard(d)`: shard_placement_fn's dims)."""
    meshes = {spec.mesh.mesh_dim_names for spec in specs}
    if fsdp_mesh is None or not fsdp_mesh.mesh_dim_names or len(meshes) != 1:
        return None
    if any(len(s.shape) == 0 for s in specs):  # no rows: the rows layout refuses it, naming the parameter
        return None
    per_spec = fsdp_placements if isinstance(fsdp_placements, list) else [fsdp_placements] * len(specs)
    if any(view_spec(s, fsdp_mesh, p, _tp_local_rows(s), torch.float32) is None for s, p in zip(specs, per_spec)):
        return None
    return specs[0].mesh


def replicated_view_spec(
    shape: torch.Size, fsdp_mesh: DeviceMesh, fsdp_placements: tuple, tp_mesh: DeviceMesh | None, dtype: torch.dtype
) -> DTensorSpec:
    """The spec of a rows-layout view of a parameter that is not tensor-parallel, in a call that has tensor-parallel
    ones: on fully_shard's mesh dimensions then the tp one, fully_shard's placements then `Replicate()` (the
    parameter is the same on every tp rank), the parameter's own shape. Its local tensor, the rank's `Shard(0)`
    row block, is torch.chunk's (the rows layout's), uneven or empty blocks included. Without `tp_mesh`
    (`fully_shard(dtensor_params=True)`, no tensor parallelism): on fully_shard's mesh, with its placements."""
    stride = torch.empty(shape, device="meta").stride()
    if tp_mesh is None:
        return DTensorSpec(fsdp_mesh, tuple(fsdp_placements), tensor_meta=TensorMeta(shape, stride, dtype))
    names = (*fsdp_mesh.mesh_dim_names, *tp_mesh.mesh_dim_names)
    mesh = fsdp_mesh._get_root_mesh()[names]
    return DTensorSpec(mesh, (*fsdp_placements, Replicate()), tensor_meta=TensorMeta(shape, stride, dtype))


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
        if local.device.type != dtensor.device.type:  # a meta-device model's `to_empty()`: `.data` cannot do it
            attributes = dict(dtensor.__dict__)
            torch.utils.swap_tensors(dtensor, type(dtensor)(local, spec, requires_grad=dtensor.requires_grad))
            dtensor.__dict__.update(attributes)
            return
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
