"""Runtime state of sharded units and the class swap that exposes unsharded parameters in forward.

A unit module holds its flat shards in `_fsdp_flat_shards` (plain tensor attributes: graph inputs under Dynamo,
not in `parameters()`): one for its trainable parameters and, if it has any, one for its frozen ones, which
never get a gradient. `_fsdp_states[i]` describes `_fsdp_flat_shards[i]`. Every module owning a sharded parameter
gets a subclass whose property for that name returns the parameter read from `fsdp.unshard(flat_shard, ...)` inside
forward (its layout's `param_of`), and the sharded `nn.Parameter` view (what the optimizer holds: a 1-D slice with
the flat layout, the `Shard(0)` row block with the rows layout; in a model with tensor-parallel parameters, with
rows, a DTensor on the (dp, tp) mesh around that block: `dtensor_views`) outside forward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp_graph.ir.ops import UNSHARD_SIGNATURE, gather_pieces, piece_of, reuse_gathered
from fsdp_graph.runtime import eager_reshard, grad_presence, offload
from fsdp_graph.runtime.block_key import REGION_FLATS, region_param
from fsdp_graph.runtime.dtensor_views import hide_views, restore_views
from fsdp_graph.runtime.eager_prefetch import ForwardPrefetch
from fsdp_graph.runtime.exposed import UnshardedParams
from fsdp_graph.runtime.flat_param import Layout
from fsdp_graph.runtime.held import HeldGather, drop_held, hold, keeps, valid_held
from fsdp_graph.runtime.misuse import refuse_meta_parameters
from fsdp_graph.runtime.mp_cast import casting_forward
from fsdp_graph.runtime.owner_apply import owner_apply, unit_applying
from fsdp_graph.runtime.shard_binding import bind_flat_shard
from fsdp_graph.runtime.tensor_parallel import TPSpec


@dataclass(eq=False)
class RootState:
    """Shared by every unit of one `fully_shard` call: the eager path's per-forward gather cache."""

    forward_depth: int = 0
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)  # the running eager forward's gathers
    recompute: RecomputeGathers | None = None  # the gathers of the activation-checkpoint recompute running now
    flat_params: list[FlatParamState] = field(default_factory=list)
    mesh: object = None  # the DeviceMesh given to fully_shard (None: the world's); each flat parameter has its own
    world_meshes: dict = field(default_factory=dict)  # device type -> the world's DeviceMesh on it
    requires_gradient_sync: bool = True  # False inside `no_sync`: backwards accumulate unreduced gradients
    grad_fence: offload.GradFence = field(default_factory=offload.GradFence)  # CPU offload's end-of-backward wait
    session: eager_reshard.ForwardSession | None = None  # the eager forward running now (None: none, or compiled)
    saved_hooks: object = None  # that forward's saved_tensors_hooks, entered by the outermost pre-hook
    unsharded: dict[str, torch.Tensor] = field(default_factory=dict)  # FSDPModule.unshard's flats, outside forward
    held: dict[str, HeldGather] = field(default_factory=dict)  # set_reshard_after_backward(False)'s kept gathers
    prefetch: ForwardPrefetch = field(default_factory=ForwardPrefetch)  # the eager forward's gathers, one ahead
    exposure: UnshardedParams | None = None  # fsdp2: unsharded parameters registered after an eager forward


