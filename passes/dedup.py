"""Dynamo-graph pass: one `fsdp.unshard` per distinct call (unit, dtype, ...)."""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_graph.ir import UNSHARD_SIGNATURE, UNSHARD_TARGETS
from passes.fx_nodes import bind_args


def _key(node: fx.Node) -> tuple:
    return (tuple(node.args), tuple(sorted(node.kwargs.items())))


def _detached_source(node: fx.Node) -> fx.Node | None:
    """`x` when `node` is `x.detach()` (Dynamo's method call or the aten op), else None."""
    if node.op == "call_method" and node.target == "detach":
        return node.args[0]
    if node.op == "call_function" and node.target in (torch.Tensor.detach, torch.ops.aten.detach.default):
        return node.args[0]
    return None


def _same_gather(node: fx.Node) -> fx.Node | None:
    """The unshard node that `node` reuses the result of: `node` passes `gathered=x.detach()` (a gather kept by
    `set_reshard_after_backward(False)`) where `x` is this graph's own unshard with `node`'s other arguments."""
    gathered = bind_args(node)["gathered"]
    source = _detached_source(gathered) if isinstance(gathered, fx.Node) else None
    if source is None or source.op != "call_function" or source.target not in UNSHARD_TARGETS:
        return None
    values = UNSHARD_SIGNATURE.bind(node.args, node.kwargs)._asdict()
    values["gathered"] = None
    mine = UNSHARD_SIGNATURE.call_args(values)
    theirs = UNSHARD_SIGNATURE.call_args(UNSHARD_SIGNATURE.bind(source.args, source.kwargs)._asdict())
    return source if mine == theirs else None


def dedup_unshard(gm: fx.GraphModule) -> fx.GraphModule:
    """In place: every `fsdp.unshard` node whose arguments equal an earlier one's in the same graph is replaced
    by it, in the graph and in every nested graph (higher-order-op bodies such as activation checkpointing).

    Matches: `fsdp.unshard` calls (each property read in forward makes one). Guarantees: at most one gather
    per (flat shard, unit, group, dtype, ...) per graph, so autograd sums every use's gradient before ONE
    `fsdp.reduce_grad` per unit. Safe: the arguments are graph inputs or constants, so the first call
    dominates every later use. Likewise a call whose `gathered` input is the detached result of this graph's own
    call with its other arguments (the step that starts keeping a gather reads it again) is that call. No-op when
    nothing matches.
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
        same = first.get(key) or _same_gather(node)
        if same is not None:
            node.replace_all_uses_with(same)
            gm.graph.erase_node(node)
            changed = True
        else:
            first[key] = node
    if changed:
        gm.recompile()
