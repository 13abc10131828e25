"""`fully_shard`: turn a model's parameters into flat shards, one per unit (DESIGN §1, §4), in place."""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_graph import compat
from fsdp_graph.api.config import CPUOffload, MixedPrecision, ParamPlacement, ShardingStrategy, UnitOptions
from fsdp_graph.api.controls import FSDPModule
from fsdp_graph.api.meshes import Meshes, mesh_suffix, param_placements, post_forward_for
from fsdp_graph.api.placement import move_buffers, parameter_device
from fsdp_graph.api.shard_unit import Member, shard_flat_param, unit_settings, unit_values
from fsdp_graph.api.wrap import auto_wrap_policy, check_group
from fsdp_graph.compiler import gc_pause
from fsdp_graph.ir import ops as _ops  # noqa: F401  (registers the fsdp:: ops)
from fsdp_graph.runtime.block_region import (
    buffer_refusals,
    complex_refusals,
    keep_complex_bodies_exact,
    make_reusable,
    reuse_lost,
    reuse_refusals,
)
from fsdp_graph.runtime.composable_checkpoint import adopt_composable_checkpoints
from fsdp_graph.runtime.dtensor_views import dtensor_views_mesh
from fsdp_graph.runtime.flat_param import LAYOUTS
from fsdp_graph.runtime.held import track_kept_gathers
from fsdp_graph.runtime.init import materialize_buffers, sync_module_states_from_rank0
from fsdp_graph.runtime.tensor_parallel import TPSpec, tp_spec_of
from fsdp_graph.runtime.unit import RootState, install_forward_hooks, is_sharded, swap_class
from fsdp_graph.state import module_state

WrapPolicy = Callable[[nn.Module], list[nn.Module]]
UnitChoice = nn.Module | tuple[nn.Module, ...] | list[nn.Module]
ReshardSpec = bool | int | None | Mapping[nn.Module | str, bool | int]