@dataclass(eq=False)
class RecomputeGathers:
    """The gathers an activation-checkpoint recompute made in backward, shared by its reads: valid only while the
    autograd node whose saved tensors it recomputes runs (in graph task `task`). The next recompute, the end of the
    backward and the next forward drop them, so no gather outlives its recompute into another step."""

    task: int
    node: object  # torch._C._current_autograd_node(): held, so its identity cannot be reused while this lives
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(eq=False)
class FlatParamState:
    """One flat parameter of a unit: the facts its `fsdp.unshard` call needs, plus its views."""

    module: nn.Module
    index: int
    name: str
    layout: Layout
    group_name: str
    world: int
    reshard_after_forward: bool
    root: RootState
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    replicate_group: str = ""
    replicate_world: int = 1
    views: list[nn.Parameter] = field(default_factory=list)  # one per layout slot
    owners: list[list[tuple[nn.Module, str]]] = field(default_factory=list)  # per slot: each (module, name) using it
    after_grad: list = field(default_factory=list)  # callbacks run after each backward hands out gradients
    grad_dtype: torch.dtype | None = None  # keep_low_precision_grads: the dtype `.grad` is stored in
    unsynced: torch.Tensor | None = None  # no_sync's full-size leaf; its `.grad` holds the unreduced gradient
    compute_device: torch.device | None = None  # CPUOffload: the shard lives on the CPU, gathers happen here
    reduce_group: str = ""  # the group gradients are reduced over, when not `group_name` (separate_reduce_group)
    divide_factor: float | None = None  # set_gradient_divide_factor (None: the data-parallel size, a mean)
    requires_all_reduce: bool = True  # set_requires_all_reduce(False): replicas' sums accumulate in `partial`
    partial: torch.Tensor | None = None  # shard-size leaf; its `.grad` is the partial sum not all-reduced yet
    reshard_after_backward: bool = True  # set_reshard_after_backward(False): the gather is kept (RootState.held)
    post_forward_world: int = 1  # reshard_after_forward=k: the forward keeps a 1/k piece (1: its shard, or all)
    post_forward_group: str = ""  # the k ranks (a node) the backward gathers the pieces over
    piece_group: str = ""  # the world / k ranks the forward gathers this rank's piece over
    tp: tuple[TPSpec | None, ...] = ()  # per slot: the tensor-parallel DTensor it was (its local piece is sharded)
    detached_slots: tuple[int, ...] = ()  # frozen views of a shard that requires grad: read detached in forward
    hooked: weakref.ref | None = None  # the flat shard the gradient hook is installed on
    staged: dict[int, torch.Tensor] = field(default_factory=dict)  # a meta shard's slots loaded so far (assign)
    mesh: object = None  # the DeviceMesh it is sharded over (None: the world's, see sharded.state_dict_mesh)
    placements: tuple = ()  # a Shard(0) parameter's DTensor placements on `mesh` (sharded.slot_placements: Shard(d))

    def __post_init__(self) -> None:
        self.__dict__["static_unshard_args"] = _static_unshard_args(self)
        self.__dict__["plain_gather"] = _plain_gather(self)

    def __setattr__(self, name: str, value) -> None:
        # `static_unshard_args` and `plain_gather` are kept current eagerly, never computed inside a trace: Dynamo
        # reads one value per parameter access instead of tracing a dozen attribute reads and a dict.
        super().__setattr__(name, value)
        if "plain_gather" not in self.__dict__:
            return
        if name in _STATIC_FIELDS.values():
            self.__dict__["static_unshard_args"] = _static_unshard_args(self)
        if name in _PLAIN_GATHER_FIELDS:
            self.__dict__["plain_gather"] = _plain_gather(self)

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
    checkpointing recomputing a forward outside any unit's forward) one gather per flat parameter per recompute
    (`_recompute_cache`).
    """
    state: FlatParamState = unit._fsdp_states[index]
    if torch.compiler.is_compiling():
        return _compiled_gather(unit._fsdp_flat_shards[index], state)
    root = state.root
    in_backward = root.forward_depth == 0
    if in_backward:
        cache = _recompute_cache(root)
        if cache is None:
            return root.unsharded.get(state.name)
    else:
        cache = root.gathered
    cached = cache.get(state.name)
    if cached is None:
        cached = cache[state.name] = _forward_gather(unit._fsdp_flat_shards[index], state, in_backward)
        if root.session is not None and resharded_in_eager(state):
            root.session.track(state, cached)
            if state.post_forward_world > 1:
                root.session.keep_piece(
                    state, piece_of(cached, state.post_forward_world, state.world, state.layout.rank)
                )
    return cached


def _recompute_cache(root: RootState) -> dict[str, torch.Tensor] | None:
    """The gather cache of the recompute running now (None: not in a backward, so nothing is recomputed).

    A recompute runs inside the autograd node that unpacks the recomputed tensors (non-reentrant checkpoints: the
    first node of the region to run in backward; reentrant ones: the region's CheckpointFunction node), whatever
    wraps the unit (`checkpoint_wrapper`, composable `checkpoint()`, `torch.utils.checkpoint` inside a forward):
    so a cache is keyed by the graph task and that node. A read from another node starts a new cache, and a
    callback at the end of the backward drops the last one: a gather never serves another recompute, and never
    the next step's forward (which would read pre-step weights)."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        return None
    node = torch._C._current_autograd_node()
    scope = root.recompute
    if scope is None or scope.task != task or scope.node is not node:
        scope = root.recompute = RecomputeGathers(task, node)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_recompute(root, scope))
    return scope.gathered


