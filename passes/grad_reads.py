"""Read-only analysis of a Dynamo graph: which graph outputs each read of a gathered flat parameter can give a
gradient to.

A compiled graph is one autograd node: an output the loss never reaches still gets a gradient in its backward
(zeros, materialized by autograd), and so does every parameter that only reaches that output. Eager autograd gives
such a parameter no gradient at all. The runtime tells the two apart per backward from which outputs did receive a
gradient; this analysis says, per output, which parameters that decides for.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fsdp_graph.ir import ROWS_COPY_OUT_TARGETS, UNSHARD_TARGETS

_IN_PLACE = frozenset(
    {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow, operator.iand}
)


@dataclass(frozen=True)
class GatheredRead:
    """A differentiable read of the flat parameter gathered from graph input `shard_input`: the view it reads starts
    at element `position` of the gathered tensor (None: the whole tensor). `outputs` holds bit i for each graph
    output i it reaches; `always`: it reaches an in-place write, whose gradients no output shows."""

    shard_input: int
    position: int | None
    outputs: int
    always: bool


def gathered_reads(gm: fx.GraphModule) -> list[GatheredRead]:
    """Every differentiable read of a gathered flat parameter in `gm` (a Dynamo graph, after `dedup_unshard`).

    Matches: `fsdp.unshard` nodes whose shard is a graph input; views of their result (nodes whose example value is
    a view and whose first argument is the gathered tensor or a view of it) are followed; each other node taking such
    a view, whose own value requires grad, is one read, at the element its view starts (`fsdp.rows_copy_out`: at its
    `start` column, where the slot's block starts in every rank's shard). Guarantees: a read that can pass a
    gradient to an output has that output's bit (or `always`), so a parameter can be judged gradient-free only when
    none of its reads' outputs got one; reads are not deduplicated. Empty when the graph gathers nothing with gradients. Changes nothing.
    """
    inputs = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    views: dict[fx.Node, tuple[int, fx.Node]] = {}  # view node -> (graph input, the unshard it views)
    found: list[tuple[fx.Node, int, int | None]] = []  # (reading node, graph input, position)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in UNSHARD_TARGETS and node.args[0] in inputs:
            views[node] = (inputs[node.args[0]], node)
            continue
        read = [a for a in node.all_input_nodes if a in views]
        if not read:
            continue
        value = _value(node)
        if node.args and isinstance(node.args[0], fx.Node) and node.args[0] in views and _is_view(value):
            views[node] = views[node.args[0]]
            continue
        if isinstance(value, torch.Tensor) and not value.requires_grad and not _mutates(node):
            continue  # detach(), argmax...: no gradient flows back through it
        for arg in read:
            shard_input, unshard = views[arg]
            position = _position(arg, unshard)
            if node.target in ROWS_COPY_OUT_TARGETS and arg is node.args[0] and position is None:
                position = node.args[3]  # the rows layout's copy-out reads its columns from `start` on
            found.append((node, shard_input, position))
    if not found:
        return []
    masks = _output_masks(gm)
    return [GatheredRead(i, pos, masks[node][0], masks[node][1]) for node, i, pos in found]


def _output_masks(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, bool]]:
    """Per node, (bit i for each graph output i its value flows into, whether it flows into an in-place write)."""
    masks: dict[fx.Node, tuple[int, bool]] = {}
    for node in reversed(gm.graph.nodes):
        bits, always = 0, _mutates(node)
        for user in node.users:
            if user.op == "output":
                bits |= _output_bits(user, node)
            else:
                user_bits, user_always = masks[user]
                bits, always = bits | user_bits, always or user_always
        masks[node] = (bits, always)
    return masks


def _output_bits(output: fx.Node, node: fx.Node) -> int:
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return sum(1 << i for i, value in enumerate(fx.node.map_arg(values, lambda n: n)) if value is node)


def _value(node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _is_view(value) -> bool:
    return isinstance(value, torch.Tensor) and value._base is not None


def _position(view: fx.Node, unshard: fx.Node) -> int | None:
    """Where the read view starts in the gathered tensor; None when it spans all of it (or is unknown)."""
    value, whole = _value(view), _value(unshard)
    if view is unshard or value is None or whole is None or value.numel() >= whole.numel():
        return None
    offset = value.storage_offset()
    return offset if isinstance(offset, int) else None


def _mutates(node: fx.Node) -> bool:
    """An in-place write (`x.add_(y)`, `x[i] = y`, `x += y`, a mutating op overload)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("__")
