"""Runtime state of sharded units and the class swap that exposes unsharded parameters in forward.

A unit module holds its flat shards in `_fsdp_flat_shards` (plain tensor attributes: graph inputs under Dynamo,
not in `parameters()`): one for its trainable parameters and, if it has any, one for its frozen ones, which
never get a gradient. `_fsdp_states[i]` describes `_fsdp_flat_shards[i]`. Every module owning a sharded parameter
gets a subclass whose property for that name returns a view of `fsdp.unshard(flat_shard, ...)` inside forward,
and the 1-D sharded `nn.Parameter` view (what the optimizer holds) outside forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp_graph.api.controls import FSDPModule
from fsdp_graph.ir.ops import UNSHARD_SIGNATURE
from fsdp_graph.runtime import eager_reshard, offload
from fsdp_graph.runtime.flat_param import FlatParamLayout
from fsdp_graph.runtime.grads import install_grad_hook


@dataclass(eq=False)
class RootState:
    """Shared by every unit of one `fully_shard` call: the eager path's per-forward gather cache."""

    forward_depth: int = 0
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)
    recompute_task: int = -1  # the autograd graph task whose activation-checkpoint recompute `gathered` serves
    flat_params: list[FlatParamState] = field(default_factory=list)
    mesh: object = None  # the DeviceMesh given to fully_shard (None: the world's, see checkpoint.state_dict_mesh)
    world_meshes: dict = field(default_factory=dict)  # device type -> the world's DeviceMesh on it
    placements: tuple = ()  # DTensor placements of a parameter on `mesh` (Shard(0), with Replicate for replicas)
    # While set, model.state_dict() passes each full tensor through it instead of making a DTensor (None: drop it).
    full_state_dict: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    requires_gradient_sync: bool = True  # False inside `no_sync`: backwards accumulate unreduced gradients
    grad_fence: offload.GradFence = field(default_factory=offload.GradFence)  # CPU offload's end-of-backward wait
    session: eager_reshard.ForwardSession | None = None  # the eager forward running now (None: none, or compiled)
    saved_hooks: object = None  # that forward's saved_tensors_hooks, entered by the outermost pre-hook
    unsharded: dict[str, torch.Tensor] = field(default_factory=dict)  # FSDPModule.unshard's flats, outside forward


@dataclass(eq=False)
class FlatParamState:
    """One flat parameter of a unit: the facts its `fsdp.unshard` call needs, plus its views."""

    module: nn.Module
    index: int
    name: str
    layout: FlatParamLayout
    group_name: str
    world: int
    reshard_after_forward: bool
    root: RootState
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    replicate_group: str = ""
    replicate_world: int = 1
    views: list[nn.Parameter] = field(default_factory=list)  # one per layout slot
    after_grad: list = field(default_factory=list)  # callbacks run after each backward hands out gradients
    grad_dtype: torch.dtype | None = None  # keep_low_precision_grads: the dtype `.grad` is stored in
    unsynced: torch.Tensor | None = None  # no_sync's full-size leaf; its `.grad` holds the unreduced gradient
    compute_device: torch.device | None = None  # CPUOffload: the shard lives on the CPU, gathers happen here
    reduce_group: str = ""  # the group gradients are reduced over, when not `group_name` (separate_reduce_group)
    divide_factor: float | None = None  # set_gradient_divide_factor (None: the data-parallel size, a mean)
    requires_all_reduce: bool = True  # set_requires_all_reduce(False): replicas' sums accumulate in `partial`
    partial: torch.Tensor | None = None  # shard-size leaf; its `.grad` is the partial sum not all-reduced yet

    @property
    def flat_shard(self) -> torch.Tensor:
        return self.module._fsdp_flat_shards[self.index]


@dataclass(frozen=True)
class ViewSpec:
    """Where a module's parameter lives: unit module, which of its flat parameters, which slot."""

    unit: nn.Module
    index: int
    slot: int


