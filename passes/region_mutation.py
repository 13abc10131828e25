"""Dynamo-graph pass: in-place writes of a compile region's inputs move out of the region (issue 32).

torch 2.13's `invoke_subgraph` (a `nested_compile_region`, `fully_shard`'s shared block body) refuses to train a
body that writes an input in place ("does not currently support training with in-place input or buffer
mutations", raised while AOT autograd traces it). Dynamo passes such bodies through: a buffer the block updates
(torchtitan's MoE `tokens_per_expert`, BatchNorm's running statistics and `num_batches_tracked`, a cache written
with `index_copy_`) or a forward input it writes is a lifted input of the body, written by an in-place op inside.

The rewrite is exact: the body clones each input it writes, first thing, and every use of the input reads the
clone instead, so the body's arithmetic is unchanged and only the clone is written; it returns the clone's final
value after its own outputs; each call passes the body a clone of the operand (the region's autograd saves its
operands for the backward, and the backward must see them as they were) and copies the returned value into the
operand right after the call, outside the region. Reads before the call see the old value and reads after it the new one, as when the body wrote the operand
itself. What a body writes is found by running it on fake tensors and collecting the arguments every op's schema
marks written, matched to the inputs by storage (a write through a view counts), the schemas torch's own refusal
reads (ops that hide their writes, batch norm's running statistics, decomposed first, as compile tracing does).
"""

from __future__ import annotations

import operator

import torch
import torch._decomp
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def lift_region_mutations(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """In place: every `invoke_subgraph` body of `gm` that writes one of its inputs writes a clone instead and
    returns it; every call of that body copies the returned value into its operand after the call.

    Matches: `invoke_subgraph` calls whose body (the `get_attr` submodule) writes an input in place (an op whose
    schema writes it, on a fake run). Guarantees: no body writes an input; the operands hold after each call the values
    the body would have written; each body is rewritten once, however many calls share it. Returns the rewritten
    bodies' names with the indices of the inputs moved out. No-op (an empty dict) when no body writes an input.
    """
    calls = gm.graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)
    lifted: dict[str, tuple[int, ...]] = {}
    outputs: dict[str, int] = {}
    for call in calls:
        name = call.args[0].target
        if name not in lifted:
            body = getattr(gm, name)
            written = written_inputs(body)
            lifted[name] = written
            if written:
                outputs[name] = _return_clones(body, written)
        if lifted[name]:
            _copy_back(gm.graph, call, lifted[name], outputs[name])
    lifted = {name: written for name, written in lifted.items() if written}
    if lifted:
        gm.recompile()
    return lifted


def written_inputs(body: fx.GraphModule) -> tuple[int, ...]:
    """The positions of `body`'s tensor inputs that running it writes in place, found on fake tensors: every aten
    op's arguments its schema marks written (`Tensor(a!)`: in-place methods, `out=`, and ops such as batch norm's
    that update their running statistics without a version bump), matched to the inputs by storage, so a write
    through a view counts."""
    placeholders = body.graph.find_nodes(op="placeholder")
    examples = [node.meta.get("example_value") for node in placeholders]
    fake_mode = next((_fake_mode(e) for e in examples if _fake_mode(e) is not None), None)
    if fake_mode is None:  # not a Dynamo graph (no fake example values): nothing to run it on
        return ()
    grad_enabled = torch.is_grad_enabled()
    watcher = _WriteWatcher()
    try:
        with fake_mode, torch.no_grad():
            inputs = [_fresh(e) for e in examples]
            with watcher:
                body(*inputs)
    except RuntimeError:
        # torch 2.11 cannot run some ops on fresh fakes of symbolic size ("Cannot call numel() on tensor with
        # symbolic sizes"): nothing is lifted then, and a body that does write an input fails in AOT autograd with
        # torch's own error (never silently); a unit writing its buffers is traced on its own there anyway
        return ()
    finally:
        torch.set_grad_enabled(grad_enabled)  # a body toggles grad mode itself (`torch.no_grad()` blocks)
    return tuple(i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and _storage(t) in watcher.written)