def fully_shard(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    wrap: WrapPolicy | list[UnitChoice] | None = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: ReshardSpec = None,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
    param_init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    sync_module_states: bool = False,
    cpu_offload: CPUOffload | None = None,
    separate_reduce_group: bool = False,
    layout: str = "rows",
    reuse_blocks: bool | None = None,
    dtensor_params: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ParamPlacement | None] | None = None,
    unit_options: Mapping[nn.Module | str, UnitOptions] | None = None,
) -> nn.Module:
    """Shard `model` in place over `mesh` and return it. Create the optimizer AFTER this call.

    - `wrap`: the units. A policy (`ModuleWrapPolicy`, `size_based_wrap_policy`, any `root -> [modules]`),
      a list of modules, or None (the blocks of the largest same-typed ModuleList/Sequential/ModuleDict). The
      root is always the last unit and takes what is left. In a list, a tuple of modules is ONE unit (FSDP2's
      `fully_shard([norm, head])`): one flat parameter for their parameters, gathered at the first read of one of
      them, freed after the forward of the last of them in model order (which holds it).
    - `mesh`: None (the world) or a 1-D DeviceMesh; a 2-D (replicate, shard) mesh for HYBRID strategies. It may
      be named dimensions of a mesh over the world (`world_mesh["dp"]`), or a flattened or `_unflatten`ed view of
      one (torchtitan's `ParallelDims` meshes).
    - `shard_placement_fn(param)`: per parameter, None (`Shard(0)` over its unit's mesh), a `Shard(d)` (FSDP2's
      layout on dim d: torch.chunk on d, uneven or empty chunks, the local tensor contiguous; rows layout), or a
      `ParamPlacement(Shard(d), mesh)` for a mesh of its own (expert parallelism: experts over `efsdp`, the rest
      over `fsdp`). A unit then holds one flat parameter per mesh, each gathered and reduced over its own mesh's
      groups (one all-gather per unit and mesh); its name has the mesh's dim names appended (`"layers.0[efsdp]"`).
      A 1-D mesh shards, a 2-D one is HSDP, with the call's resharding. Asked once per parameter, before sharding.
    - `unit_options`: a mapping from unit module or FQN ("" = root) to `UnitOptions(mesh=, mixed_precision=,
      cpu_offload=)`, each None to keep the call's: units may differ in mesh (their parameters' default),
      mixed precision and CPU offload (FSDP2's per-call settings).
    - `reshard_after_forward`: None (the strategy's default), a bool or an int for every unit, or a mapping from
      unit module or FQN ("" = root) to either; units not in the mapping keep the default. An int k dividing the
      shard group's N ranks frees the gathered parameters after forward down to a 1/k piece, so the backward
      re-gathers within groups of k consecutive ranks only (a node); k == N is True, k == 1 is False.
    - `mixed_precision`: see `MixedPrecision`.
    - `ignored_modules` / `ignored_params`: left as ordinary replicated parameters; their gradients are not
      reduced.
    - `device`: where parameters and buffers live. Default: the mesh's device type (FSDP2), or with mesh=None the
      device the world group's collectives run on (the current CUDA device for NCCL and `cpu:gloo,cuda:nccl`, the
      CPU for gloo); an accelerator this process lacks is refused (ValueError: pass device=). Parameters and
      buffers on the CPU are moved there (each rank moves only its shard); ones already on a device stay.
    - Meta-device models: each unit's parameters are materialised on `device` one module at a
      time with `param_init_fn(module)` or `module.reset_parameters()`; only this rank's shard is kept.
    - `sync_module_states`: broadcast rank 0's parameters and buffers before sharding.
    - `cpu_offload=CPUOffload(offload_params=True)`: flat shards and gradients stay in CPU memory; `device` is
      then the compute device (default as above), where gathers, compute and buffers live.
    - `separate_reduce_group`: reduce gradients over a second process group with the shard group's ranks, so a
      reduce-scatter and a prefetched all-gather can run at the same time (NCCL runs one stream per group). Off by
      default: the overlap it buys is unmeasured, and each rank then holds a second communicator (its buffers).
    - `layout`: what a rank's shard of a unit holds, and so what the optimizer sees. "rows" (the default, FSDP2):
      each parameter's `Shard(0)` row block (torch.chunk: the last ranks may hold fewer rows or none) with its
      trailing dims, so `p.ndim`, row-wise optimizers and DTensor state dicts work; still one all-gather per unit,
      plus a copy of each parameter out of the gathered flat. "flat" (FSDP1): a contiguous 1/world range of the
      unit's concatenated parameters; each parameter is a 1-D slice, possibly empty; no copy, and padding per unit
      rather than per parameter. 0-dim parameters need "flat".
    - Tensor-parallel (DTensor) parameters from `parallelize_module(model, world_mesh["tp"], plan)`: with "rows"
      the optimizer sees each as a DTensor of the global parameter on `world_mesh["dp", "tp"]` (FSDP2 + TP's
      placements) whose local tensor is its row block in the flat shard, its `.grad` a DTensor alike, and every
      other parameter of the call as a DTensor on the same mesh, replicated over tp (`Shard(0)`, `Replicate()`):
      one mesh for all, so foreach optimizers step them together. With "flat" every view is a plain 1-D slice (of
      the tp-local piece for tp parameters: no DTensor placement describes it), as when some tp parameter's row
      block is not describable either (dim-0 tp pieces with uneven dp blocks): then all views stay plain.
    - `reuse_blocks`: None (the default) or True: under torch.compile, each unit other than the root gathers its
      flat parameters and then runs its forward as a `nested_compile_region` shared by every unit of the same
      structure: Dynamo, AOT autograd and Inductor compile one block body however deep the model
      (`fsdp_graph.runtime.block_region`). A unit whose subtree holds another unit, reads another unit's parameters
      or holds tensor-parallel ones cannot share one: with None such units are traced on their own, with one
      warning; with True it is refused (ValueError, before anything is sharded). A call whose arguments torch cannot
      reuse a body for (a KV cache object), or whose output the caller cannot rebuild from the body's tensors
      (anything but tensors, constants, arguments, and tuples, lists, dicts and dataclasses of them), runs that
      unit's forward on its own, with one warning. False: off. The warning names only units that lose a body they
      would have shared (another unit has the same module classes).
    - Modules under torch's composable `checkpoint()` run their forward through `torch.utils.checkpoint` instead
      (same options; `fsdp_graph.runtime.composable_checkpoint`), which torch.compile can trace.
    - `dtensor_params` (rows layout, a `mesh`): every parameter the optimizer sees is a DTensor on `mesh` whose
      local tensor is its row block (FSDP2's parameters; `fsdp_graph.fsdp2` sets it), as with tensor parallelism.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"fully_shard: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if dtensor_params and (layout != "rows" or mesh is None):
        raise ValueError("fully_shard: dtensor_params=True needs layout='rows' and a mesh (the DTensors' mesh).")
    meshes = Meshes(mesh, strategy, separate_reduce_group)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"fully_shard: mixed_precision must be a fsdp_graph.MixedPrecision, got {mixed_precision!r}")
    _check_not_sharded(model)
    module_fqns = {id(m): name for name, m in model.named_modules()}
    ignored = _ignored_param_ids(model, ignored_modules, ignored_params)
    units, group_members = _select_units(model, wrap, module_fqns, ignored_modules)
    unit_fqns = [module_fqns[id(u)] for u in units]
    params, uses, dtensor_fqns = _collect_parameters(model, ignored)
    owner_of_prefix = {fqn: fqn for fqn in unit_fqns}
    owner_of_prefix.update(
        {module_fqns[id(m)]: module_fqns[id(u)] for u, group in group_members.items() for m in group}
    )
    assignment = _assign_to_units(params, uses, owner_of_prefix)
    refused = reuse_refusals(unit_fqns[:-1], assignment, uses, dtensor_fqns) if reuse_blocks is not False else {}
    if reuse_blocks is not False:
        for unit in group_members:
            refused[module_fqns[id(unit)]] = f"unit {module_fqns[id(unit)]!r} is several modules (a tuple in wrap)"
        refused.update(complex_refusals({fqn: u for fqn, u in zip(unit_fqns[:-1], units) if fqn not in refused}))
        refused.update(buffer_refusals({fqn: u for fqn, u in zip(unit_fqns[:-1], units) if fqn not in refused}))
    if refused and reuse_blocks:
        raise ValueError(f"reuse_blocks: {next(iter(refused.values()))}")
    lost = reuse_lost(refused, units, unit_fqns, group_members)
    if lost:
        warnings.warn(
            f"reuse_blocks: {next(iter(lost.values()))}; {len(lost)} unit(s) traced on their own, not as a "
            "shared body with the units of the same structure (reuse_blocks=False turns reuse off, and this warning; "
            "fsdp_graph.fsdp2.fully_shard takes it too)",
            stacklevel=2,
        )
    mp = mixed_precision or MixedPrecision()
    device = parameter_device(mesh, device)
    options = unit_settings(unit_options, units, unit_fqns, meshes, mp, cpu_offload, device)
    unit_entries = {fqn: o.entry for fqn, o in options.items()}
    placed = param_placements(params, uses, assignment, unit_entries, meshes, shard_placement_fn)
    # checked against each parameter's own FSDP mesh: an expert's "efsdp", not the call's dense mesh
    tp = {pid: tp_spec_of(params[pid], fqn, placed[pid].entry.mesh) for pid, fqn in dtensor_fqns.items()}
    shard_worlds = {fqn: o.entry.groups.shard_world for fqn, o in options.items()}
    reshard = _resolve_reshard(reshard_after_forward, strategy, units, unit_fqns, shard_worlds)
    if tp:
        _check_tp_options(uses, tp, reshard, cpu_offload, sync_module_states, meshes, placed)
    if sync_module_states:
        sync_module_states_from_rank0(model, ignored)
    if mp.buffer_dtype is not None:
        _cast_buffers(model, mp.buffer_dtype, ignored_modules)

    root_state = RootState(mesh=mesh)
    track_kept_gathers(root_state)
    views_tp_meshes = _views_tp_meshes(layout, tp, placed, meshes, dtensor_params)
    post_forward: dict[tuple[int, int], tuple[str, str]] = {}
    for unit, unit_fqn in zip(units, unit_fqns):
        settings = dataclasses.replace(options[unit_fqn], reshard=reshard[unit_fqn])
        members = [pid for pid in params if assignment[pid] == unit_fqn]
        values = unit_values(members, params, uses, param_init_fn, device, tp)
        values.update({pid: params[pid].to_local() for pid in members if pid in tp and values[pid] is params[pid]})
        on_mesh: dict[int, list[int]] = {id(settings.entry): []}  # the unit's own mesh first
        for pid in members:
            on_mesh.setdefault(id(placed[pid].entry), []).append(pid)
        for group in on_mesh.values():
            if not group:
                continue
            entry = placed[group[0]].entry
            for frozen in (False, True):
                chosen = [pid for pid in group if params[pid].requires_grad is not frozen]
                if not chosen:
                    continue
                name = unit_fqn + mesh_suffix(entry, settings.entry) + ("[frozen]" if frozen else "")
                state = shard_flat_param(
                    unit,
                    name,
                    [Member(params[pid], values[pid], uses[pid], tp.get(pid), placed[pid].dim) for pid in chosen],
                    entry,
                    settings,
                    post_forward_for(post_forward, entry, settings.reshard, name),
                    root_state,
                    device,
                    layout,
                    views_tp_meshes[id(entry)] if views_tp_meshes is not None else False,
                )
                root_state.flat_params.append(state)
        del values
    materialize_buffers(model, device, param_init_fn)
    offloading = any(o.compute_device is not None for o in options.values())  # then every buffer goes there
    move_buffers(model, device, () if offloading else ignored_modules, all_devices=offloading)
    for unit, members in group_members.items():
        unit_mp = options[module_fqns[id(unit)]].mixed_precision
        for member in members:
            cast_to = unit_mp.param_dtype if unit_mp.cast_forward_inputs else None
            names = frozenset(member.__dict__.get("_fsdp_views", {}))
            swap_class(member, names, cast_inputs_to=cast_to, cast_outputs_to=unit_mp.output_dtype)
    for unit, unit_fqn in zip(units, unit_fqns):
        unit_mp = options[unit_fqn].mixed_precision
        casts = unit_mp.cast_forward_inputs or (unit is model and unit_mp.cast_root_forward_inputs)
        has_states = "_fsdp_states" in unit.__dict__
        if has_states or unit is model:  # the root is the forward boundary even if it owns nothing
            install_forward_hooks(unit, root_state)
        swap_class(
            unit,
            frozenset(unit.__dict__.get("_fsdp_views", {})),
            unit_base=FSDPModule if has_states else None,
            cast_inputs_to=unit_mp.param_dtype if casts else None,
            cast_outputs_to=unit_mp.output_dtype,
        )
    if reuse_blocks is not False:
        reusable = [
            unit
            for unit, unit_fqn in zip(units, unit_fqns)
            if unit is not model and "_fsdp_states" in unit.__dict__ and unit_fqn not in refused
        ]
        for unit in reusable:
            make_reusable(unit, strict=reuse_blocks is True)
            compat.note_shared_bodies()
        keep_complex_bodies_exact(reusable)
    model.__dict__["_fsdp_root"] = root_state
    module_state.install(model)
    adopt_composable_checkpoints(model)
    gc_pause.install()  # the model's compiles run with the cyclic collector paused
    return model


def _views_tp_meshes(layout: str, tp: dict[int, TPSpec], placed, meshes: Meshes, dtensor_params: bool):
    """Per mesh entry (by id), the tp dimension its flat parameters' DTensor views add to the entry's mesh (None:
    views on the entry's mesh alone), or None when every view of the call stays plain (`dtensor_views_mesh`: all or
    nothing). A call whose tp parameters all sit on one mesh is the TP case: every parameter on that mesh is viewed
    on (dp..., tp). Per-parameter meshes (torchtitan's EP: experts on "efsdp" and "ep", the rest on "fsdp") view
    each mesh's parameters as FSDP2 does: (efsdp, ep) for the experts, "fsdp" alone for the others."""
    if layout != "rows":
        return None
    views: dict[int, DeviceMesh | None] = {}
    for entry in meshes.entries:
        on_entry = [pid for pid in tp if placed[pid].entry is entry]
        specs = [tp[pid] for pid in on_entry]
        if specs:
            placements = [entry.placements_for(placed[pid].dim) for pid in on_entry]
            tp_mesh = dtensor_views_mesh(specs, entry.mesh, placements)
            if tp_mesh is None:
                return None
            views[id(entry)] = tp_mesh
        else:
            views[id(entry)] = None
    if not tp and not dtensor_params:
        return None
    return views


def _check_tp_options(uses, tp, reshard, cpu_offload, sync_module_states, meshes: Meshes, placed) -> None:
    """Options not built or not tested with tensor-parallel parameters are refused, naming one such parameter."""
    pid = next(iter(tp))
    module_fqn, _, name = uses[pid][0]
    where = f"'{f'{module_fqn}.{name}'.lstrip('.')}', a DTensor on {tp[pid].mesh.mesh_dim_names}"
    refused = [
        ("sync_module_states=True", sync_module_states, "each tp rank holds another piece, which a broadcast from "
         "rank 0 would overwrite; seed every rank alike before parallelize_module instead"),
        ("cpu_offload", cpu_offload is not None and cpu_offload.offload_params, "not tested yet; train without it"),
        ("reshard_after_forward=int", any(not isinstance(k, bool) for k in reshard.values()),
         "not tested yet; use True or False"),
    ]  # fmt: skip
    for option, given, why in refused:
        if given:
            raise NotImplementedError(
                f"fully_shard: {option} with tensor-parallel parameters (e.g. {where}) is not supported: {why}."
            )


def _check_not_sharded(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if is_sharded(module):
            root_class = getattr(type(model), "_fsdp_original_class", type(model))
            raise RuntimeError(
                f"fully_shard: module '{name or root_class.__name__}' is already sharded. Call fully_shard once, "
                "on the root model, and choose the nested units with wrap=ModuleWrapPolicy({...}); for FSDP2's "
                "one call per module, use fsdp_graph.fsdp2.fully_shard."
            )


def _ignored_param_ids(model: nn.Module, ignored_modules, ignored_params) -> set[int]:
    ids = {id(p) for m in ignored_modules for p in m.parameters()}
    ids |= {id(p) for p in ignored_params}
    if model in list(ignored_modules):
        raise ValueError("fully_shard: the root model itself is in ignored_modules; nothing would be sharded.")
    return ids


def _select_units(
    model: nn.Module, wrap, module_fqns: dict[int, str], ignored_modules
) -> tuple[list[nn.Module], dict[nn.Module, list[nn.Module]]]:
    """The unit modules in model order, the root last, and for each unit of several modules (a tuple in `wrap`)
    its other modules: the unit is the group's last module in model order."""
    if wrap is None:
        chosen = auto_wrap_policy(model)
    elif isinstance(wrap, list | tuple):
        chosen = list(wrap)
    elif callable(wrap):
        chosen = list(wrap(model))
    else:
        raise TypeError(f"fully_shard: wrap must be a policy, a list of modules or None, got {type(wrap)}")
    order = {mid: i for i, mid in enumerate(module_fqns)}
    inside_ignored = {id(sub) for m in ignored_modules for sub in m.modules()}
    members: dict[nn.Module, list[nn.Module]] = {}
    units = []
    for choice in chosen:
        group = list(choice) if isinstance(choice, list | tuple) else [choice]
        for m in group:
            if not isinstance(m, nn.Module) or id(m) not in module_fqns:
                raise ValueError(
                    f"fully_shard: wrap selected a {type(m).__name__} that is not a submodule of the model."
                )
        group = sorted(
            {id(m): m for m in group if m is not model and id(m) not in inside_ignored}.values(),
            key=lambda m: order[id(m)],
        )
        if not group:
            continue
        units.append(group[-1])
        if len(group) > 1:
            check_group([module_fqns[id(m)] for m in group])
            members[group[-1]] = group[:-1]
    units = sorted({id(m): m for m in units}.values(), key=lambda m: order[id(m)])
    return units + [model], members


def _collect_parameters(model: nn.Module, ignored: set[int]):
    """Distinct parameters in registration order, every (module FQN, module, name) using each, and the FQN of each
    DTensor (tensor- or expert-parallel) parameter."""
    params: dict[int, nn.Parameter] = {}
    uses: dict[int, list[tuple[str, nn.Module, str]]] = defaultdict(list)
    tp: dict[int, str] = {}
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = f"{module_fqn}.{name}".lstrip(".")
            if not p.is_floating_point():
                raise TypeError(
                    f"fully_shard: parameter '{fqn}' has dtype {p.dtype}; only floating-point parameters can be "
                    "sharded. Register it as a buffer (module.register_buffer) or pass it in ignored_params."
                )
            if isinstance(p, DTensor) and id(p) not in tp:
                tp[id(p)] = fqn
            params.setdefault(id(p), p)
            if (module_fqn, name) not in {(f, n) for f, _, n in uses[id(p)]}:
                uses[id(p)].append((module_fqn, module, name))
    return params, uses, tp


def _parts(fqn: str) -> list[str]:
    return fqn.split(".") if fqn else []


def _assign_to_units(params, uses, owner_of_prefix: dict[str, str]) -> dict[int, str]:
    """Each parameter goes to the innermost unit containing all its uses (their lowest common ancestor).
    `owner_of_prefix`: module FQN -> the unit owning its subtree (itself, or a group's unit for its members)."""

    def owner(module_fqn: str) -> str:
        parts = _parts(module_fqn)
        best_prefix, best = "", ""
        for prefix, unit in owner_of_prefix.items():
            up = _parts(prefix)
            if parts[: len(up)] == up and len(up) > len(_parts(best_prefix)):
                best_prefix, best = prefix, unit
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


def _resolve_reshard(
    spec: ReshardSpec, strategy: ShardingStrategy, units, unit_fqns, shard_worlds: dict[str, int]
) -> dict[str, bool | int]:
    """Each unit's reshard_after_forward: a bool, or an int k with 1 < k < its shard world dividing it (k == that
    world is True, k == 1 False); `shard_worlds`: each unit's own mesh's shard group size, by FQN."""
    default = strategy.default_reshard_after_forward
    if strategy is ShardingStrategy.NO_SHARD:
        if spec is not None and spec is not True:
            raise ValueError("fully_shard: NO_SHARD has nothing to reshard; leave reshard_after_forward=None.")
        return dict.fromkeys(unit_fqns, True)
    if spec is None or isinstance(spec, bool | int):
        return {fqn: default if spec is None else _reshard_value(spec, shard_worlds[fqn]) for fqn in unit_fqns}
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"fully_shard: reshard_after_forward must be None, a bool, an int or a mapping, got {type(spec)}"
        )
    by_key = {}
    for key, value in spec.items():
        fqn = key if isinstance(key, str) else next((f for u, f in zip(units, unit_fqns) if u is key), None)
        if fqn not in unit_fqns:
            raise ValueError(f"fully_shard: reshard_after_forward names {key!r}, which is not a unit ({unit_fqns}).")
        by_key[fqn] = _reshard_value(value, shard_worlds[fqn], key)
    return {fqn: by_key.get(fqn, default) for fqn in unit_fqns}


def _reshard_value(value, shard_world: int, key=None) -> bool | int:
    where = "" if key is None else f"[{key!r}]"
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"fully_shard: reshard_after_forward{where} must be a bool or an int, got {value!r}")
    divisors = [d for d in range(1, shard_world + 1) if shard_world % d == 0]
    if value not in divisors:
        raise ValueError(
            f"fully_shard: reshard_after_forward{where}={value} must divide the shard group's {shard_world} ranks: "
            f"one of {divisors} (1 is False, {shard_world} is True; k keeps a 1/k piece after forward, so the "
            "backward re-gathers within groups of k consecutive ranks)."
        )
    return True if value == shard_world else False if value == 1 else value


def _cast_buffers(model: nn.Module, dtype: torch.dtype, ignored_modules) -> None:
    skip = {id(sub) for m in ignored_modules for sub in m.modules()}
    for module in model.modules():
        if id(module) in skip:
            continue
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)
