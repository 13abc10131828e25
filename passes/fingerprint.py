"""Read-only analysis: the collective sequence of a lowered graph, as text every rank can compare."""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_graph.ir import COLLECTIVES


def _numel(value: torch.Tensor) -> str:
    numel = value.numel()
    if isinstance(numel, torch.SymInt):  # dynamic shapes: the expression, the same on every rank that traced it
        return str(numel.node.hint) if numel.node.has_hint() else str(numel)
    return str(int(numel))


def _describe(value) -> str:
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return f"{_numel(value)} x {str(value.dtype).removeprefix('torch.')}"
    return "?"


def _arguments(node: fx.Node) -> list[str]:
    """The issue node's non-tensor arguments (group size, reduce op, split sizes) in schema order, group last."""
    schema = node.target._schema
    words = []
    for index, argument in enumerate(schema.arguments):
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name, argument.default_value)
        if isinstance(value, fx.Node) or argument.name == "group_name":
            continue
        words.append(f"{argument.name}={value}")
    return words


def collective_fingerprint(gm: fx.GraphModule) -> list[str]:
    """One line per `_c10d_functional` collective issue node of a lowered graph, in graph (= issue) order.

    Matches: all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single. Each line names the op,
    its process group, its other non-tensor arguments (group size, reduce op, split sizes) and the element count
    and dtype of its input and output: `all_gather_into_tensor(group=1, group_size=2, 6 x float32 -> 12 x float32)`.
    Guarantees: two graphs whose lines are equal issue the same collectives with the same sizes on the same groups
    in the same order (what ranks must agree on, or a collective hangs or mixes up buffers). Pure; a graph without
    collectives gives [].
    """
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in COLLECTIVES:
            continue
        group = node.kwargs.get("group_name", node.args[-1])
        words = [f"group={group}", *_arguments(node), f"{_describe(node.args[0])} -> {_describe(node)}"]
        lines.append(f"{node.target._schema.name.split('::')[-1]}({', '.join(words)})")
    return lines
