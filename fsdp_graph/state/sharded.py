"""Sharded state dicts in FSDP2's layout: original FQNs, DTensor values sharded on their shard dim (0 unless a
placement said otherwise) over their flat parameter's mesh (per-parameter meshes: each on its own).

The flat layout is not FSDP2's per-parameter dim-0 sharding, so converting moves data: each flat parameter
is gathered (one at a time: a unit is the most any rank holds unsharded) and every parameter is re-chunked on
dim 0 the way `DTensor` with `Shard(0)` expects (`torch.chunk` semantics). With the rows layout each parameter
view already IS its `Shard(d)` local tensor: the DTensors wrap the views and nothing moves. `module_state` shows
these DTensors to each module's own state-dict code. Either way `model.state_dict()` goes straight into `torch.distributed.checkpoint` (DCP), which reshards across world sizes
and reads and writes checkpoints of torch's own FSDP2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_graph import compat
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.runtime.tensor_parallel import TPSpec, state_dict_placements, tp_local_of
from fsdp_graph.runtime.unit import FlatParamState


def gather_flat(state: FlatParamState, local: torch.Tensor) -> torch.Tensor:
    """The full padded flat tensor of which `local` is this rank's shard (collective over the shard group)."""
    if state.world == 1:
        return local.clone()
    home = local.device
    group = dist.distributed_c10d._resolve_process_group(state.group_name)
    # CPU offload prefers the compute device: a mixed cpu:gloo,cuda:nccl group then gathers over NCCL.
    local = local.to(collective_device(group, state.compute_device or local.device))
    full = local.new_empty(state.layout.padded_numel)
    compat.all_gather_single(full, local.contiguous(), group=group)
    return full.to(home)


def state_dict_mesh(state: FlatParamState) -> DeviceMesh:
    """The mesh a flat parameter's state-dict DTensors live on: its own (fully_shard's, a unit's or a placement's),
    else the world's, on the device type the world's collectives use for the flat shards where they are NOW (a model
    moved by `.cuda()` after fully_shard must not get a CPU mesh over NCCL)."""
    if state.mesh is not None:
        return state.mesh
    root = state.root
    shard_device = root.flat_params[0].flat_shard.device if root.flat_params else torch.device("cpu")
    device_type = collective_device(None, shard_device).type
    if device_type not in root.world_meshes:
        root.world_meshes[device_type] = DeviceMesh.from_group(dist.group.WORLD, device_type)
    return root.world_meshes[device_type]


def slot_placements(state: FlatParamState, slot_index: int) -> tuple:
    """The DTensor placements of slot `slot_index`'s parameter on its flat parameter's mesh: `Shard(dim)` over the
    shard dim (the dim its layout shards it on), Replicate over replicas."""
    dim = state.layout.slots[slot_index].dim
    return tuple(Shard(dim) if isinstance(p, Shard) else p for p in state.placements)


def to_dtensor(full: torch.Tensor, state: FlatParamState) -> DTensor:
    """`full` (identical on every rank) as a DTensor on `state`'s mesh, this rank holding its dim-0 chunk (the flat
    layout: every parameter `Shard(0)`)."""
    mesh = state_dict_mesh(state)
    placements = state.placements if full.dim() > 0 else tuple(Replicate() for _ in state.placements)
    local = full
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            n, coordinate = mesh.size(dim), mesh.get_local_rank(dim)
            chunks = local.chunk(n, dim=0)
            local = chunks[coordinate] if coordinate < len(chunks) else local.new_empty((0, *local.shape[1:]))
    return DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _tp_spec(state: FlatParamState, slot_index: int) -> TPSpec | None:
    return state.tp[slot_index] if state.tp else None


def _tp_placements(state: FlatParamState, spec: TPSpec, slot_index: int) -> tuple:
    slot = state.layout.slots[slot_index]
    placements = tuple(Shard(slot.dim) if isinstance(p, Shard) else p for p in state.placements)
    return state_dict_placements(spec, state_dict_mesh(state), placements, slot.shape[0])


def tp_dtensor(local_rows: torch.Tensor, state: FlatParamState, slot_index: int) -> DTensor:
    """A tensor-parallel parameter's dp row block of its tp piece as the global parameter's DTensor on the (dp, tp)
    mesh, no copy (`tensor_parallel.state_dict_placements`)."""
    spec = state.tp[slot_index]
    mesh, placements = _tp_placements(state, spec, slot_index)
    return DTensor.from_local(local_rows, mesh, placements, run_check=False, shape=spec.shape, stride=spec.stride)


def _dp_rows(value: torch.Tensor, state: FlatParamState) -> torch.Tensor:
    """This rank's `Shard(0)` row block (torch.chunk) of `value` over the shard group, whatever the layout."""
    rows = -(-value.shape[0] // state.world)
    return value[state.layout.rank * rows : (state.layout.rank + 1) * rows]


def local_dtensor(local: torch.Tensor, state: FlatParamState, slot_index: int) -> DTensor:
    """A rows-layout parameter's piece (`local`, shaped like its view) as the full parameter's DTensor (`Shard(d)`
    on its shard dim), no copy."""
    if _tp_spec(state, slot_index) is not None:
        return tp_dtensor(local, state, slot_index)
    slot = state.layout.slots[slot_index]
    stride = torch.empty(slot.shape, device="meta").stride()
    return DTensor.from_local(
        local,
        state_dict_mesh(state),
        slot_placements(state, slot_index),
        run_check=False,
        shape=slot.shape,
        stride=stride,
    )


def _is_own_local(value: DTensor, state: FlatParamState, slot_index: int) -> bool:
    """Whether `value` is sharded exactly as the rows layout shards it here (then its local tensor is ours)."""
    spec = _tp_spec(state, slot_index)
    if spec is not None:
        mesh, placements = _tp_placements(state, spec, slot_index)
        return state.layout.kind == "rows" and tuple(value.placements) == placements and value.device_mesh == mesh
    return (
        state.layout.kind == "rows"
        and tuple(value.placements) == slot_placements(state, slot_index)
        and value.device_mesh == state_dict_mesh(state)
    )


def local_range_of(value: torch.Tensor, state: FlatParamState, slot_index: int) -> torch.Tensor:
    """This rank's piece of a parameter-shaped tensor (full tensor or DTensor, identical on every rank), shaped like
    the parameter's view (1-D with the flat layout, the row block with rows)."""
    slot, spec = state.layout.slots[slot_index], _tp_spec(state, slot_index)
    shape = slot.shape if spec is None else spec.shape
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"load_state_dict: '{slot.fqns[0]}' has shape {tuple(value.shape)} in the state dict but "
            f"{tuple(shape)} in the model."
        )
    if isinstance(value, DTensor):
        if _is_own_local(value, state, slot_index):
            return value.to_local().detach().to(state.flat_shard.dtype)
        value = value.full_tensor()
    if spec is not None:
        value = tp_local_of(value, spec)
    return state.layout.local_piece(value, slot).to(state.flat_shard.dtype)


def gathered_dtensor(value: torch.Tensor, state: FlatParamState, slot_index: int) -> DTensor:
    """A parameter-shaped tensor gathered over the shard group (a tensor-parallel parameter's tp piece) as its
    sharded state-dict DTensor: `to_dtensor`, or for tensor-parallel parameters `tp_dtensor` of its dp rows."""
    if _tp_spec(state, slot_index) is not None:
        return tp_dtensor(_dp_rows(value, state).clone(), state, slot_index)
    return to_dtensor(value, state)
