"""One flat parameter of a unit, made: its layout over its mesh, this rank's shard, its `FlatParamState` and the
views that replace the original parameters (called by `fully_shard` once per unit, mesh and trainable/frozen)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_graph.api.config import CPUOffload, MixedPrecision, UnitOptions
from fsdp_graph.api.controls import FSDPModule
from fsdp_graph.api.meshes import MeshEntry, Meshes
from fsdp_graph.api.placement import moves_to
from fsdp_graph.runtime import offload
from fsdp_graph.runtime.dtensor_views import replicated_view_spec, view_spec
from fsdp_graph.runtime.flat_param import LAYOUTS
from fsdp_graph.runtime.init import materialize_module
from fsdp_graph.runtime.misuse import make_view
from fsdp_graph.runtime.shard_binding import bind_flat_shard
from fsdp_graph.runtime.tensor_parallel import TPSpec
from fsdp_graph.runtime.unit import FlatParamState, RootState, ViewSpec, swap_class


@dataclass(frozen=True)
class UnitSettings:
    """What one unit's flat parameters share: the unit's own mesh (its parameters' default), its mixed precision,
    its compute device under CPU offload (None: no offload), and its reshard_after_forward."""

    entry: MeshEntry
    mixed_precision: MixedPrecision
    compute_device: torch.device | None
    reshard: bool | int


@dataclass(frozen=True)
class Member:
    """One parameter going into a flat parameter: the original, its value (materialised, or its tp piece), every
    (module FQN, module, name) using it, its tensor-parallel spec and the dim it is sharded on."""

    param: nn.Parameter
    value: torch.Tensor
    uses: list
    tp: TPSpec | None
    dim: int


def unit_settings(
    unit_options: Mapping | None,
    units: list[nn.Module],
    unit_fqns: list[str],
    meshes: Meshes,
    mp: MixedPrecision,
    cpu_offload: CPUOffload | None,
    device: torch.device,
) -> dict[str, UnitSettings]:
    """Each unit's settings by FQN: the call's, overridden by `unit_options[unit or FQN]`. reshard is filled in
    later (`fully_shard` resolves it with each unit's mesh)."""
    by_fqn: dict[str, UnitOptions] = {}
    for key, value in (unit_options or {}).items():
        fqn = key if isinstance(key, str) else next((f for u, f in zip(units, unit_fqns) if u is key), None)
        if fqn not in unit_fqns:
            raise ValueError(f"fully_shard: unit_options names {key!r}, which is not a unit ({unit_fqns}).")
        if not isinstance(value, UnitOptions):
            raise TypeError(f"fully_shard: unit_options[{key!r}] must be a fsdp_graph.UnitOptions, got {value!r}")
        if value.mixed_precision is not None and value.mixed_precision.buffer_dtype != mp.buffer_dtype:
            raise ValueError(
                f"fully_shard: unit_options[{key!r}] has MixedPrecision(buffer_dtype="
                f"{value.mixed_precision.buffer_dtype}); buffers are cast once for the whole model: give every unit "
                "the call's buffer_dtype."
            )
        by_fqn[fqn] = value
    settings = {}
    for fqn in unit_fqns:
        option = by_fqn.get(fqn, UnitOptions())
        if option.mixed_precision is not None and not isinstance(option.mixed_precision, MixedPrecision):
            raise TypeError(f"fully_shard: unit_options[{fqn!r}].mixed_precision must be a fsdp_graph.MixedPrecision")
        offload_of = cpu_offload if option.cpu_offload is None else option.cpu_offload
        settings[fqn] = UnitSettings(
            meshes.entry(option.mesh),
            option.mixed_precision or mp,
            device if offloads_params(offload_of) else None,
            False,
        )
    return settings


def offloads_params(cpu_offload: CPUOffload | None) -> bool:
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"fully_shard: cpu_offload must be a fsdp_graph.CPUOffload, got {cpu_offload!r}")
    return cpu_offload is not None and cpu_offload.offload_params


def check_flat_params(name: str, members: list[Member]) -> None:
    first = members[0].value
    for member in members:
        p = member.value
        if p.dtype != first.dtype or p.device != first.device:
            module_fqn, _, pname = member.uses[0]
            fqn = f"{module_fqn}.{pname}".lstrip(".")
            raise TypeError(
                f"fully_shard: unit '{name or '<root>'}' mixes {first.dtype} on {first.device} with "
                f"{p.dtype} on {p.device} (parameter '{fqn}'). A flat parameter needs one dtype and device: "
                "cast the model (model.to(dtype)) or make that module its own unit with the wrap policy."
            )


def unit_values(members, params, uses, param_init_fn, device, tp) -> dict[int, torch.Tensor]:
    """Each member's value: itself, or for meta-device parameters, freshly initialised on `device` one owning
    module at a time (this unit's parameters are the most any rank holds unsharded at once; a tensor-parallel
    parameter's value is its tp piece)."""
    values = {pid: params[pid] for pid in members}
    for pid in members:
        if values[pid].device.type != "meta":
            continue
        module_fqn, module, _ = uses[pid][0]
        materialized = materialize_module(module, module_fqn or "<root>", device, param_init_fn, tp)
        for old_id, value in materialized.items():
            if old_id in values:
                values[old_id] = value
    return values


def shard_flat_param(
    unit: nn.Module,
    name: str,
    members: list[Member],
    entry: MeshEntry,
    settings: UnitSettings,
    post_forward: tuple[str, str] | None,
    root_state: RootState,
    device: torch.device,
    layout_kind: str,
    views_tp_mesh: DeviceMesh | None | bool,
) -> FlatParamState:
    """Shard `members` over `entry`'s groups into one flat parameter of `unit` named `name`, replace each original
    by its view, and return the flat parameter's state."""
    check_flat_params(name, members)
    groups, mp = entry.groups, settings.mixed_precision
    layout = LAYOUTS[layout_kind].build(
        [
            (tuple(f"{m}.{n}".lstrip(".") for m, _, n in member.uses), member.value.shape, member.dim)
            for member in members
        ],
        groups.shard_world,
        groups.shard_rank,
    )
    shard = layout.shard_of([member.value for member in members])
    compute_device = settings.compute_device
    if compute_device is not None and shard.device.type != "meta":  # pinned: host-to-device copies can be async
        shard = offload.pinned(shard.to("cpu"))  # (a meta shard goes to the CPU at `to_empty()` or an assign load)
    elif moves_to(shard.device, device):
        shard = shard.to(device)
    shard.requires_grad_(members[0].param.requires_grad)
    index = len(unit.__dict__.get("_fsdp_states", []))
    tp = [member.tp for member in members]
    state = FlatParamState(
        module=unit,
        index=index,
        name=name,
        layout=layout,
        group_name=groups.shard_name,
        world=groups.shard_world,
        reshard_after_forward=settings.reshard is not False,
        root=root_state,
        param_dtype=mp.param_dtype if mp.param_dtype != shard.dtype else None,
        reduce_dtype=mp.effective_reduce_dtype,
        replicate_group=groups.replicate_name,
        reduce_group=groups.reduce_name,
        replicate_world=groups.replicate_world,
        grad_dtype=mp.param_dtype if mp.keep_low_precision_grads else None,
        compute_device=compute_device,
        tp=tuple(tp) if any(spec is not None for spec in tp) else (),
        mesh=entry.mesh,
        placements=entry.placements,
    )
    if post_forward is not None:
        state.post_forward_world, (state.piece_group, state.post_forward_group) = settings.reshard, post_forward
    for slot_index, member in enumerate(members):
        dtensor_spec = None
        slot = layout.slots[slot_index]
        if views_tp_mesh is not False:  # rows layout with tp parameters or dtensor_params: every view a DTensor
            if member.tp is None:
                dtensor_spec = replicated_view_spec(
                    slot.shape, entry.mesh, entry.placements_for(slot.dim), views_tp_mesh, shard.dtype
                )
            else:
                placements = entry.placements_for(slot.dim)
                dtensor_spec = view_spec(member.tp, entry.mesh, placements, slot.shape[0], shard.dtype)
        view = make_view(member.param, slot.fqns[0], shard, dtensor_spec)
        state.views.append(view)
        state.owners.append([(module, pname) for _, module, pname in member.uses])
        for _, module, pname in member.uses:
            module._parameters[pname] = view
            module.__dict__.setdefault("_fsdp_views", {})[pname] = ViewSpec(unit, index, slot_index)
    unit.__dict__.setdefault("_fsdp_states", []).append(state)
    bind_flat_shard(state, shard)
    owners = {id(m): m for member in members for _, m, _ in member.uses}
    owners[id(unit)] = unit
    for module in owners.values():
        views = frozenset(module.__dict__.get("_fsdp_views", {}))
        swap_class(module, views, unit_base=FSDPModule if "_fsdp_states" in module.__dict__ else None)
    return state