def unsharded_flat(unit: nn.Module, index: int) -> torch.Tensor | None:
    """The full flat parameter, or outside forward in eager mode the one `FSDPModule.unshard` left (None without
    one: then callers expose shards).

    Compiled: always the op (the dedup pass keeps one per flat parameter and dtype). Eager: one gather per
    flat parameter per forward, cached until the outermost unit forward returns; inside a backward (activation
    checkpointing recomputing a forward) one gather per flat parameter per backward.
    """
    state: FlatParamState = unit._fsdp_states[index]
    if torch.compiler.is_compiling():
        return _call_unshard(unit._fsdp_flat_shards[index], state)
    root = state.root
    if root.forward_depth == 0:
        task = torch._C._current_graph_task_id()
        if task == -1:
            return root.unsharded.get(state.name)
        if root.recompute_task != task:
            root.gathered.clear()
            root.recompute_task = task
    cached = root.gathered.get(state.name)
    if cached is None:
        cached = root.gathered[state.name] = _call_unshard(unit._fsdp_flat_shards[index], state)
        if root.session is not None and resharded_in_eager(state):
            root.session.track(state, cached)
    return cached


def resharded_in_eager(state: FlatParamState) -> bool:
    """Whether an eager forward frees `state`'s gathered flat parameter after its unit's forward (the backward
    gathers it again). NO_SHARD (world 1) has nothing to gather: its "gather" is the shard itself or a cast."""
    return state.reshard_after_forward and state.world > 1


def _regather(state: FlatParamState) -> torch.Tensor:
    return _call_unshard(state.flat_shard.detach(), state)


def _call_unshard(shard: torch.Tensor, state: FlatParamState) -> torch.Tensor:
    values = {
        "shard": shard,
        "unit": state.name,
        "group": state.group_name,
        "world": state.world,
        "dtype": state.param_dtype,
        "reduce_dtype": state.reduce_dtype,
        "reshard_after_forward": state.reshard_after_forward,
        "replicate_group": state.replicate_group,
        "replicate_world": state.replicate_world,
        "compute_device": state.compute_device,
        "reduce_group": state.reduce_group,
        "divide_factor": state.divide_factor,
    }
    if state.unsynced is not None and shard.requires_grad:
        if not state.root.requires_gradient_sync:
            values.update(sync=False, unsynced=state.unsynced)
        elif state.unsynced.grad is not None:
            values["unsynced"] = state.unsynced.grad
    if state.partial is not None and shard.requires_grad:
        if not state.requires_all_reduce:
            values.update(all_reduce=False, partial=state.partial)
        elif state.partial.grad is not None:
            values["partial"] = state.partial.grad
    return torch.ops.fsdp.unshard(*UNSHARD_SIGNATURE.call_args(values))


def _make_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        spec: ViewSpec = self._fsdp_views[name]
        flat = unsharded_flat(spec.unit, spec.index)
        if flat is None:
            return self._parameters[name]
        slot = spec.unit._fsdp_states[spec.index].layout.slots[spec.slot]
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    return property(get, doc=f"`{name}`: unsharded in forward, this rank's 1-D shard outside it (fsdp_graph).")


def bind_flat_shard(state: FlatParamState, flat_shard: torch.Tensor) -> None:
    """Make `flat_shard` the storage of `state`: every original-parameter view is re-pointed at its range (the
    Parameter objects stay the same, so optimizers keep working) and the gradient hook moves with it."""
    layout = state.layout
    ranges = [layout.local_range(slot) for slot in layout.slots]
    base = flat_shard.detach()
    for view, (lo, hi) in zip(state.views, ranges):
        view.data = base[lo:hi]
    # A flat shard's size never changes. Without this, compiling a second model of the same class in one process
    # (other sizes) makes Dynamo's automatic-dynamic mark the shards dynamic: symbolic collective sizes, which the
    # passes then cannot bucket, convert or schedule by size.
    torch._dynamo.mark_static(flat_shard)
    shards = state.module.__dict__.setdefault("_fsdp_flat_shards", [])
    if state.index == len(shards):
        shards.append(flat_shard)
    else:
        shards[state.index] = flat_shard
    if flat_shard.requires_grad:
        # CPU offload from an accelerator: the gradient arrives by an asynchronous device-to-host copy.
        fence = None
        if offload.is_accelerator(state.compute_device) and flat_shard.device.type == "cpu":
            fence = (state.root.grad_fence, state.compute_device)
        install_grad_hook(flat_shard, state.views, ranges, state.after_grad, state.grad_dtype, fence)


