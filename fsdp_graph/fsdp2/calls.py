"""`fsdp_graph.fsdp2.fully_shard`: FSDP2's calling convention (one call per module, bottom-up, the root last) on
the native engine, which shards a model in one call on its root (docs/design-notes.md, "FSDP2's front door").

A call records the module (or list of modules: one unit) with its options and gives it a class deriving from
torch's `FSDPModule`; parameters stay as they are. The first use of a recorded module shards the calls of the
outermost called module containing it: a listing of its parameters (`parameters()`, also an outer module's: an
optimizer being built; `state_dict()`, `.to()`), `load_state_dict()`, a forward, or an `FSDPModule` method. That
outermost module is the root: the native `fully_shard` runs on it once, with the calls inside it as units (a list
call as one unit of several modules) and each call's reshard_after_forward. Other models' calls stay recorded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from fsdp_graph.api import controls
from fsdp_graph.api.config import CPUOffload, MixedPrecision, ParamPlacement, ShardingStrategy, UnitOptions
from fsdp_graph.api.fully_shard import fully_shard as native_fully_shard
from fsdp_graph.api.meshes import check_shard_dim
from fsdp_graph.api.placement import move_buffers, parameter_device
from fsdp_graph.fsdp2.module import FSDP2Module, fsdp2_class, on_pending_use
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.runtime.exposed import UnshardedParams
from fsdp_graph.runtime.unit import flat_params

_SHARDED_KEYS = ("_fsdp_views", "_fsdp_states", "_fsdp_root")


@dataclass(eq=False)
class _Call:
    modules: tuple[nn.Module, ...]
    mesh: DeviceMesh | None
    reshard_after_forward: bool | int | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: frozenset[nn.Parameter] = field(default_factory=frozenset)
    placements: dict[int, Shard | ParamPlacement] = field(default_factory=dict)  # id(param) -> its placement
    reuse_blocks: bool | None = None

    def describe(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"fully_shard({'[' + names + ']' if len(self.modules) > 1 else names})"


_PENDING: list[_Call] = []


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen, as FSDP2's default)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    reuse_blocks: bool | None = None,
) -> nn.Module | list[nn.Module]:
    """FSDP2's `fully_shard`: call it on each module to be a unit, bottom-up, the root last; returns its argument,
    whose modules are now `torch.distributed.fsdp.FSDPModule`s. A list of modules is one unit. Build the optimizer
    after the last call (its `model.parameters()` shards the recorded calls).

    - `mesh`: None (the world), a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), named dimensions or a
      flattened or unflattened view of a world mesh (torchtitan's); calls may differ.
    - `reshard_after_forward`: None (True, or False for the root), a bool, or an int dividing the shard dim's size.
    - `shard_placement_fn`: per parameter None, `Shard(d)` (any dim) or torch's `ShardPlacementResult(placement,
      mesh_info)` (a mesh of its own: expert parallelism); asked at this call, as FSDP2 asks it.
    - `mp_policy`, `offload_policy`: torch's own classes; calls may differ. `output_dtype` casts the floating-point
      outputs of every module a call names, as FSDP2.
    - `ignored_params`: left unsharded; their gradients are not reduced.
    - `reuse_blocks` (fsdp_graph's, not FSDP2's): the native `fully_shard`'s option for the model (compile one body
      for blocks of the same structure): None (default: where eligible), True (refuse what is not) or False (off).
      Calls of one model that set it must agree.
    """
    modules = tuple(module) if isinstance(module, list | tuple) else (module,)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fsdp2.fully_shard: expected a module or a non-empty list of modules, got {module!r}")
    call = _Call(
        modules,
        _checked_mesh(mesh),
        _checked_reshard(reshard_after_forward),
        _checked_mp(mp_policy),
        _checked_offload(offload_policy),
        frozenset(ignored_params or ()),
        reuse_blocks=_checked_reuse(reuse_blocks),
    )
    for m in modules:
        _check_not_called(m)
    if shard_placement_fn is not None:
        call.placements.update(_placements(call, shard_placement_fn))
    for m in modules:
        m.__dict__["_fsdp2_original_class"] = type(m)
        m.__class__ = _pending_class(type(m))
        m.__dict__["_parameters"] = _ShardsOnItems(m)
    _PENDING.append(call)
    return module


def shard_pending(trigger: str = "fsdp2.shard_pending()", used: nn.Module | None = None) -> None:
    """Shard the recorded calls (see the module docstring): those of the outermost called module containing `used`
    (None: all of them); `trigger` names the use, for error messages."""
    if not _PENDING:
        return
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"fsdp_graph.fsdp2: {trigger} under torch.compile found fully_shard calls not applied yet. Build the "
            "optimizer (model.parameters()), call fsdp_graph.fsdp2.shard_pending() or run one eager step before "
            "compiling the model."
        )
    subtree = {id(c): {id(s) for m in c.modules for s in m.modules()} for c in _PENDING}
    trees = []
    for outer in _PENDING:
        if any(c is not outer and _inside(outer, c, subtree) for c in _PENDING):
            continue
        if used is None or id(used) in subtree[id(outer)]:
            trees.append((outer, [c for c in _PENDING if c is not outer and _inside(c, outer, subtree)]))
    chosen = {id(c) for outer, inner in trees for c in (outer, *inner)}
    _PENDING[:] = [c for c in _PENDING if id(c) not in chosen]
    for outer, inner in trees:
        for call in (outer, *inner):
            for m in call.modules:
                m.__class__ = m.__dict__.pop("_fsdp2_original_class")
                m.__dict__["_parameters"] = dict(m._parameters)
    for outer, inner in trees:
        _shard_tree(outer, inner, trigger)


on_pending_use(shard_pending)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's `register_fsdp_forward_method`: `module.<method_name>(...)` gathers parameters as `forward` does
    (shards the recorded calls first)."""
    shard_pending("register_fsdp_forward_method", module)
    controls.register_fsdp_forward_method(module, method_name)


def _inside(call: _Call, other: _Call, subtree: dict[int, set[int]]) -> bool:
    return all(id(m) in subtree[id(other)] for m in call.modules)


def _shard_tree(root_call: _Call, inner: list[_Call], trigger: str) -> None:
    if len(root_call.modules) > 1:
        raise NotImplementedError(
            f"fsdp_graph.fsdp2: {root_call.describe()} is the outermost call when {trigger} used the model; a list "
            "of modules must be inside a later fully_shard call (e.g. on the model itself)."
        )
    root = root_call.modules[0]
    world = _world_mesh(root) if any(c.mesh is None for c in (root_call, *inner)) else None
    _check_no_param_in_two_calls(root, [*inner, root_call])
    reuse = _model_reuse_blocks([*inner, root_call])
    order = {id(m): i for i, m in enumerate(root.modules())}
    reshard: dict[nn.Module, bool | int] = {}
    wrap: list[nn.Module | tuple[nn.Module, ...]] = []
    unit_options: dict[nn.Module, UnitOptions] = {}
    for c in inner:
        unit = max(c.modules, key=lambda m: order[id(m)])
        wrap.append(c.modules if len(c.modules) > 1 else unit)
        reshard[unit] = True if c.reshard_after_forward is None else c.reshard_after_forward
        if (options := _unit_options(c, root_call, world)) is not None:
            unit_options[unit] = options
    reshard[root] = False if root_call.reshard_after_forward is None else root_call.reshard_after_forward
    mesh = root_call.mesh or world
    placements = {pid: p for c in (root_call, *inner) for pid, p in c.placements.items()}
    # FSDP2 shards a meta-device model on the meta device; `to_empty()` and the model's own init follow.
    on_meta = any(p.device.type == "meta" for p in root.parameters())
    native_fully_shard(
        root,
        mesh,
        wrap=wrap,
        strategy=_strategy(mesh),
        mixed_precision=_mixed_precision(root_call.mp_policy),
        reshard_after_forward=reshard,
        ignored_params=set().union(*(c.ignored_params for c in [root_call, *inner])),
        cpu_offload=_cpu_offload(root_call.offload_policy),
        device="meta" if on_meta else None,
        param_init_fn=_left_uninitialised if on_meta else None,
        dtensor_params=True,
        shard_placement_fn=(lambda p: placements.get(id(p))) if placements else None,
        unit_options=unit_options,
        reuse_blocks=reuse,
    )
    root.__dict__["_fsdp_root"].exposure = UnshardedParams()  # FSDP2's registered parameters after forward
    if on_meta:
        _compute_off_meta(root, mesh)
    for c in [*inner, root_call]:
        unit = root if c is root_call else max(c.modules, key=lambda m: order[id(m)])
        for m in c.modules:
            m.__dict__["_fsdp2_unit"] = unit
            m.__dict__["_fsdp2_root"] = root
            m.__class__ = fsdp2_class(type(m))


def _compute_off_meta(root: nn.Module, mesh: DeviceMesh) -> None:
    """A model sharded on meta with CPU offload: the engine took `device="meta"` (keep the parameters on meta) as
    the compute device too. Gathers and compute belong where the model would compute without meta (FSDP2: the
    mesh's device); the shards go to the CPU at `to_empty()` or an assign load, and the buffers not on meta move to
    the compute device as offload moves them."""
    device = parameter_device(mesh, None)
    offloaded = [s for s in flat_params(root) if s.compute_device is not None and s.compute_device.type == "meta"]
    for state in offloaded:
        state.compute_device = device
    if offloaded:
        move_buffers(root, device, all_devices=True)


def _strategy(mesh: DeviceMesh) -> ShardingStrategy:
    return ShardingStrategy.HYBRID_SHARD if mesh.ndim == 2 else ShardingStrategy.FULL_SHARD


def _mixed_precision(mp: MixedPrecisionPolicy) -> MixedPrecision:
    return MixedPrecision(
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        cast_forward_inputs=mp.cast_forward_inputs,
        cast_root_forward_inputs=mp.cast_forward_inputs,
        output_dtype=mp.output_dtype,
    )


def _cpu_offload(offload_policy: OffloadPolicy) -> CPUOffload | None:
    return CPUOffload(offload_params=True) if isinstance(offload_policy, CPUOffloadPolicy) else None


def _unit_options(call: _Call, root_call: _Call, world: DeviceMesh | None) -> UnitOptions | None:
    """The native unit options of `call` where its mesh, mp_policy or offload_policy differ from the root call's
    (FSDP2's per-call settings); None where all three are the root's."""
    mesh, root_mesh = call.mesh or world, root_call.mesh or world
    options = UnitOptions(
        mesh=mesh if mesh != root_mesh else None,
        mixed_precision=_mixed_precision(call.mp_policy) if call.mp_policy != root_call.mp_policy else None,
        cpu_offload=(
            _cpu_offload(call.offload_policy) or CPUOffload(offload_params=False)
            if call.offload_policy != root_call.offload_policy  # dataclasses: another class is never equal
            else None
        ),
    )
    return None if options == UnitOptions() else options


def _world_mesh(root: nn.Module) -> DeviceMesh:
    """FSDP2's default mesh: the world, 1-D, on the device type the world's collectives use for the model's
    parameters (over the world group itself: no new process group)."""
    device = next((p.device for p in root.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return DeviceMesh.from_group(torch.distributed.group.WORLD, collective_device(None, device).type)


def _left_uninitialised(module: nn.Module) -> None:
    """Meta-device models stay on meta: their owner calls `to_empty()` and initialises them after the calls."""


def _checked_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    if mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2)):
        raise ValueError(f"fsdp2.fully_shard: mesh must be a 1-D or 2-D DeviceMesh, got {mesh!r}")
    return mesh


def _checked_reshard(value: object) -> bool | int | None:
    if value is not None and not isinstance(value, bool | int):
        raise TypeError(f"fsdp2.fully_shard: reshard_after_forward must be None, a bool or an int, got {value!r}")
    return value


def _checked_mp(mp_policy: object) -> MixedPrecisionPolicy:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "fsdp2.fully_shard: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__} (fsdp_graph.MixedPrecision belongs to the native fully_shard)"
        )
    return mp_policy


def _checked_reuse(value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"fsdp2.fully_shard: reuse_blocks must be None, True or False, got {value!r}")
    return value


def _model_reuse_blocks(calls: list[_Call]) -> bool | None:
    """The model's `reuse_blocks`: the value the calls that set one gave (None when none did)."""
    given = {c.reuse_blocks: c for c in calls if c.reuse_blocks is not None}
    if len(given) > 1:
        raise ValueError(
            f"fsdp2.fully_shard: {given[True].describe()} has reuse_blocks=True but {given[False].describe()} has "
            "reuse_blocks=False; block reuse is one setting for the model: pass the same value (or leave it out)."
        )
    return next(iter(given), None)


def _check_no_param_in_two_calls(root: nn.Module, calls: list[_Call]) -> None:
    """FSDP2 refuses a parameter that two calls manage (torch 2.13's `_validate_no_duplicate_params`, ValueError at
    the first forward): a call manages the parameters of its modules and of their submodules not inside another
    call's modules, so tied weights read by modules of two calls (an embedding and an output head called apart) are
    in two FSDP groups. fsdp_graph would tie them in their lowest common unit instead; the error keeps code that
    FSDP2 refuses from passing here."""
    names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    owner = {id(m): c for c in calls for m in c.modules}
    ignored = {id(p) for c in calls for p in c.ignored_params}
    managed: dict[int, tuple[_Call, str]] = {}
    for call in calls:
        pending, seen = list(call.modules), set()
        while pending:
            module = pending.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            pending.extend(m for m in module.children() if owner.get(id(m), call) is call)
            for pname, p in module._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                fqn = f"{names.get(id(module), type(module).__name__)}.{pname}".lstrip(".")
                first = managed.setdefault(id(p), (call, fqn))
                if first[0] is not call:
                    raise ValueError(
                        f"fsdp2.fully_shard: parameter '{fqn}' is the same tensor as '{first[1]}' (shared or tied "
                        f"weights), already managed by another FSDP group: {_named(call, names)} and "
                        f"{_named(first[0], names)} each manage it: a parameter "
                        "may be in one FSDP group only (torch's FSDP2 raises this ValueError too). Put the modules "
                        "sharing it in one call, e.g. fully_shard([embedding, output_head]), or leave them to a call "
                        "on a module containing both."
                    )


def _named(call: _Call, names: dict[int, str]) -> str:
    """`call` as written, its modules by FQN in the root (`names`)."""
    fqns = [repr(names.get(id(m)) or type(m).__name__) for m in call.modules]
    return f"fully_shard({'[' + ', '.join(fqns) + ']' if len(fqns) > 1 else fqns[0]})"


def _checked_offload(offload_policy: object) -> OffloadPolicy:
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "fsdp2.fully_shard: offload_policy must be torch.distributed.fsdp.OffloadPolicy() or "
            f"CPUOffloadPolicy(), got {type(offload_policy).__name__}"
        )
    return offload_policy


def _check_not_called(module: nn.Module) -> None:
    if isinstance(module, FSDP2Module) or any(key in module.__dict__ for key in _SHARDED_KEYS):
        raise RuntimeError(
            f"fsdp2.fully_shard: {type(module).__name__} was already passed to fully_shard (or sharded by the native "
            "fsdp_graph.fully_shard); call fully_shard once per module, bottom-up, before the model is used."
        )
    for name, sub in module.named_modules():
        if any(key in sub.__dict__ for key in _SHARDED_KEYS):
            raise RuntimeError(
                f"fsdp2.fully_shard: '{name}' inside {type(module).__name__} was sharded when the model was first "
                "used (parameters(), forward, state_dict...). Call fully_shard on every module, bottom-up, the root "
                "last, before using the model."
            )


def _placements(call: _Call, shard_placement_fn: Callable[[nn.Parameter], Any]) -> dict[int, Shard | ParamPlacement]:
    """FSDP2 asks `shard_placement_fn` about the parameters this call manages (those of its modules that no earlier
    call manages, not ignored), at the call: each answer as the native `fully_shard` takes it, by parameter id.
    Parameters are listed without `parameters()`, which would shard the calls recorded so far."""
    earlier = {id(p) for c in _PENDING for m in c.modules for _, p in _raw_parameters(m)}
    placements: dict[int, Shard | ParamPlacement] = {}
    for m in call.modules:
        for name, p in _raw_parameters(m):
            if id(p) in earlier or id(p) in placements or p in call.ignored_params:
                continue
            result = _native_placement(shard_placement_fn(p), f"parameter '{name}' of {type(m).__name__}")
            if result is not None:
                placement = result if isinstance(result, Shard) else result.placement
                if placement is not None:  # refused at the call, as FSDP2 refuses it
                    check_shard_dim(p, placement, f"{name}' of '{type(m).__name__}")
                placements[id(p)] = result
    return placements


def _raw_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """`module.named_parameters()` (distinct parameters, in order) read from each submodule's `_parameters` dict
    itself: a recorded module's dict shards the recorded calls when listed (`_ShardsOnItems`)."""
    seen, found = set(), []
    for prefix, sub in module.named_modules():
        for name, p in dict.items(sub._parameters):
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append((f"{prefix}.{name}".lstrip("."), p))
    return found


def _native_placement(result: object, where: str) -> Shard | ParamPlacement | None:
    """A `shard_placement_fn` answer (None, `Shard(d)` or torch's `ShardPlacementResult(placement, mesh_info)`) as
    the native `fully_shard` takes it. torch's class is matched by its fields (torch 2.11 may lack it)."""
    if result is None or (isinstance(result, Shard) and type(result) is Shard):
        return result
    mesh_info = getattr(result, "mesh_info", None)
    if mesh_info is None or not hasattr(result, "placement"):
        raise TypeError(
            f"fsdp2.fully_shard: shard_placement_fn gave {where} {result!r}; return None, a Shard(dim) or a "
            "ShardPlacementResult(placement, mesh_info)."
        )
    mesh = getattr(mesh_info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fsdp2.fully_shard: shard_placement_fn gave {where} a mesh_info without a mesh: {mesh_info!r}")
    shard_dim = getattr(mesh_info, "shard_mesh_dim", None)
    replicate_dim = getattr(mesh_info, "replicate_mesh_dim", None)
    if (mesh.ndim, shard_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
        raise NotImplementedError(
            f"fsdp2.fully_shard: shard_placement_fn gave {where} a mesh_info over {mesh.ndim}-D mesh "
            f"{mesh.mesh_dim_names} with shard dim {shard_dim} and replicate dim {replicate_dim}; fsdp_graph takes "
            "FSDP (a 1-D mesh) or HSDP (a 2-D (replicate, shard) mesh), as FSDP2's _get_mesh_info makes them."
        )
    return ParamPlacement(result.placement, mesh)


def _pending_class(cls: type) -> type:
    if cls not in _PENDING_CLASSES:
        _PENDING_CLASSES[cls] = type(f"FSDP{cls.__name__}", (_ShardsOnFirstUse, FSDP2Module, cls), {})
    return _PENDING_CLASSES[cls]


_PENDING_CLASSES: dict[type, type] = {}


class _ShardsOnItems(dict):
    """A recorded module's `_parameters` until sharding: iterating it shards first. nn.Module lists parameters
    through `_parameters.items()` (`named_parameters`, `.to()`, `state_dict`), so an optimizer built on an outer
    module nobody called fully_shard on still gets the sharded parameters."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module._parameters)
        self.module = weakref.ref(module)

    def items(self):
        shard_pending("a listing of the parameters", self.module())
        module = self.module()
        return module._parameters.items() if module is not None else super().items()


class _ShardsOnFirstUse:
    """A recorded module's uses that need the final parameters: each shards the recorded calls, then runs on
    the module's new class."""

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable:
        shard_pending("named_parameters()/parameters()", self)
        return self.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):
        shard_pending("state_dict()", self)
        return self.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any):
        shard_pending("load_state_dict()", self)
        return self.load_state_dict(*args, **kwargs)

    def _apply(self, *args: Any, **kwargs: Any):
        shard_pending("a .to()/.cuda()/.float()", self)
        return self._apply(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any):
        # Before nn.Module's call runs any hook: sharding installs the units' forward hooks, and the user's own
        # hooks then run once (a forward override would have to call the module again, running them twice).
        shard_pending("a forward", self)
        return self(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any):  # `module.forward(...)` called directly
        shard_pending("a forward", self)
        return self.forward(*args, **kwargs)