def _end_recompute(root: RootState, scope: RecomputeGathers) -> None:
    if root.recompute is scope:
        root.recompute = None


def _compiled_gather(shard: torch.Tensor, state: FlatParamState) -> torch.Tensor:
    """The op as a compiled forward traces it. Under `set_reshard_after_backward(False)` the step's gather is kept
    past the step (a Dynamo side effect: the graph outputs it) and the next step's graph takes it as its `gathered`
    input instead of gathering. Dynamo guards on whether a gather is kept and on the flag, so there are at most
    four graphs (first, middle and last microbatch, and none kept), each compiled once. The backward cannot hand
    out a gather of its own, so a compiled step keeps the forward's (resharding after forward or not)."""
    if state.detached_slots:
        # Read here, in the outer trace, so that Dynamo guards on every unit's frozen reads: a block-reuse body
        # traced for another unit bakes in that unit's, and its stamped-out calls install no guards of their own.
        pass
    held = state.root.held.get(state.name)
    if held is not None:  # kept by an earlier step, or by an earlier read in this one (the dedup pass folds those)
        return _call_unshard(shard, state, gathered=held.flat)
    flat = _call_unshard(shard, state)
    if keeps(state):
        state.root.held[state.name] = HeldGather(flat.detach())
    return flat


def _compiled_exit(root: RootState, own_states: list[FlatParamState]) -> None:
    """A unit's compiled forward ends: a unit no longer keeping its gathers frees the one it used (the last
    microbatch under the FSDP2 idiom `set_reshard_after_backward(is_last_microbatch)`)."""
    for state in own_states:
        if not keeps(state) and state.name in root.held:
            del root.held[state.name]


def _forward_gather(shard: torch.Tensor, state: FlatParamState, in_backward: bool) -> torch.Tensor:
    """The op's result for a forward (or, `in_backward`, an activation-checkpoint recompute), taken from the kept
    gather when there is a valid one. A forward that frees its gather afterwards (or whose unit no longer keeps
    one) consumes the kept one, as FSDP2's post-forward reshard does; otherwise it stays kept."""
    held = valid_held(state)
    if held is None:
        root = state.root  # a prefetched gather (no autograd) takes the op's backward as a kept one does
        early = None if in_backward else root.prefetch.gather(state, root.flat_params, root.gathered)
        args = () if early is None else UNSHARD_SIGNATURE.call_args(_unshard_values(shard, state))
        flat = _call_unshard(shard, state) if early is None else reuse_gathered(early, *args)
        if keeps(state) and (in_backward or not resharded_in_eager(state)):
            hold(state, flat)
        return flat
    if not in_backward and (resharded_in_eager(state) or state.reshard_after_backward):
        del state.root.held[state.name]
    return reuse_gathered(held.flat, *UNSHARD_SIGNATURE.call_args(_unshard_values(shard, state)))


def resharded_in_eager(state: FlatParamState) -> bool:
    """Whether an eager forward frees `state`'s gathered flat parameter after its unit's forward (the backward
    gathers it again). NO_SHARD (world 1) has nothing to gather: its "gather" is the shard itself or a cast."""
    return state.reshard_after_forward and state.world > 1


def _regather(state: FlatParamState, piece: torch.Tensor | None = None) -> torch.Tensor:
    """The backward's gather of a unit the forward resharded (no autograd): from the forward's 1/k `piece` over the
    node group (`reshard_after_forward=k`), else from the shard; kept afterwards when the unit does not reshard
    after backward."""
    held = valid_held(state)
    if held is not None:
        return held.flat
    if piece is not None:
        flat = gather_pieces(piece, state.post_forward_group, state.post_forward_world, state.world)
    else:
        flat = _call_unshard(state.flat_shard.detach(), state)
    if keeps(state):
        hold(state, flat)
    return flat


