"""Dynamo-graph pass: one `fsdp.unshard` per distinct call (unit, dtype, ...)."""

from __future__ import annotations

import torch.fx as fx

from fsdp_graph.ir import UNSHARD_TARGETS


def _key(node: fx.Node) -> tuple:
    return (tuple(node.args), tuple(sorted(node.kwargs.items())))


def dedup_unshard(gm: fx.GraphModule) -> fx.GraphModule:
    """In place: every `fsdp.unshard` node whose arguments equal an earlier one's in the same graph is replaced
    by it, in the graph and in every nested graph (higher-order-op bodies such as activation checkpointing).

    Matches: `fsdp.unshard` calls (each property read in forward makes one). Guarantees: at most one gather
    per (flat shard, unit, group, dtype, ...) per graph, so autograd sums every use's gradient before ONE
    `fsdp.reduce_grad` per unit. Safe: the arguments are graph inputs or constants, so the first call
    dominates every later use. No-op when nothing matches.
    """
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            _dedup_graph(module)
    return gm


def _dedup_graph(gm: fx.GraphModule) -> None:
    first: dict[tuple, fx.Node] = {}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in UNSHARD_TARGETS:
            continue
        key = _key(node)
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
            changed = True
        else:
            first[key] = node
    if changed:
        gm.recompile()
