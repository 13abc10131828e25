"""`fully_shard`: turn a model's parameters into one flat shard per unit, in place (DESIGN §1, §4)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_graph import ops as _ops  # noqa: F401  (registers the fsdp:: ops)
from fsdp_graph.flat_param import FlatParamLayout
from fsdp_graph.unit import (
    RootState,
    ShardingStrategy,
    UnitState,
    ViewSpec,
    bind_flat_shard,
    install_forward_hooks,
    is_sharded,
    swap_class,
)
from fsdp_graph.wrap import auto_wrap_policy

WrapPolicy = Callable[[nn.Module], list[nn.Module]]


def fully_shard(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    wrap: WrapPolicy | list[nn.Module] | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
) -> nn.Module:
    """Shard `model` in place over `mesh` (default: the whole world) and return it.

    `wrap` picks the units: a policy (`ModuleWrapPolicy`, `size_based_wrap_policy`, any callable
    `root -> [modules]`), an explicit list of modules, or None for the automatic policy (the blocks of the
    largest same-typed ModuleList/Sequential). The root is always the last unit and takes what is left.
    Create the optimizer AFTER this call: parameters are replaced by 1-D views of this rank's shard.
    """
    group = _resolve_group(mesh)
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"fully_shard: strategy must be a fsdp_graph.ShardingStrategy, got {strategy!r}")
    _check_not_sharded(model)
    module_fqns = {id(m): name for name, m in model.named_modules()}
    units = _select_units(model, wrap, module_fqns)
    unit_fqns = [module_fqns[id(u)] for u in units]
    params, uses = _collect_parameters(model)
    assignment = _assign_to_units(params, uses, unit_fqns)

    world, rank = group.size(), group.rank()
    root_state = RootState()
    for unit, unit_fqn in zip(units, unit_fqns):
        members = [pid for pid in params if assignment[pid] == unit_fqn]
        if not members:
            continue
        _check_unit_params(unit_fqn, [params[pid] for pid in members], uses, members)
        layout = FlatParamLayout.build(
            [(tuple(f"{m}.{n}".lstrip(".") for m, _, n in uses[pid]), params[pid].shape) for pid in members],
            world,
            rank,
        )
        _shard_unit(
            unit,
            unit_fqn,
            layout,
            [params[pid] for pid in members],
            [uses[pid] for pid in members],
            group,
            strategy,
            root_state,
        )
        root_state.units.append(unit)
    model.__dict__["_fsdp_root"] = root_state
    return model


def _resolve_group(mesh: DeviceMesh | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fully_shard needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets the environment)."
        )
    if mesh is None:
        return dist.group.WORLD
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh)}")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard: a {mesh.ndim}-D mesh (HYBRID_SHARD) is not supported yet; pass a 1-D mesh or mesh=None."
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"fully_shard: the mesh has {mesh.size()} ranks but the process group has {dist.get_world_size()}; "
            f"build it with init_device_mesh(device_type, ({dist.get_world_size()},)) or pass mesh=None."
        )
    return mesh.get_group()


def _check_not_sharded(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if is_sharded(module):
            root_class = getattr(type(model), "_fsdp_original_class", type(model))
            raise RuntimeError(
                f"fully_shard: module '{name or root_class.__name__}' is already sharded. Call fully_shard once, "
                "on the root model, and choose the nested units with wrap=ModuleWrapPolicy({...})."
            )


def _select_units(model: nn.Module, wrap, module_fqns: dict[int, str]) -> list[nn.Module]:
    if wrap is None:
        chosen = auto_wrap_policy(model)
    elif isinstance(wrap, (list, tuple)):
        chosen = list(wrap)
    elif callable(wrap):
        chosen = list(wrap(model))
    else:
        raise TypeError(f"fully_shard: wrap must be a policy, a list of modules or None, got {type(wrap)}")
    for m in chosen:
        if id(m) not in module_fqns:
            raise ValueError(f"fully_shard: wrap selected a {type(m).__name__} that is not a submodule of the model.")
    order = {mid: i for i, mid in enumerate(module_fqns)}
    units = sorted({id(m): m for m in chosen if m is not model}.values(), key=lambda m: order[id(m)])
    return units + [model]


def _collect_parameters(model: nn.Module):
    """Distinct parameters in registration order, and every (module FQN, module, name) using each."""
    params: dict[int, nn.Parameter] = {}
    uses: dict[int, list[tuple[str, nn.Module, str]]] = defaultdict(list)
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{module_fqn}.{name}".lstrip(".")
            if not p.is_floating_point():
                raise TypeError(
                    f"fully_shard: parameter '{fqn}' has dtype {p.dtype}; only floating-point parameters can be "
                    "sharded. Register it as a buffer (module.register_buffer) instead."
                )
            if p.device.type == "meta":
                raise NotImplementedError(
                    f"fully_shard: parameter '{fqn}' is on the meta device; meta-device construction is not "
                    "supported yet. Materialise the model (e.g. model.to_empty(device=...) and reset_parameters()) "
                    "before fully_shard."
                )
            params.setdefault(id(p), p)
            if (module_fqn, name) not in {(f, n) for f, _, n in uses[id(p)]}:
                uses[id(p)].append((module_fqn, module, name))
    return params, uses


def _parts(fqn: str) -> list[str]:
    return fqn.split(".") if fqn else []


def _assign_to_units(params, uses, unit_fqns: list[str]) -> dict[int, str]:
    """Each parameter goes to the innermost unit containing all its uses (their lowest common ancestor)."""

    def owner(module_fqn: str) -> str:
        parts = _parts(module_fqn)
        best = ""
        for u in unit_fqns:
            up = _parts(u)
            if parts[: len(up)] == up and len(up) > len(_parts(best)):
                best = u
        return best

    assignment = {}
    for pid in params:
        owners = [_parts(owner(m)) for m, _, _ in uses[pid]]
        common = owners[0]
        for o in owners[1:]:
            n = 0
            while n < min(len(common), len(o)) and common[n] == o[n]:
                n += 1
            common = common[:n]
        assignment[pid] = owner(".".join(common))
    return assignment


def _check_unit_params(unit_fqn: str, params: list[nn.Parameter], uses, members: list[int]) -> None:
    first = params[0]
    for p, pid in zip(params, members):
        fqn = ".".join(filter(None, uses[pid][0][::2]))
        if p.dtype != first.dtype or p.device != first.device:
            raise TypeError(
                f"fully_shard: unit '{unit_fqn or '<root>'}' mixes {first.dtype} on {first.device} with "
                f"{p.dtype} on {p.device} (parameter '{fqn}'). A flat parameter needs one dtype and device: "
                "cast the model (model.to(dtype)) or make that module its own unit with the wrap policy."
            )


def _shard_unit(unit, unit_fqn, layout, params, param_uses, group, strategy, root_state) -> None:
    flat = layout.flatten(params)
    shard = flat[layout.shard_start : layout.shard_start + layout.shard_numel].clone()
    shard.requires_grad_(any(p.requires_grad for p in params))
    del flat
    state = UnitState(
        name=unit_fqn,
        layout=layout,
        group_name=group.group_name,
        world=layout.world,
        reshard_after_forward=strategy is ShardingStrategy.FULL_SHARD,
        root=root_state,
    )
    for slot_index, (orig, slot_uses) in enumerate(zip(params, param_uses)):
        view = nn.Parameter(torch.empty(0, dtype=orig.dtype, device=orig.device), requires_grad=orig.requires_grad)
        view.__dict__.update({k: v for k, v in orig.__dict__.items() if not k.startswith("_")})
        state.views.append(view)
        for _, module, name in slot_uses:
            module._parameters[name] = view
            module.__dict__.setdefault("_fsdp_views", {})[name] = ViewSpec(unit, slot_index)
    unit._fsdp_state = state
    bind_flat_shard(unit, shard)
    owners = {id(m): m for uses in param_uses for _, m, _ in uses}
    owners[id(unit)] = unit
    for module in owners.values():
        names = frozenset(module.__dict__.get("_fsdp_views", {}))
        swap_class(module, names, is_unit="_fsdp_state" in module.__dict__)
    install_forward_hooks(unit, root_state)