# `fsdp.unshard` arguments that are facts of the flat parameter (not tensors, not per-step switches): op argument
# name -> FlatParamState field.
_STATIC_FIELDS = {
    "unit": "name",
    "group": "group_name",
    "world": "world",
    "dtype": "param_dtype",
    "reduce_dtype": "reduce_dtype",
    "reshard_after_forward": "reshard_after_forward",
    "replicate_group": "replicate_group",
    "replicate_world": "replicate_world",
    "compute_device": "compute_device",
    "reduce_group": "reduce_group",
    "divide_factor": "divide_factor",
    "post_forward_world": "post_forward_world",
    "post_forward_group": "post_forward_group",
    "piece_group": "piece_group",
}


# The fields `_plain_gather` reads.
_PLAIN_GATHER_FIELDS = frozenset({"unsynced", "partial", "reshard_after_backward", "world"})


def _plain_gather(state: FlatParamState) -> bool:
    """Whether a compiled read of `state` is the op on its static arguments alone (`_call_unshard`'s first case)
    and keeps nothing (`_compiled_gather`), unless a gather is held: no accumulator leaf, no kept gather."""
    return state.unsynced is None and state.partial is None and not keeps(state)


def _static_unshard_args(state: FlatParamState) -> tuple:
    """The call's positional arguments after `shard` when every tensor argument is None (`call_args` drops trailing
    defaults, so the graph shows only the facts that matter; under `reshard_after_forward=k` the None tensor
    arguments before the post-forward fields are among them)."""
    values = {arg: getattr(state, field) for arg, field in _STATIC_FIELDS.items()}
    return UNSHARD_SIGNATURE.call_args({"shard": None, **values})[1:]


def _call_unshard(shard: torch.Tensor, state: FlatParamState, gathered: torch.Tensor | None = None) -> torch.Tensor:
    if gathered is None and state.unsynced is None and state.partial is None:
        return torch.ops.fsdp.unshard(shard, *state.static_unshard_args)
    values = _unshard_values(shard, state)
    if gathered is not None:
        values["gathered"] = gathered
    return torch.ops.fsdp.unshard(*UNSHARD_SIGNATURE.call_args(values))


def _unshard_values(shard: torch.Tensor, state: FlatParamState) -> dict:
    """The op's arguments for a call on `shard`. The accumulator leaves of no_sync and set_requires_all_reduce go
    in while accumulating (their `.grad` receives the gradient) and, once syncing again, while they hold a pending
    gradient: the backward then takes it (`ops.take_accumulated`), so the first reduction of the unit adds it, once,
    however many forwards gathered the unit before (a group `fully_shard([norm, head])` whose head then runs chunk
    by chunk)."""
    values = {"shard": shard, **{arg: getattr(state, field) for arg, field in _STATIC_FIELDS.items()}}
    if state.unsynced is not None and shard.requires_grad:
        if not state.root.requires_gradient_sync:
            values.update(sync=False, unsynced=state.unsynced)
        elif state.unsynced.grad is not None:
            values["unsynced"] = state.unsynced
    if state.partial is not None and shard.requires_grad:
        if not state.requires_all_reduce:
            values.update(all_reduce=False, partial=state.partial)
        elif state.partial.grad is not None:
            values["partial"] = state.partial
    return values


