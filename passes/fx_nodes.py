"""What every pass needs to read and write FX nodes, written once.

- `bind_args`: a node's arguments by name, against its op's schema, with the schema's defaults;
- `node_bytes` / `value_bytes` / `hint`: bytes of a node's fake value (`meta["val"]`), symbolic sizes at their hints;
- `alias_source` / `written_args`: which input's storage an op's output shares, and which inputs it writes;
- `collective_group`: the process group a `_c10d_functional` collective runs on;
- `NodeEmitter`: inserts nodes carrying a pass's `fsdp_*` meta and a fake value; `finish`: lint and recompile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fsdp_graph.ir import COLLECTIVES, WAIT

_aten, _prims = torch.ops.aten, torch.ops.prims


def op_schema(target: Any) -> torch._C.FunctionSchema | None:
    """The schema of an op overload, or of a packet with a single overload (Dynamo graphs call `torch.ops.fsdp.unshard`
    itself); None for anything else (Python functions, packets whose overload the call does not name)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = target.overloads()
        target = getattr(target, overloads[0]) if len(overloads) == 1 else None
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def bind_args(node: fx.Node) -> dict[str, Any]:
    """Every argument of the op `node` calls, by its schema name: positional, keyword, else the schema's default.
    Raises TypeError for a node that calls no op with a schema or leaves a required argument out."""
    schema = op_schema(node.target)
    if schema is None:
        raise TypeError(f"bind_args: {node.format_node()} does not call an op with a schema")
    bound = {}
    for index, argument in enumerate(schema.arguments):
        if not argument.kwarg_only and index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            raise TypeError(f"bind_args: {node.format_node()} leaves out {schema.name}'s argument {argument.name!r}")
    return bound


def fake_value(arg: Any) -> Any:
    """The fake value (`meta["val"]`) of a node argument; None for a constant or a node without one."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def hint(x: int | torch.SymInt) -> int:
    """A concrete int for an int or SymInt: its hint (the value the graph was traced with), else Inductor's
    optimization hint (unbacked sizes), which falls back to 1."""
    if isinstance(x, torch.SymInt):
        node = x.node
        if node.has_hint():
            return int(node.hint)
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(x, fallback=1))
    return int(x)


def tensor_bytes(val: Any) -> int:
    """Bytes of one tensor (a symbolic size at its hint); 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    return hint(val.numel()) * val.element_size()


def value_bytes(val: Any) -> int:
    """Bytes of every tensor in a (possibly nested tuple/list) value."""
    return sum(tensor_bytes(v) for v in tree_flatten(val)[0])


def node_bytes(node: fx.Node) -> int:
    """Bytes of the node's value, from `meta["val"]`: 0 without one."""
    return value_bytes(node.meta.get("val"))


def alias_source(node: fx.Node) -> fx.Node | None:
    """The input whose storage `node`'s tensor output shares, or None when the op allocates (or `node` calls no op).

    - view ops (schema `Tensor(a) self -> Tensor(a)`) and `_unsafe_view`: their input;
    - in-place and `out=` ops (`Tensor(a!)`): the argument they mutate and return;
    - `wait_tensor`: its collective, whose buffer it returns;
    - `reshape`: its input when that is contiguous (then it is a view), else nothing (it may copy);
    - `prims.device_put`: its input when the device is the same (its kernel is `Tensor.to`, which returns the input
      itself), else nothing. Inductor lowers every `device_put` to a copy, so under Inductor a same-device one
      holds a second copy of a (shard-sized) tensor that this analysis does not count.
    `getitem` is not an op: a tuple's element is the tuple producer's business (see `passes.cost`).
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    first = node.args[0] if node.args else None
    if target in (WAIT, _aten._unsafe_view.default):
        return first
    if target == _prims.device_put.default:
        val, out = fake_value(first), fake_value(node)
        same = isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.device == out.device
        return first if same else None
    if target.overloadpacket == _aten.reshape:
        val = fake_value(first)
        return first if isinstance(val, torch.Tensor) and val.is_contiguous() else None
    schema = target._schema
    if target.is_view or any(r.alias_info is not None for r in schema.returns):
        for name, value in bind_args(node).items():
            if _argument(schema, name).alias_info is not None:
                return value if isinstance(value, fx.Node) else None
    return None


def _argument(schema: torch._C.FunctionSchema, name: str) -> torch._C.Argument:
    return next(a for a in schema.arguments if a.name == name)


def written_args(node: fx.Node) -> list[fx.Node]:
    """The tensor arguments an op writes to (its schema's `Tensor(a!)` annotations)."""
    schema = op_schema(node.target) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for name, value in bind_args(node).items():
        alias = _argument(schema, name).alias_info
        if alias is not None and alias.is_write:
            written.extend(
                v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)
            )
    return written


def collective_group(node: fx.Node) -> str | None:
    """The process-group name a `_c10d_functional` collective issue node runs on, else None."""
    if node.op != "call_function" or node.target not in COLLECTIVES:
        return None
    group = bind_args(node)["group_name"]
    return group if isinstance(group, str) else None


class _Infer:
    """`NodeEmitter`'s default `val`: compute the fake value by running the op on the inputs' fake values."""


INFER = _Infer()


class NodeEmitter:
    """Inserts `call_function` nodes before `before` (per call, else the emitter's), each carrying `meta` (a pass's
    `fsdp_*` keys) and a fake value: the `val` given, else the op run on its inputs' fake values (`INFER`); `val=None`
    leaves `meta["val"]` unset (what a lowering does when its input has no fake value)."""

    def __init__(self, graph: fx.Graph, meta: dict[str, Any], before: fx.Node | None = None):
        self.graph, self.meta, self.before = graph, meta, before

    def __call__(
        self,
        target: Any,
        args: tuple,
        kwargs: dict[str, Any] | None = None,
        *,
        before: fx.Node | None = None,
        val: Any = INFER,
    ) -> fx.Node:
        anchor = before if before is not None else self.before
        if anchor is None:
            raise ValueError(f"NodeEmitter: no node to insert {target} before")
        kwargs = kwargs or {}
        with self.graph.inserting_before(anchor):
            node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.meta)
        if val is INFER:
            fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
            val = target(*fake_args, **fake_kwargs)
        if val is not None:
            node.meta["val"] = val
        return node


def finish(gm: fx.GraphModule, changed: bool) -> fx.GraphModule:
    """A pass's last step: when it changed the graph, check it (lint) and regenerate the module's code."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
