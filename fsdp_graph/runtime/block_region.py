"""Compile once per block (issue 15; the default where eligible since issue 25): `fully_shard(..., reuse_blocks=...)`.

A unit's compiled forward gathers its flat parameters first, outside any region, then calls `_block_body`, a
`torch.compiler.nested_compile_region`, with the gathered flats as explicit arguments. Inside, the unit's
properties read their parameters from those arguments (`region_flat`), so the body holds no gather and no
unit-specific constant, and Dynamo traces it once and stamps the same `subgraph_0` out for every block with the
same `block_key`; AOT autograd and Inductor then compile its forward and backward once. The gathers and the
gradient reductions stay in the outer graph, where the dedup, reshard, lowering and schedule passes see them as
before (a block's gather can still be issued before the previous block's region runs).

The body stores the flats on the unit while the original forward runs, a side effect, which makes Dynamo's own
guard-based reuse refuse the region; the reuse is therefore keyed by `reuse_hash_fn` (`_reuse_key`): the unit's
structure, computed here when it is made reusable, and its training flag. Dynamo installs no guards for the
stamped-out copies, so changing a reused unit's plain attributes after compiling does not recompile it.

Inside the body, each parameter read is annotated `fsdp_graph.ir.REGION_PARAM_ANNOTATION`; `passes.tag_reshard`
tags those views of the body's inputs `MUST_RECOMPUTE`, so the body's partition saves the gathered flat (an input)
rather than copies of the parameters, and the outer graph's reshard tags decide as before whether the backward
re-gathers (docs/design-notes.md, "Compile once per block").

What torch refuses to reuse a body for never reaches it (docs/design-notes.md, "Block reuse on the models people
bring"): a call with an argument other than tensors, numbers, strings, None and modules (transformers' KV cache
objects) runs the unit's own forward, with one warning; an output's non-tensors, returned arguments (T5's blocks) and
structure (dicts, dataclasses, `ModelOutput`s) are taken out of the body and put back by the caller from a template
recorded at trace time (`block_output`); an output that cannot be rebuilt so runs the unit's own forward, with one
warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from torch._dynamo.comptime import comptime
from torch.utils._pytree import tree_leaves

from fsdp_graph import compat
from fsdp_graph.ir import REGION_PARAM_ANNOTATION
from fsdp_graph.runtime.block_output import rebuild_output, refusal, split_output
from fsdp_graph.runtime.flat_param import ParamSlot

REGION_FLATS = "_fsdp_region_flats"  # the gathered flats a unit's body reads while it runs (compiled only)
BLOCK_KEY = "_fsdp_block_key"  # the structure key `_reuse_key` returns

_PLAIN = (bool, int, float, str, type(None))
_REUSING_CLASSES: dict[type, type] = {}
_UNKEYED = frozenset({"training", BLOCK_KEY})
# transformers' layers keep their index only to address a KV cache (`cache.update(..., self.layer_idx)`, read
# nowhere else in forward in the families tested); a call passing a cache object never runs a shared body (it is an
# argument torch refuses), so the index cannot be baked into one.
_CACHE_INDEX = frozenset({"layer_idx"})


def region_flat(unit: nn.Module, index: int) -> torch.Tensor | None:
    """The gathered flat parameter `index` of `unit` while its reused body runs under torch.compile (else None)."""
    flats = unit.__dict__.get(REGION_FLATS)
    return None if flats is None else flats[index]


def region_param(
    param_of: Callable[[torch.Tensor, ParamSlot], torch.Tensor], flat: torch.Tensor, slot: ParamSlot
) -> torch.Tensor:
    """`param_of(flat, slot)`, annotated as a parameter read inside a body (see the module docstring)."""
    with torch.fx.traceback.annotate(REGION_PARAM_ANNOTATION):
        return param_of(flat, slot)


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


def complex_refusals(units: dict[str, nn.Module]) -> dict[str, str]:
    """For each unit (FQN -> module) holding a complex tensor (torchtitan's complex RoPE cache is a buffer of every
    layer), why it cannot share a body: torch 2.13's invoke_subgraph has no kernel for the Conjugate dispatch key
    that complex tensors carry, so such a body fails when it runs (measured on torchtitan's Llama3)."""
    refusals = {}
    for fqn, unit in units.items():
        for name, tensor in [*unit.named_buffers(), *unit.named_parameters()]:
            if tensor.is_complex():
                refusals[fqn] = (
                    f"unit {fqn!r} holds a complex tensor ({name!r}, {tensor.dtype}), and torch's invoke_subgraph has "
                    "no kernel for complex tensors' Conjugate dispatch key"
                )
                break
    return refusals


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


def make_reusable(unit: nn.Module) -> None:
    """Give `unit` (a unit with flat parameters, its class already swapped, no `reuse_refusals` entry) a forward that
    gathers outside a compile region shared by every unit of the same structure."""
    unit.__dict__[BLOCK_KEY] = block_key(unit)
    cls = type(unit)
    if cls not in _REUSING_CLASSES:
        members = {"forward": _gathering_forward, "_fsdp_block_forward": cls.forward}
        _REUSING_CLASSES[cls] = type(f"Reused{cls.__name__}", (cls,), members)
    unit.__class__ = _REUSING_CLASSES[cls]


def block_key(unit: nn.Module) -> int:
    """What a body traced for one unit bakes in, as an int: every submodule's class and plain attributes, its
    buffers' metadata, where each parameter lives in which flat parameter, the flats' gather facts (not the
    unit's name) and which of their parameters are frozen. Units with equal keys share one body; a change of
    `requires_grad` after fully_shard computes the key again (`unit.sync_requires_grad`)."""
    from fsdp_graph.ir.ops import UNSHARD_SIGNATURE

    parts: list = []
    for name, module in unit.named_modules():
        cls = getattr(type(module), "_fsdp_original_class", type(module))
        skipped = _UNKEYED | (_CACHE_INDEX if cls.__module__.startswith("transformers.") else frozenset())
        attrs = sorted((k, v) for k, v in vars(module).items() if isinstance(v, _PLAIN) and k not in skipped)
        buffers = [
            (b_name, None if b is None else (tuple(b.shape), b.dtype, b.device))
            for b_name, b in module._buffers.items()
        ]
        views = sorted((p, spec.index, spec.slot) for p, spec in module.__dict__.get("_fsdp_views", {}).items())
        parts.append((name, cls.__module__, cls.__qualname__, tuple(attrs), tuple(buffers), tuple(views)))
    for state in unit.__dict__["_fsdp_states"]:
        static = dict(zip(UNSHARD_SIGNATURE.names[1:], state.static_unshard_args))
        static.pop("unit", None)
        layout = state.layout
        slots = tuple((tuple(s.shape), s.offset, *((s.dim,) if s.dim else ())) for s in layout.slots)
        frozen = (state.flat_shard.requires_grad, state.detached_slots)  # a body bakes in which reads are detached
        parts.append((sorted(static.items(), key=str), layout.kind, layout.world, layout.shard_numel, slots, frozen))
    return hash(repr(parts))


_KEY_MOD = (1 << 61) - 1


def _reuse_key(self: nn.Module, count: int, *flats_and_args, **kwargs) -> int:
    """The unit's structure key, its training flag and what the call's arguments bake into a body: each tensor's
    dtype, shape and device type, and each constant (not `requires_grad`: a body computes every input's gradient,
    the first block's too). Dynamo traces this (it stamps out a body for an equal key without comparing arguments
    itself), so it is integer arithmetic on values known at trace time.
    Without the arguments, a block whose input is float32 (an embedding plus a float32 table) and the next one,
    whose input is its bf16 output, shared a body traced for float32: the backward failed on mixed dtypes."""
    key = self.__dict__[BLOCK_KEY] * 2 + int(self.training)
    for leaf in tree_leaves((flats_and_args[count:], kwargs)):
        if isinstance(leaf, torch.Tensor):
            facts = (hash(str(leaf.dtype)), hash(leaf.device.type), leaf.ndim, *leaf.shape)
        elif isinstance(leaf, _PLAIN):
            facts = (hash(leaf),)
        else:  # a module: its class (its parameters are the unit's or outside the key, as before)
            facts = (hash(type(leaf).__qualname__),)
        for fact in facts:
            key = (key * 1_000_003 + fact) % _KEY_MOD
    return key


def _body(self: nn.Module, count: int, *flats_and_args, **kwargs):
    flats, args = flats_and_args[:count], flats_and_args[count:]
    setattr(self, REGION_FLATS, flats)
    out = type(self)._fsdp_block_forward(self, *args, **kwargs)
    setattr(self, REGION_FLATS, None)
    key = _reuse_key(self, count, *flats_and_args, **kwargs)  # noqa: F841 (comptime reads it and `template`)
    # torch reuses a body only if it returns tensors, none of them an input: return those, and record the rest of
    # the output (T5's None and the position bias a block passes on, a dict, a dataclass) for the caller to rebuild.
    template, tensors = split_output(out, args, kwargs)
    # recorded for every body traced, None too: a key's output may take another shape in a later compile
    comptime(lambda ctx: _OUTPUT_TEMPLATES.__setitem__(*_constants(ctx, "key", "template")))
    return out if template is None else () if refusal(template) is not None else tensors


_block_body = compat.nested_compile_region(_body, reuse_hash_fn=_reuse_key)
_OUTPUT_TEMPLATES: dict[int, object] = {}  # reuse key -> `split_output`'s template
_WARNED: set[tuple[str, str]] = set()
_SCALARS = (bool, int, float, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)
_ARGUMENT_TYPES = (torch.Tensor, nn.Module, *_SCALARS)


def _gathering_forward(self: nn.Module, *args, **kwargs):
    """Eager: the unit's own forward. Compiled: its gathers, then the shared body, its output rebuilt from the body's
    tensors; or, for a call or an output torch could not reuse a body for, the unit's own forward (its parameters
    gathered as without `reuse_blocks`), with one warning."""
    if not torch.compiler.is_compiling():
        return type(self)._fsdp_block_forward(self, *args, **kwargs)
    refused = _refused_argument(args, kwargs)
    if refused is not None:
        block = getattr(type(self), "_fsdp_original_class", type(self)).__qualname__
        message = _refusal_message(block, refused)  # noqa: F841 (comptime reads it at trace time)
        comptime(lambda ctx: _warn_once(*_constants(ctx, "block", "message")))
        return type(self)._fsdp_block_forward(self, *args, **kwargs)
    from fsdp_graph.runtime.unit import unsharded_flat

    flats = tuple(unsharded_flat(self, index) for index in range(len(self.__dict__["_fsdp_states"])))
    # The flats unpacked, not one tuple argument: with only tensors, ints and modules as arguments Dynamo
    # fingerprints a call without pytree-flattening it (`build_fingerprint_fast`), about 0.07 s a call.
    out = _block_body(self, len(flats), *flats, *args, **kwargs)
    template = _output_template(_reuse_key(self, len(flats), *flats, *args, **kwargs))
    if template is None:
        return out
    why = refusal(template)
    if why is not None:
        block = getattr(type(self), "_fsdp_original_class", type(self)).__qualname__
        message = _output_refusal_message(block, why)  # noqa: F841 (comptime reads it at trace time)
        comptime(lambda ctx: _warn_once(*_constants(ctx, "block", "message")))
        return type(self)._fsdp_block_forward(self, *args, **kwargs)
    return rebuild_output(template, out, args, kwargs)


@torch._dynamo.assume_constant_result
def _output_template(key: int) -> object:
    """What `_body` recorded for `key` while tracing it, read at trace time (Dynamo keeps no guard on it: a new
    trace records it again, for its first body of that key)."""
    return _OUTPUT_TEMPLATES.get(key)


def _refused_argument(args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(where, type name) of the first argument torch's reuse check would refuse: anything but a tensor, a symbolic
    or plain scalar, a string, None or a module, inside tuples, lists and dicts (`classify_vt`)."""
    named = [(f"positional argument {i}", value) for i, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, (tuple, list)):
                pending.extend(item)
            elif isinstance(item, dict):
                pending.extend(item.values())
            elif not isinstance(item, _ARGUMENT_TYPES):
                return name, type(item).__name__
    return None


def _refusal_message(block: str, refused: tuple[str, str]) -> str:
    name, type_name = refused
    hint = " (for training: use_cache=False, or model.config.use_cache = False)" if "cache" in name.lower() else ""
    return (
        f"reuse_blocks: {block} is traced layer by layer, not as one shared body: its argument {name!r} is a "
        f"{type_name}, and torch's nested_compile_region reuses a body only for tensors, numbers, strings, None and "
        f"modules (invoke_subgraph's is_reuse_eligible: 'unsupported input VT types'){hint}"
    )


def _output_refusal_message(block: str, why: str) -> str:
    return (
        f"reuse_blocks: {block} is traced layer by layer, not as one shared body: its forward returns {why}, and "
        "torch's nested_compile_region reuses a body only if it returns tensors (invoke_subgraph's "
        "is_reuse_eligible); return tensors, tuples, lists, dicts or dataclasses of them, or pass reuse_blocks=False"
    )


def _constants(ctx, *names: str) -> list:
    """The values of the traced frame's locals `names`, which are Python constants, at trace time (`comptime`)."""
    return [ctx.get_local(name).as_python_constant() for name in names]


def _warn_once(block: str, message: str) -> None:
    if (block, message) not in _WARNED:
        _WARNED.add((block, message))
        warnings.warn(message, stacklevel=1)