def _make_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        spec: ViewSpec = self._fsdp_views[name]
        state: FlatParamState = spec.unit._fsdp_states[spec.index]
        region_flats = spec.unit.__dict__.get(REGION_FLATS)  # read here, not by a helper: one frame less per read
        if region_flats is not None:  # inside a reused block's body (`reuse_blocks`): its gathered flat is an argument
            flat = region_flats[spec.index]
            if spec.slot in state.detached_slots:
                flat = flat.detach()
            return region_param(state.layout.param_of, flat, state.layout.slots[spec.slot])
        compiling = torch.compiler.is_compiling()
        if not compiling:
            flat = unsharded_flat(spec.unit, spec.index)
            if flat is None:
                return self._parameters[name]
        elif state.plain_gather and state.name not in state.root.held:
            # `_compiled_gather`'s common case written out: Dynamo inlines every helper frame once per read
            flat = torch.ops.fsdp.unshard(spec.unit._fsdp_flat_shards[spec.index], *state.static_unshard_args)
        else:
            flat = _compiled_gather(spec.unit._fsdp_flat_shards[spec.index], state)
        if spec.slot in state.detached_slots:  # frozen after fully_shard: no gradient, as an unsharded frozen one
            flat = flat.detach()
        tp = state.tp[spec.slot] if state.tp else None
        if compiling and state.root.session is None:  # `_tracked` would return it as is
            if tp is None:
                return state.layout.param_of(flat, state.layout.slots[spec.slot])
            return tp.wrap(state.layout.param_of(flat, state.layout.slots[spec.slot]))
        if tp is None:  # (no local name for the result: Dynamo would name the graph's node after it)
            return _tracked(state, spec.slot, flat, state.layout.param_of(flat, state.layout.slots[spec.slot]))
        return tp.wrap(_tracked(state, spec.slot, flat, state.layout.param_of(flat, state.layout.slots[spec.slot])))

    return property(get, doc=f"`{name}`: unsharded in forward, this rank's shard of it outside (fsdp_graph).")


