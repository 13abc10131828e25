"""Joint-graph pass: decide what the backward re-gathers (FULL_SHARD) and what the forward saves."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_graph.ir import UNSHARD_TARGETS, unshard_args


def reshard_after_forward(node: fx.Node) -> bool:
    return bool(unshard_args(node).reshard_after_forward)


def _is_view_of(user: fx.Node, base: fx.Node) -> bool:
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        return user.args[0] is base
    target = user.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view and user.args[0] is base


def tag_reshard(graph: fx.Graph) -> fx.Graph:
    """In place on the joint graph (before partitioning).

    Matches: `fsdp.unshard` nodes. For `reshard_after_forward=True` it tags the node and every view chained
    on it `meta["recompute"] = MUST_RECOMPUTE`, so the partitioner saves only the shard and the backward
    re-gathers; for False it tags the gather `MUST_SAVE`, so the backward reuses it and gathers nothing.
    View ops have exactly one tensor input, so this walk can never reach tangent-dependent nodes: no tangent
    detection is needed. Inside an activation-checkpoint region the tags override the region's (a gathered
    parameter is never worth saving) but each node keeps its region's `ac_graph_id`. No-op when nothing
    matches.
    """
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in UNSHARD_TARGETS:
            continue
        if not reshard_after_forward(node):
            _tag(node, CheckpointPolicy.MUST_SAVE)
            continue
        todo, seen = [node], set()
        while todo:
            current = todo.pop()
            seen.add(current)
            _tag(current, CheckpointPolicy.MUST_RECOMPUTE)
            todo.extend(u for u in current.users if _is_view_of(u, current) and u not in seen)
    return graph


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta.setdefault("ac_graph_id", 0)