class _WriteWatcher(TorchDispatchMode):
    """Collects the storages of the tensors each op's schema says it writes."""

    def __init__(self, written: set | None = None):
        super().__init__()
        self.written: set = set() if written is None else written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _hides_writes(func):  # decomposed as AOT autograd does, into ops whose schemas show the writes
            with _WriteWatcher(self.written):  # this mode is off inside its own handler: watch the parts too
                return torch._decomp.decomposition_table[func](*args, **kwargs)
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for position, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                for tensor in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(tensor, torch.Tensor):
                        self.written.add(_storage(tensor))
        return func(*args, **kwargs)


def _hides_writes(func: object) -> bool:
    """Ops whose schema does not show what they write, which compile tracing always decomposes: those tagged
    `maybe_aliasing_or_mutating`, and batch norm, which updates its running statistics
    (`torch._decomp._should_decompose_because_unsafe_op`'s rule)."""
    if not isinstance(func, torch._ops.OpOverload) or func not in torch._decomp.decomposition_table:
        return False
    return torch.Tag.maybe_aliasing_or_mutating in func.tags or func is torch.ops.aten.native_batch_norm.default


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def _fresh(example: object) -> object:
    """A new fake tensor like `example` (a storage of its own, no autograd history), or `example` itself if not a
    tensor."""
    if not isinstance(example, torch.Tensor):
        return example
    return torch.empty_strided(example.shape, example.stride(), dtype=example.dtype, device=example.device)


def _return_clones(body: fx.GraphModule, written: tuple[int, ...]) -> int:
    """Rewrites `body`: a clone of each written input, read in its place, returned after the body's own outputs.
    Returns the number of outputs the body had."""
    graph = body.graph
    placeholders = graph.find_nodes(op="placeholder")
    output = graph.find_nodes(op="output")[0]
    results = output.args[0]
    count = len(results)
    clones = []
    with graph.inserting_after(placeholders[-1]):
        for index in reversed(written):  # inserted after the last placeholder: reversed keeps them in order
            source = placeholders[index]
            clone = graph.call_function(torch.clone, (source,))
            clone.meta.update(_cloned_meta(source))
            clones.insert(0, (source, clone))
    for source, clone in clones:
        source.replace_all_uses_with(clone, delete_user_cb=lambda user, clone=clone: user is not clone)
    output.args = (tuple(results) + tuple(clone for _, clone in clones),)
    body.recompile()
    return count


def _copy_back(graph: fx.Graph, call: fx.Node, written: tuple[int, ...], count: int) -> None:
    """Around `call`: each written operand passed as a clone (the region's autograd saves its operands for the
    backward, which must see them unwritten), and `operand.copy_(new value)` after the call."""
    operands = list(call.args[2:])
    example = call.meta.get("example_value")
    news = []
    anchor = call
    for position, index in enumerate(written):
        operand = operands[index]
        with graph.inserting_before(call):
            staged = graph.call_function(torch.clone, (operand,))
        staged.meta.update(_cloned_meta(operand))
        operands[index] = staged
        with graph.inserting_after(anchor):
            new = graph.call_function(operator.getitem, (call, count + position))
        new.meta.update(_cloned_meta(operand))
        with graph.inserting_after(new):
            anchor = graph.call_method("copy_", (operand, new))
        anchor.meta.update(_cloned_meta(operand))
        news.append(new.meta.get("example_value"))
    call.args = (*call.args[:2], *operands)
    if isinstance(example, (tuple, list)) and len(example) == count:
        call.meta["example_value"] = (*example, *news)


def _cloned_meta(node: object) -> dict:
    """The example value of a clone of `node` (a fake tensor, made in its own fake mode), when it has one."""
    example = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    fake_mode = _fake_mode(example)
    if fake_mode is None:
        return {}
    with fake_mode:
        return {"example_value": torch.clone(example)}


def _fake_mode(example: object):
    """The fake mode `example` (a Dynamo example value) was made in, or None when it is not a fake tensor. Read off
    the tensor: inside a backend the tracing context's mode can be another one."""
    from torch._subclasses.fake_tensor import FakeTensor

    return example.fake_mode if isinstance(example, FakeTensor) else None