def _unit_apply(self: nn.Module, fn, recurse: bool = True):
    """`.to()`, `.double()`, `.cuda()`...: the views are converted one by one by nn.Module (which unlinks them
    from the flat shard); convert each flat shard once instead and re-point them."""
    result = self._fsdp_original_class._apply(self, fn, recurse)
    for state in self._fsdp_states:
        old = state.flat_shard
        new = fn(old.detach()).detach()
        if state.compute_device is not None:  # CPU offload: dtype conversions apply, moves do not
            new = offload.keep_pinned(old, new.to(old.device))
        bind_flat_shard(state, new.requires_grad_(old.requires_grad))
    return result


def _casting_forward(dtype: torch.dtype):
    """Mixed precision's input cast, inside `forward` so that Dynamo traces it into the model's graph (module
    hooks of the compiled root run as frames of their own, which would make a second graph)."""

    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    def forward(self, *args, **kwargs):
        return self._fsdp_original_class.forward(self, *tree_map(cast, args), **tree_map(cast, kwargs))

    return forward


_SWAPPED_CLASSES: dict[tuple[type, frozenset[str], bool, torch.dtype | None], type] = {}


def swap_class(
    module: nn.Module, names: frozenset[str], is_unit: bool = False, cast_inputs_to: torch.dtype | None = None
) -> None:
    """Give `module` a subclass with one property per sharded parameter name; for a unit module, an `_apply`
    that moves its flat shards; with `cast_inputs_to`, a forward casting floating-point inputs to it
    (cached per class, names, role and dtype)."""
    cls = getattr(type(module), "_fsdp_original_class", type(module))
    key = (cls, names, is_unit, cast_inputs_to)
    if key not in _SWAPPED_CLASSES:
        members = {n: _make_property(n) for n in sorted(names)}
        members["_fsdp_original_class"] = cls
        if is_unit:
            members["_apply"] = _unit_apply
        if cast_inputs_to is not None:
            members["forward"] = _casting_forward(cast_inputs_to)
        bases = (cls, FSDPModule) if is_unit else (cls,)  # the model's own methods win over FSDPModule's
        _SWAPPED_CLASSES[key] = type(f"FSDP{cls.__name__}", bases, members)
    module.__class__ = _SWAPPED_CLASSES[key]


def enter_forward(root: RootState) -> None:
    """An eager forward of a unit (or an `register_fsdp_forward_method` method) starts: property reads gather. The
    outermost one outside backward opens an `eager_reshard` session."""
    if torch.compiler.is_compiling():
        return
    if root.forward_depth == 0 and torch._C._current_graph_task_id() == -1:
        root.session, root.saved_hooks = eager_reshard.begin(_regather)
    root.forward_depth += 1


def exit_forward(root: RootState, own_states: list[FlatParamState]) -> None:
    """The forward `enter_forward` started ends: `own_states` that reshard after forward leave the gather cache
    (autograd holds handles, not the gathers); the outermost one clears it and closes the session."""
    if torch.compiler.is_compiling():
        return
    root.forward_depth -= 1
    for state in own_states:
        if resharded_in_eager(state):
            root.gathered.pop(state.name, None)
    if root.forward_depth == 0:
        root.gathered.clear()
        root.recompute_task = -1
        if root.saved_hooks is not None:
            eager_reshard.end(root.saved_hooks)
            root.session = root.saved_hooks = None


def install_forward_hooks(module: nn.Module, root: RootState) -> None:
    """`enter_forward`/`exit_forward` around eager forwards of `module`. The hooks touch no tensor, so under
    torch.compile they add no graph."""
    own_states: list[FlatParamState] = module.__dict__.get("_fsdp_states", [])
    module.register_forward_pre_hook(lambda module, args: enter_forward(root))
    module.register_forward_hook(lambda module, args, output: exit_forward(root, own_states), always_call=True)


def is_sharded(module: nn.Module) -> bool:
    return any(key in module.__dict__ for key in ("_fsdp_views", "_fsdp_states", "_fsdp_root"))


def flat_params(model: nn.Module) -> list[FlatParamState]:
    """Every flat parameter of a sharded model, in creation order (the root's last)."""
    root = model.__dict__.get("_fsdp_root")
    return list(root.flat_params) if root is not None else []


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The unit modules of a sharded model, in creation order (root last)."""
    return list({id(s.module): s.module for s in flat_params(model)}.values())
