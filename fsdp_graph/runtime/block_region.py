"""Compile once per block (issue 15; the default where eligible since issue 25): `fully_shard(..., reuse_blocks=...)`.

A unit's compiled forward gathers its flat parameters first, outside any region, then calls `_block_body`, a
`torch.compiler.nested_compile_region`, with the gathered flats as explicit arguments. Inside, the unit's
properties read their parameters from those arguments (`REGION_FLATS`), so the body holds no gather and no
unit-specific constant, and Dynamo traces it once and stamps the same `subgraph_0` out for every block with the
same `block_key`; AOT autograd and Inductor then compile its forward and backward once. The gathers and the
gradient reductions stay in the outer graph, where the dedup, reshard, lowering and schedule passes see them as
before (a block's gather can still be issued before the previous block's region runs).

The body stores the flats on the unit while the original forward runs, a side effect, which makes Dynamo's own
guard-based reuse refuse the region; the reuse is therefore keyed by `reuse_hash_fn` (`_reuse_key`): the unit's
structure, computed here when it is made reusable, its training flag and the call's pattern (grad mode, argument
kinds, dtypes, static sizes, constants; requires_grad where the body's outputs follow it). Dynamo installs no guards
for the stamped-out copies, so changing a reused unit's plain attributes after compiling does not recompile it.

Inside the body, each parameter read is annotated `fsdp_graph.ir.REGION_PARAM_ANNOTATION`; `passes.tag_reshard`
tags those views of the body's inputs `MUST_RECOMPUTE`, so the body's partition saves the gathered flat (an input)
rather than copies of the parameters, and the outer graph's reshard tags decide as before whether the backward
re-gathers (docs/design-notes.md, "Compile once per block").

What torch refuses to reuse a body for never reaches it (docs/design-notes.md, "Block reuse on the models people
bring" and "Block reuse with writes, KV caches and Python side effects"): a transformers KV cache empty for the
layer becomes a fresh empty cache inside the body, its updates replayed outside (`block_cache`); a call with any
other argument but tensors, numbers, strings, None and modules (a cache holding keys already: decoding) runs the
unit's own forward, with one warning; an output's non-tensors, returned arguments (T5's blocks) and structure
(dicts, dataclasses, `ModelOutput`s) are taken out of the body and put back by the caller from a template recorded
at trace time (`block_output`); an output that cannot be rebuilt so, or a forward writing a Python attribute it
does not put back (`python_writes`), runs the unit's own forward, with one warning. In-place writes of buffers and
inputs stay in the body until the backend moves them out (`passes.lift_region_mutations`). With `reuse_blocks=True`
each of those fallbacks raises `ReuseBlocksError` instead.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch._dynamo.comptime import comptime

from fsdp_graph import compat
from fsdp_graph.runtime import block_arguments, block_cache, python_writes
from fsdp_graph.runtime.block_key import BLOCK_KEY, CACHE_LAYER, REGION_FLATS, STRICT, block_key
from fsdp_graph.runtime.block_output import rebuild_output, refusal, split_output
from fsdp_graph.runtime.unit import unsharded_flat

_REUSING_CLASSES: dict[type, type] = {}
_SIDE_EFFECTS_BEFORE: list = [None]  # the tracer's record of a side effect before `_set_region_flats`' write


def reuse_refusals(unit_fqns: list[str], assignment: dict[int, str], uses: dict, tp: dict) -> dict[str, str]:
    """Before `fully_shard` changes anything: for each unit other than the root ("") that cannot share a body, by
    FQN, why: its subtree holds another unit, it reads a parameter another unit owns (shared weights: the body would
    gather it inside) or it owns a tensor-parallel parameter. `assignment` maps parameter ids to their unit's FQN,
    `uses` to the (module FQN, module, name) reading them, `tp` holds the tensor-parallel ones."""
    refusals = {unit: _refusal(unit, unit_fqns, assignment, uses, tp) for unit in unit_fqns if unit}
    return {unit: why for unit, why in refusals.items() if why is not None}


def reuse_lost(
    refused: dict[str, str], units: list[nn.Module], unit_fqns: list[str], group_members: dict
) -> dict[str, str]:
    """Of the `refused` units (FQN -> why; `units` in model order, the root last; `group_members`: the other modules
    of each unit of several), those that would have shared a body: another unit (not the root) has the same module
    classes. A unit of a structure of its own (an output head with its final norm as one unit of several modules)
    is traced once either way, so its refusal costs nothing and is not worth a warning."""

    def structure(unit: nn.Module) -> tuple[type, ...]:
        return tuple(type(m) for m in (*group_members.get(unit, ()), unit))

    counts: dict[tuple[type, ...], int] = {}
    for unit in units[:-1]:
        counts[structure(unit)] = counts.get(structure(unit), 0) + 1
    by_fqn = dict(zip(unit_fqns, units))
    return {fqn: why for fqn, why in refused.items() if counts[structure(by_fqn[fqn])] > 1}


def buffer_refusals(units: dict[str, nn.Module]) -> dict[str, str]:
    """Under a torch without `nested_compile_region(reuse_hash_fn=)` (2.11): for each unit (FQN -> module) holding a
    buffer, why it cannot share a body. torch 2.11's invoke_subgraph fails the backward of a shared body that writes
    a buffer ("Trying to backward through the graph a second time"; measured: running statistics, counters, a cache
    written through a view), and whether a forward writes its buffers is known only once it is traced; a unit
    without buffers (a transformer block whose rotary table is the model's) shares its body as on torch 2.13."""
    if compat.has_reuse_hash_fn():
        return {}
    refusals = {}
    for fqn, unit in units.items():
        name = next((name for name, _ in unit.named_buffers()), None)
        if name is not None:
            refusals[fqn] = (
                f"unit {fqn!r} holds a buffer ({name!r}), and torch {torch.__version__}'s invoke_subgraph cannot train "
                "a shared body that writes one (torch 2.13 can)"
            )
    return refusals


def _complex_tensor(unit: nn.Module) -> tuple[str, torch.dtype] | None:
    return next(
        ((name, t.dtype) for name, t in [*unit.named_buffers(), *unit.named_parameters()] if t.is_complex()), None
    )


def complex_refusals(units: dict[str, nn.Module]) -> dict[str, str]:
    """For each unit (FQN -> module) holding a complex tensor (torchtitan's complex RoPE cache is a buffer of every
    layer), why it cannot share a body, on a torch where that is not known to be right: none on torch 2.13, where
    `keep_complex_bodies_exact` and `passes.materialize_conjugates` make it right (measured, design-notes "No complex
    tensor in the body"); on a torch without `reuse_hash_fn` or Dynamo's switch for inlining single-use bodies
    (2.11), every such unit (not measured there; their buffers keep them out on 2.11 anyway, `buffer_refusals`)."""
    if compat.has_reuse_hash_fn() and compat.has_single_use_region_inlining():
        return {}
    refusals = {}
    for fqn, unit in units.items():
        found = _complex_tensor(unit)
        if found is not None:
            refusals[fqn] = (
                f"unit {fqn!r} holds a complex tensor ({found[0]!r}, {found[1]}), and torch {torch.__version__}'s "
                "invoke_subgraph is not known to train a shared body with complex arithmetic right (torch 2.13 is)"
            )
    return refusals


def keep_complex_bodies_exact(units: list[nn.Module]) -> None:
    """Where a reusable unit holds a complex tensor, turn off Dynamo's inlining of compile regions called once
    (`torch._dynamo.config.inline_single_use_invoke_subgraph`, process-wide, read when a graph is traced): under
    Inductor, a model whose single-use body was inlined beside a shared complex body gets wrong gradients for the
    inlined call (torch 2.13; measured: `benchmarks/complex_region_probe.py` 9.6e-2, torchtitan's DeepSeek-V3 7.1e-4),
    and right ones with that body kept as a region. Nothing else changes: the body used once is compiled as a region,
    as the shared one is."""
    if any(_complex_tensor(unit) is not None for unit in units):
        compat.keep_single_use_regions()


def _refusal(unit: str, unit_fqns: list[str], assignment: dict[int, str], uses: dict, tp: dict) -> str | None:
    def inside(fqn: str, unit: str) -> bool:
        return fqn == unit or fqn.startswith(unit + ".")

    nested = [other for other in unit_fqns if other and other != unit and inside(other, unit)]
    if nested:
        return f"unit {unit!r} contains another unit ({nested[0]!r})"
    for pid, owner in assignment.items():
        readers = [fqn for fqn, _, _ in uses[pid] if inside(fqn, unit)]
        if readers and owner != unit:
            return f"{readers[0]!r} in unit {unit!r} reads a parameter of unit {owner!r} (shared weights): its body would gather it"
        if owner == unit and pid in tp:
            return f"unit {unit!r} holds tensor-parallel parameters, not supported"
    return None


def make_reusable(unit: nn.Module, strict: bool = False) -> None:
    """Give `unit` (a unit with flat parameters, its class already swapped, no `reuse_refusals` entry) a forward that
    gathers outside a compile region shared by every unit of the same structure. `strict` (reuse_blocks=True): a
    call that cannot run the shared body raises at trace time instead of falling back with a warning."""
    unit.__dict__[BLOCK_KEY] = block_key(unit)
    unit.__dict__[CACHE_LAYER] = block_cache.layer_index(unit)
    unit.__dict__[STRICT] = strict
    cls = type(unit)
    if cls not in _REUSING_CLASSES:
        members = {"forward": _gathering_forward, "_fsdp_block_forward": cls.forward}
        _REUSING_CLASSES[cls] = type(f"Reused{cls.__name__}", (cls,), members)
    unit.__class__ = _REUSING_CLASSES[cls]


def _reuse_key(self: nn.Module, count: int, *flats_and_args, **kwargs) -> int:
    # With a `reuse_hash_fn` this key is all torch checks before stamping a traced body out for a call, so it holds
    # what the body's trace depends on besides the unit's structure: each argument's kind, a tensor's dtype and
    # static sizes, constants' values (a cache marker among them), the grad mode and the training flag; and, for a
    # body whose outputs' differentiability follows its arguments' (`_note_grad_dependence`), which need a gradient.
    # `_gathering_forward`, the body's only caller, noted it for this call just before calling it (`_note_call`).
    return _noted_call()[1]


_NOTED_CALL: list = [(0, 0, None)]


def _note_call(ctx) -> None:
    """At trace time (`comptime`), once per call of a reused unit, in `_gathering_forward` (whose locals it reads):
    the call's key (the unit's structure `block`, the grad mode `grad`, the `training` flag, all three read by the
    traced code so that Dynamo guards on them, and the arguments' pattern, `_pattern` of their example values), the
    key torch looks its body up by, which adds the arguments' requires_grad for a body whose outputs'
    differentiability follows them, and the Python write recorded for the call key. Computed here in one step, not
    traced: traced, they cost Dynamo a tenth of what it traces per block of a 70B Llama, and a tensor's size read by
    the traced code would be specialized (every new sequence length a recompile under dynamic shapes)."""
    block, grad, training = _constants(ctx, "block", "grad", "training")
    arguments = [ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker() for name in _CALL_LOCALS]
    call_key = hash((block, grad, training, tuple(_traced_pattern(variable) for variable in arguments)))
    key = call_key
    if call_key in _GRAD_DEPENDENT:
        key = hash((call_key, tuple(_traced_grads(variable) for variable in arguments)))
    _NOTED_CALL[0] = (call_key, key, _PYTHON_WRITES.get(call_key))


_CALL_LOCALS = ("flats", "call_args", "call_kwargs")  # `_gathering_forward`'s locals: the body's arguments


@torch._dynamo.assume_constant_result
def _noted_call() -> tuple[int, int, str | None]:
    """What `_note_call` noted for the call being traced: (call key, reuse key, Python write or None)."""
    return _NOTED_CALL[0]


def _traced_pattern(variable) -> object:
    """`_pattern` of a traced value: a tensor's example (fake) value, containers item by item (a namedtuple by its
    own name), constants as themselves, anything else (a module, a symbolic number) by its type's name."""
    from torch._dynamo.variables import ConstDictVariable, TensorVariable
    from torch._dynamo.variables.lists import BaseListVariable

    if isinstance(variable, TensorVariable):
        return _pattern(variable.as_proxy().node.meta.get("example_value"))
    if isinstance(variable, BaseListVariable):
        return (variable.python_type().__name__, tuple(_traced_pattern(item) for item in variable.items))
    if isinstance(variable, ConstDictVariable):
        items = variable.items.items()
        return ("dict", tuple((getattr(k, "vt", k).as_python_constant(), _traced_pattern(v)) for k, v in items))
    if variable.is_python_constant():
        return _pattern(variable.as_python_constant())
    return variable.python_type().__name__


def _pattern(value: object) -> object:
    """What a traced body depends on in an argument (see `_reuse_key`) but its requires_grad, as constants: a tensor's
    dtype and static sizes (a symbolic size as None)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(size if isinstance(size, int) else None for size in value.shape))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_pattern(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((name, _pattern(item)) for name, item in value.items()))
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return type(value).__name__  # a module, a symbolic number


def _traced_grads(variable) -> object:
    """Which tensors of a traced value need a gradient, at trace time: containers item by item, else None."""
    from torch._dynamo.variables import ConstDictVariable, TensorVariable
    from torch._dynamo.variables.lists import BaseListVariable

    if isinstance(variable, TensorVariable):
        return variable.requires_grad
    if isinstance(variable, BaseListVariable):
        return tuple(_traced_grads(item) for item in variable.items)
    if isinstance(variable, ConstDictVariable):
        return tuple(_traced_grads(value) for value in variable.items.values())
    return None


def _body(self: nn.Module, count: int, *flats_and_args, **kwargs):
    flats, args = flats_and_args[:count], flats_and_args[count:]
    call_key, key, _ = _noted_call()  # noqa: F841 (comptime reads them by name)
    comptime(lambda ctx: _note_versions(ctx.get_local("flats_and_args")))
    args, kwargs, caches = block_cache.stand_ins(args, kwargs)  # a marker becomes a fresh empty transformers cache
    comptime(_note_python_writes)
    _set_region_flats(self, flats)
    out = type(self)._fsdp_block_forward(self, *args, **kwargs)
    _set_region_flats(self, None)
    comptime(lambda ctx: _refuse_python_writes(ctx, *_constants(ctx, "call_key")))
    # torch reuses a body only if it returns tensors, none of them an input: return those, and record the rest of
    # the output (T5's None and the position bias a block passes on, a dict, a dataclass) for the caller to rebuild;
    # then the keys and values the layer gave its cache, for the caller to replay on the real one.
    replay, cache_tensors = block_cache.recorded_updates(caches, self.__dict__.get(CACHE_LAYER))
    template, tensors = split_output(out, args, kwargs, explicit=bool(caches))
    record = (template, replay)  # noqa: F841 (comptime reads it by name)
    # recorded for every body traced, None too: a key's output may take another shape in a later compile
    comptime(lambda ctx: _RECORDS.__setitem__(*_constants(ctx, "key", "record")))
    comptime(
        lambda ctx: _note_grad_dependence(
            *_constants(ctx, "call_key"), ctx.get_local("flats_and_args"), ctx.get_local("tensors")
        )
    )
    if refusal(template) is not None or block_cache.refusal(replay) is not None:
        return ()
    return out if template is None else tensors + cache_tensors


def _set_region_flats(unit: nn.Module, flats: tuple | None) -> None:
    """Inside a body: the unit's `REGION_FLATS`, written without counting as the body's side effect. Dynamo (2.13)
    makes a body with any Python side effect return every intermediate tensor it traced as well (44 extra outputs
    on a Llama block), each a fake tensor, a graph node and a variable at every stamped-out call: on the 70B shapes
    an added layer took 183-218 ms with them, 101-147 ms without (docs/measured.md). This write is set and undone
    within the body, for the body's own parameter reads, so the tracer's record of side effects is put back as it
    was; a write of the block's own forward still counts (and `_refuse_python_writes` refuses a sourced one)."""
    comptime(_note_side_effects)
    setattr(unit, REGION_FLATS, flats)
    comptime(_forget_own_side_effect)


def _note_side_effects(ctx) -> None:
    _SIDE_EFFECTS_BEFORE[:] = [compat.side_effect_record(_tracer(ctx))]


def _forget_own_side_effect(ctx) -> None:
    if _SIDE_EFFECTS_BEFORE[0] is None:
        compat.clear_side_effect_record(_tracer(ctx))
    _SIDE_EFFECTS_BEFORE[:] = [None]  # nothing of the trace outlives it


def _tracer(ctx):
    return ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.current_tracer


def _note_python_writes(ctx) -> None:
    """At trace time, before the block's forward: what the trace has written so far."""
    _WRITTEN_BEFORE[:] = [
        python_writes.note(ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.side_effects)
    ]


def _refuse_python_writes(ctx, call_key: int) -> None:
    """At trace time, after the block's forward: if it wrote a Python attribute, list or dict it did not create and
    did not put back (a counter `self.calls += 1`), the caller must run it on its own: Dynamo applies a body's
    Python side effects once, for the block it traced, and stamps the body out for the others without them.
    Recorded for `call_key`, and the trace restarts (`RestartAnalysis`), so that this body's side effects are not
    applied on top of the fallback's. A constant attribute the forward puts back is no such write
    (`python_writes`)."""
    written = python_writes.lasting_writes(_WRITTEN_BEFORE[0], REGION_FLATS)
    # The record holds the trace's side effects, and through them the model: kept, it would outlive the compile.
    _WRITTEN_BEFORE.clear()
    if written:
        _PYTHON_WRITES[call_key] = sorted(_described(source) for source in written)[0]
        # the restarted trace takes another path at this call (Dynamo would report a diverged speculation log)
        ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().speculation_log.clear()
        raise torch._dynamo.exc.RestartAnalysis(restart_reason=f"reuse_blocks: {_PYTHON_WRITES[call_key]} written")


def _described(source) -> str:
    if isinstance(getattr(source, "member", None), str):
        return f"the Python attribute {source.member!r}"
    name = source.name if isinstance(source.name, str) else source.name()  # a method before torch 2.13
    return f"a Python object it did not create ({name})"


def _note_versions(arguments) -> None:
    """At trace time, before the block's forward: its tensor arguments' version counters."""
    _VERSIONS[:] = [None if t is None else t._version for t in _fakes(arguments)]


def _note_grad_dependence(call_key: int, arguments, outputs) -> None:
    """At trace time, after the block's forward: whether the body's outputs' differentiability may follow its
    arguments' requires_grad, so that a body traced for one call must not be stamped out for a call whose arguments
    differ in it. torch marks a body output that needed no gradient in the traced call non-differentiable for
    every call of the body (the backward then fails: "outs_to_grad length ... != tangents length"). Such outputs
    are: an argument the forward writes in place (`passes.lift_region_mutations` returns its new value) and an
    output needing no gradient while some argument needs one."""
    fakes = _fakes(arguments)
    written = any(t is not None and t._version != v for t, v in zip(fakes, _VERSIONS))
    needs = any(t is not None and t.requires_grad for t in fakes)
    plain = torch.is_grad_enabled() and needs and any(t is not None and not t.requires_grad for t in _fakes(outputs))
    if written or plain:
        _GRAD_DEPENDENT.add(call_key)


def _fakes(variable) -> list:
    """The example values (fake tensors, else None) of a traced tuple's items, at trace time (`comptime`)."""
    from torch._dynamo.variables import TensorVariable

    tracker = variable._i_will_not_complain_if_bc_breaks_VariableTracker()
    items = getattr(tracker, "items", [tracker])
    return [
        item.as_proxy().node.meta.get("example_value") if isinstance(item, TensorVariable) else None for item in items
    ]


# torch keeps at most `max_reuse_entries` keys per body function (8 by default, then an error): one key per block
# structure and call pattern in a graph, so a model with nine kinds of blocks would fail to compile.
_block_body = compat.nested_compile_region(_body, reuse_hash_fn=_reuse_key, max_reuse_entries=1 << 16)
_RECORDS: dict[int, tuple] = {}  # reuse key -> (`split_output`'s template, `recorded_updates`' replay)
_GRAD_DEPENDENT: set[int] = set()  # `_call_key`s whose bodies are keyed by their arguments' requires_grad too
_VERSIONS: list = []  # `_note_versions`, read by `_note_grad_dependence` in the same body's trace
_WRITTEN_BEFORE: list = []  # `_note_python_writes`, read by `_refuse_python_writes` in the same body's trace
_PYTHON_WRITES: dict[int, str] = {}  # `_call_key` -> a Python object its block's forward writes
_WARNED: set[tuple[str, str]] = set()


def _gathering_forward(self: nn.Module, *args, **kwargs):
    """Eager: the unit's own forward. Compiled: its gathers, then the shared body, its output rebuilt from the body's
    tensors and the layer's cache updates replayed; or, for a call or an output torch could not reuse a body for,
    the unit's own forward (its parameters gathered as without `reuse_blocks`), with one warning (an error with
    `reuse_blocks=True`)."""
    if not torch.compiler.is_compiling():
        return type(self)._fsdp_block_forward(self, *args, **kwargs)
    layer = self.__dict__.get(CACHE_LAYER)
    # Arguments that are all tensors, scalars, strings, None and modules (inside tuples, lists and dicts), as in most
    # models' blocks, are told apart at trace time, in one step: traced, the checks below cost Dynamo about 500
    # instructions a block (a third of what it traces per block of a 70B Llama).
    comptime(lambda ctx: block_arguments.note_plain_arguments(ctx.get_local("args"), ctx.get_local("kwargs")))
    if block_arguments.noted_plain_arguments():
        call_args, call_kwargs = args, kwargs
    else:
        call_args, call_kwargs, why = block_arguments.with_markers(args, kwargs, layer)
        refused = block_arguments.refused_argument(call_args, call_kwargs) if why is None else None
        if why is not None or refused is not None:
            return _fall_back(self, block_arguments.argument_reason(why, refused), args, kwargs)
    flats: tuple = ()
    for index in range(len(self._fsdp_states)):  # as `unsharded_flat` reads it: one Dynamo source, no alias guard
        flats += (unsharded_flat(self, index),)
    grad, training, block = torch.is_grad_enabled(), self.training, self.__dict__[BLOCK_KEY]  # noqa: F841 (see below)
    comptime(_note_call)
    _, key, written = _noted_call()  # `key`: torch's key for the body, taken before the call changes it
    if written is not None:
        reason = f"its forward writes {written}, which a shared body would write for the first block only"
        return _fall_back(self, reason, args, kwargs)
    # The flats unpacked, not one tuple argument: with only tensors, ints and modules as arguments Dynamo
    # fingerprints a call without pytree-flattening it (`build_fingerprint_fast`), about 0.07 s a call.
    out = _block_body(self, len(flats), *flats, *call_args, **call_kwargs)
    comptime(lambda ctx: _give_history(ctx.get_local("out")))
    template, replay, output_refused, cache_refused = _record(key)
    if output_refused is not None:
        return _fall_back(self, _output_reason(output_refused), args, kwargs)
    if cache_refused is not None:
        return _fall_back(
            self, block_arguments.argument_reason(f"a cache its layer uses so: {cache_refused}", None), args, kwargs
        )
    if replay:
        count = len(out) - 2 * sum(1 for entry in replay if entry[0] == "update")
        block_cache.apply_updates(replay, out[count:], args, kwargs, layer)
        out = out[:count]
    return out if template is None else rebuild_output(template, out, args, kwargs)


def _block_name(unit: nn.Module) -> str:
    return getattr(type(unit), "_fsdp_original_class", type(unit)).__qualname__


def _fall_back(self: nn.Module, reason: str, args: tuple, kwargs: dict):
    """The unit's own forward, its parameters gathered as without reuse, with one warning giving `reason`; under
    `reuse_blocks=True` a `ReuseBlocksError` (a ValueError) at trace time instead."""
    block = _block_name(self)
    if self.__dict__.get(STRICT):
        message = (  # noqa: F841 (comptime reads it by name)
            f"reuse_blocks=True: {block} cannot share a body: {reason} (reuse_blocks=None traces such a call "
            "layer by layer, with a warning)"
        )
        comptime(lambda ctx: _raise(*_constants(ctx, "message")))
    message = f"reuse_blocks: {block} is traced layer by layer, not as one shared body: {reason}"  # noqa: F841
    comptime(lambda ctx: _warn_once(*_constants(ctx, "block", "message")))
    return type(self)._fsdp_block_forward(self, *args, **kwargs)


class ReuseBlocksError(torch._dynamo.exc.UserError, ValueError):
    """`reuse_blocks=True` and a call that cannot run the shared body. A Dynamo user error, so torch.compile
    raises it as it is (other exceptions raised while tracing reach the caller as `InternalTorchDynamoError`)."""

    def __init__(self, message: str):
        super().__init__(torch._dynamo.exc.UserErrorType.INVALID_INPUT, message)


def _give_history(out) -> None:
    """At trace time: a reused body's outputs, as Dynamo stamps them out for a call after the first, are fake
    tensors without autograd history (`torch.empty_strided(..., requires_grad=...)` in torch 2.13's
    `stamp_out_subgraph`), so an in-place write to one (the next block writing its input) fails Dynamo's fake run
    with "a leaf Variable that requires grad is being used in an in-place operation". Each such output gets an
    example value with history instead (a fake clone: same metadata), as the first call's outputs have."""
    from torch._dynamo.variables import TensorVariable

    variable = out._i_will_not_complain_if_bc_breaks_VariableTracker()
    for item in getattr(variable, "items", [variable]):
        if not isinstance(item, TensorVariable):
            continue
        node = item.as_proxy().node
        example = node.meta.get("example_value")
        if not (isinstance(example, torch.Tensor) and example.requires_grad and example.grad_fn is None):
            continue
        with example.fake_mode, torch.enable_grad():
            with_history = example.clone()
        if with_history.stride() == example.stride():
            node.meta["example_value"] = with_history
            item.has_grad_fn = True


def _raise(message: str) -> None:
    raise ReuseBlocksError(message)


@torch._dynamo.assume_constant_result
def _record(key: int) -> tuple:
    """What `_body` recorded for `key` while tracing it (its output template, its cache calls to replay), and why
    each cannot be rebuilt or replayed (None where it can), read at trace time (Dynamo keeps no guard on it: a new
    trace records it again, for its first body of that key)."""
    template, replay = _RECORDS.get(key, (None, ()))
    return template, replay, refusal(template), block_cache.refusal(replay)


def _output_reason(why: str) -> str:
    return (
        f"its forward returns {why}, and torch's nested_compile_region reuses a body only if it returns tensors "
        "(invoke_subgraph's is_reuse_eligible); return tensors, tuples, lists, dicts or dataclasses of them, or pass "
        "reuse_blocks=False"
    )


def _constants(ctx, *names: str) -> list:
    """The values of the traced frame's locals `names`, which are Python constants, at trace time (`comptime`)."""
    return [ctx.get_local(name).as_python_constant() for name in names]


def _warn_once(block: str, message: str) -> None:
    if (block, message) not in _WARNED:
        _WARNED.add((block, message))
        warnings.warn(message, stacklevel=1)
