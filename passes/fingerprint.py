"""Read-only analysis: the collective sequence of a lowered graph, as text every rank can compare."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.fx_nodes import bind_args, collective_group, fake_value


def _numel(value: torch.Tensor) -> str:
    numel = value.numel()
    if isinstance(numel, torch.SymInt):  # dynamic shapes: the expression, the same on every rank that traced it
        return str(numel.node.hint) if numel.node.has_hint() else str(numel)
    return str(int(numel))


def _describe(value) -> str:
    value = fake_value(value)
    if isinstance(value, torch.Tensor):
        return f"{_numel(value)} x {str(value.dtype).removeprefix('torch.')}"
    return "?"


def _arguments(arguments: dict) -> list[str]:
    """The issue node's non-tensor arguments (group size, reduce op, split sizes) in schema order, group left out."""
    return [
        f"{name}={value}"
        for name, value in arguments.items()
        if not isinstance(value, fx.Node) and name != "group_name"
    ]


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
        group = collective_group(node)
        if group is None:
            continue
        arguments = bind_args(node)
        words = [f"group={group}", *_arguments(arguments), f"{_describe(node.args[0])} -> {_describe(node)}"]
        lines.append(f"{node.target._schema.name.split('::')[-1]}({', '.join(words)})")
    return lines