def _tracked(state: FlatParamState, slot: int, flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`param`, read from `flat` in an eager forward; a copy of it (rows layout) is tracked like the gather itself:
    freed with it, made again in backward. Of a unit keeping its gather, remembered where `fsdp_graph.fsdp2`
    registers it after the forward (`exposed`)."""
    if not torch.compiler.is_compiling():
        grad_presence.track_read(state.flat_shard, state.layout.slots[slot].offset, param)
    session = state.root.session
    if session is not None:
        if not resharded_in_eager(state):
            if state.root.exposure is not None:
                state.root.exposure.record_read(state, slot, param)
        elif not _same_storage(param, flat):
            session.track(state, param, slot)
    return param


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _unit_apply(self: nn.Module, fn, recurse: bool = True):
    """`.to()`, `.double()`, `.cuda()`...: the views are converted one by one by nn.Module (which unlinks them
    from the flat shard); convert each flat shard once instead and re-point them."""
    if self._fsdp_states[0].root.exposure is not None:  # views in place first, as FSDP2 reshards before `.to()`
        self._fsdp_states[0].root.exposure.restore(self._fsdp_states)
    hidden = hide_views(self)
    try:
        with unit_applying():
            result = self._fsdp_original_class._apply(self, fn, recurse)
    finally:
        restore_views(hidden)
    for state in self._fsdp_states:
        drop_held(state)
        state.staged.clear()  # loaded into a meta shard that this conversion replaces (`to_empty()`)
        old = state.flat_shard
        new = fn(old.detach()).detach()
        if state.compute_device is not None:  # CPU offload: dtype conversions apply, moves do not
            if old.device.type == "meta":  # sharded on meta (`to_empty()`): allocated at its offload home
                new = offload.pinned(new.to("cpu"))
            else:
                new = offload.keep_pinned(old, new.to(old.device))
        bind_flat_shard(state, new.requires_grad_(old.requires_grad))
    return result


_SWAPPED_CLASSES: dict[tuple[type, frozenset[str], bool, torch.dtype | None, torch.dtype | None], type] = {}


def swap_class(
    module: nn.Module,
    names: frozenset[str],
    unit_base: type | None = None,
    cast_inputs_to: torch.dtype | None = None,
    cast_outputs_to: torch.dtype | None = None,
) -> None:
    """Give `module` a subclass with one property per sharded parameter name; for a unit module (`unit_base`: the
    API's mixin, `FSDPModule`, passed in by the API layer, which runtime code does not import), that mixin as a
    second base and an `_apply` that moves its flat shards; with `cast_inputs_to` / `cast_outputs_to`, a forward
    casting floating-point inputs / outputs to it (`mp_cast`) (cached per class, names, role and dtypes)."""
    cls = getattr(type(module), "_fsdp_original_class", type(module))
    key = (cls, names, unit_base, cast_inputs_to, cast_outputs_to)
    if key not in _SWAPPED_CLASSES:
        members = {n: _make_property(n) for n in sorted(names)}
        members["_fsdp_original_class"] = cls
        if unit_base is not None:
            members["_apply"] = _unit_apply
        elif names:
            members["_apply"] = owner_apply
        if cast_inputs_to is not None or cast_outputs_to is not None:
            members["forward"] = casting_forward(cast_inputs_to, cast_outputs_to)
        bases = (cls,) if unit_base is None else (cls, unit_base)  # the model's own methods win over the mixin's
        _SWAPPED_CLASSES[key] = type(f"FSDP{cls.__name__}", bases, members)
    module.__class__ = _SWAPPED_CLASSES[key]


def enter_forward(root: RootState, args: tuple = ()) -> None:
    """An eager forward of a unit (or an `register_fsdp_forward_method` method) starts: property reads gather. The
    outermost one outside backward opens an `eager_reshard` session (after refusing parameters left on meta)."""
    if torch.compiler.is_compiling():
        return
    if root.forward_depth == 0 and torch._C._current_graph_task_id() == -1:
        if root.exposure is not None:  # a unit no backward resharded (frozen, or a no_grad forward): views back first,
            root.exposure.restore_all()  # with any requires_grad_() applied to its registered parameters since
        refuse_meta_parameters(root.flat_params, args)
        root.recompute = None  # a backward that raised left its recompute's gathers: they are the last step's
        root.session, root.saved_hooks = eager_reshard.begin(_regather)
    root.forward_depth += 1


def exit_forward(root: RootState, own_states: list[FlatParamState]) -> None:
    """The forward `enter_forward` started ends: `own_states` that reshard after forward leave the gather cache
    (autograd holds handles, not the gathers); the outermost one clears it and closes the session."""
    if torch.compiler.is_compiling():
        _compiled_exit(root, own_states)
        return
    if root.forward_depth == 0:
        # Unmatched: a compiled forward that raised runs this always-call hook eagerly, its pre-hook having been traced.
        return
    root.forward_depth -= 1
    for state in own_states:
        if resharded_in_eager(state):
            if root.session is not None and not root.session.pending[state.name]:
                root.session.pieces.pop(state.name, None)  # nothing saved: the backward will not gather it
            flat = root.gathered.pop(state.name, None)
            if flat is not None and keeps(state) and root.session is not None and not root.session.pending[state.name]:
                # Autograd saved no view of it (e.g. the first unit: its input needs no gradient), so its backward
                # will not gather again; keep this forward's gather instead, for the next forward.
                hold(state, flat)
    if root.forward_depth == 0:
        if root.exposure is not None and root.session is not None:
            root.exposure.register(root.gathered, root.flat_params)
        root.gathered.clear()
        root.prefetch.end_forward()
        if root.saved_hooks is not None:
            eager_reshard.end(root.saved_hooks)
            root.session = root.saved_hooks = None


def install_forward_hooks(module: nn.Module, root: RootState) -> None:
    """`enter_forward`/`exit_forward` around eager forwards of `module`. The hooks touch no tensor, so under
    torch.compile they add no graph."""
    # A unit's states and root are read from the module, not closed over: Dynamo would reach each object through the
    # hook's closure and the module both, and guard that they are one object (aliasing guards per unit, every call).
    has_states = "_fsdp_states" in module.__dict__
    stateless_root = None if has_states else root

    # Compiled, the hooks test for it themselves: each call Dynamo inlines costs it a frame, per unit.
    def pre_forward(module: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():
            enter_forward(module._fsdp_states[0].root if has_states else stateless_root, args)

    def post_forward(module: nn.Module, args: tuple, output: object) -> None:
        own_states: list[FlatParamState] = module._fsdp_states if has_states else []
        unit_root = own_states[0].root if has_states else stateless_root
        if torch.compiler.is_compiling():
            _compiled_exit(unit_root, own_states)
        else:
            exit_forward(unit_root, own_states)

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward, always_call=True)


def is_sharded(module: nn.Module) -> bool:
    return any(key in module.__dict__ for key in ("_fsdp_views", "_fsdp_states", "_fsdp_root"))


def flat_params(model: nn.Module) -> list[FlatParamState]:
    """Every flat parameter of a sharded model, in creation order (the root's last)."""
    root = model.__dict__.get("_fsdp_root")
    return list(root.flat_params) if root is not None else []


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The unit modules of a sharded model, in creation order (root last)."""
    return list({id(s.module): s.module for s in flat_params(model)}.values())
