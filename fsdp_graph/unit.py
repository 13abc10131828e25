"""Runtime state of sharded units and the class swap that exposes unsharded parameters in forward.

A unit module holds ONE flat shard (`_fsdp_flat_shard`, a plain tensor attribute that requires grad:
a graph input under Dynamo, not in `parameters()`). Every module owning a sharded parameter gets a
subclass whose property for that name returns a view of `fsdp.unshard(flat_shard, ...)` inside forward,
and the 1-D sharded `nn.Parameter` view (what the optimizer holds) outside forward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp_graph.flat_param import FlatParamLayout
from fsdp_graph.grads import install_grad_hook


class ShardingStrategy(enum.Enum):
    """FULL_SHARD: params, grads and optimizer state sharded; backward re-gathers (ZeRO-3).
    SHARD_GRAD_OP: forward keeps the gathered params for backward; grads and optimizer state sharded (ZeRO-2)."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"


@dataclass(eq=False)
class RootState:
    """Shared by every unit of one `fully_shard` call: the eager path's per-forward gather cache."""

    forward_depth: int = 0
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    units: list[nn.Module] = field(default_factory=list)


@dataclass(eq=False)
class UnitState:
    """The facts the `fsdp.unshard` call of one unit needs, plus its views."""

    name: str
    layout: FlatParamLayout
    group_name: str
    world: int
    reshard_after_forward: bool
    root: RootState
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    views: list[nn.Parameter] = field(default_factory=list)  # one per layout slot


@dataclass(frozen=True)
class ViewSpec:
    """Where a module's parameter lives: in which unit module, and at which slot of its layout."""

    unit: nn.Module
    slot: int


def unsharded_flat(unit: nn.Module) -> torch.Tensor | None:
    """The unit's full flat parameter, or None outside forward in eager mode (then callers expose shards).

    Compiled: always the op (the dedup pass keeps one per unit and dtype). Eager: one gather per unit per
    forward, cached until the outermost unit forward returns.
    """
    state: UnitState = unit._fsdp_state
    if torch.compiler.is_compiling():
        return _call_unshard(unit, state)
    root = state.root
    if root.forward_depth == 0:
        return None
    cached = root.gathered.get(state.name)
    if cached is None:
        cached = root.gathered[state.name] = _call_unshard(unit, state)
    return cached


def _call_unshard(unit: nn.Module, state: UnitState) -> torch.Tensor:
    return torch.ops.fsdp.unshard(
        unit._fsdp_flat_shard,
        state.name,
        state.group_name,
        state.world,
        state.param_dtype,
        state.reduce_dtype,
        state.reshard_after_forward,
    )


def _make_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        spec: ViewSpec = self._fsdp_views[name]
        flat = unsharded_flat(spec.unit)
        if flat is None:
            return self._parameters[name]
        slot = spec.unit._fsdp_state.layout.slots[spec.slot]
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    return property(get, doc=f"`{name}`: unsharded in forward, this rank's 1-D shard outside it (fsdp_graph).")


def bind_flat_shard(unit: nn.Module, flat_shard: torch.Tensor) -> None:
    """Make `flat_shard` the unit's storage: every original-parameter view is re-pointed at its range (the
    Parameter objects stay the same, so optimizers keep working) and the gradient hook moves with it."""
    state: UnitState = unit._fsdp_state
    layout = state.layout
    ranges = [layout.local_range(slot) for slot in layout.slots]
    base = flat_shard.detach()
    for view, (lo, hi) in zip(state.views, ranges):
        view.data = base[lo:hi]
    unit._fsdp_flat_shard = flat_shard
    install_grad_hook(flat_shard, state.views, ranges)


def _unit_apply(self: nn.Module, fn, recurse: bool = True):
    """`.to()`, `.double()`, `.cuda()`...: the views are converted one by one by nn.Module (which unlinks them
    from the flat shard); convert the flat shard once instead and re-point them."""
    result = self._fsdp_original_class._apply(self, fn, recurse)
    old = self._fsdp_flat_shard
    bind_flat_shard(self, fn(old.detach()).detach().requires_grad_(old.requires_grad))
    return result


_SWAPPED_CLASSES: dict[tuple[type, frozenset[str], bool], type] = {}


def swap_class(module: nn.Module, names: frozenset[str], is_unit: bool = False) -> None:
    """Give `module` a subclass with one property per sharded parameter name and, for a unit module, an
    `_apply` that moves its flat shard (cached per class, names and role)."""
    cls = getattr(type(module), "_fsdp_original_class", type(module))
    key = (cls, names, is_unit)
    if key not in _SWAPPED_CLASSES:
        members = {n: _make_property(n) for n in sorted(names)}
        members["_fsdp_original_class"] = cls
        if is_unit:
            members["_apply"] = _unit_apply
        _SWAPPED_CLASSES[key] = type(f"FSDP{cls.__name__}", (cls,), members)
    module.__class__ = _SWAPPED_CLASSES[key]


def _enter_forward(root: RootState):
    def pre_hook(module, args):
        if not torch.compiler.is_compiling():
            root.forward_depth += 1

    def post_hook(module, args, output):
        if not torch.compiler.is_compiling():
            root.forward_depth -= 1
            if root.forward_depth == 0:
                root.gathered.clear()

    return pre_hook, post_hook


def install_forward_hooks(module: nn.Module, root: RootState) -> None:
    """Marks eager forwards of `module` so property reads inside them gather (once per unit)."""
    pre_hook, post_hook = _enter_forward(root)
    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook, always_call=True)


def is_sharded(module: nn.Module) -> bool:
    return "_fsdp_views" in module.__dict__ or "_fsdp_state" in module.__dict__


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The unit modules of a sharded model, in creation order (root last)."""
    root = model.__dict__.get("_fsdp_root")
    return list(root.units) if root is not None else []
