"""Joint-graph pass: decide what the backward re-gathers (FULL_SHARD) and what the forward saves."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_graph.ir import REGION_PARAM_ANNOTATION, ROWS_COPY_OUT, UNSHARD, UNSHARD_SIGNATURE, UNSHARD_TARGETS
from passes.fx_nodes import INFER, NodeEmitter, bind_args
from passes.lower import emit_rank_order

# Copies of a gather's view that depend on nothing else: the rows layout's copy-out (`fsdp.rows_copy_out`; a
# `reshape` of a strided column range decomposes into the other two). Saving them would keep an unsharded parameter
# alive to the backward.
_COPY_OUTS = (ROWS_COPY_OUT, torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default)


def _is_view_of(user: fx.Node, base: fx.Node) -> bool:
    """Whether `user` is a view of `base`, or a copy of it taking no other tensor."""
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        return user.args[0] is base
    target = user.target
    if target in _COPY_OUTS:
        return user.args[0] is base
    return isinstance(target, torch._ops.OpOverload) and target.is_view and user.args[0] is base


def tag_reshard(graph: fx.Graph) -> fx.Graph:
    """In place on the joint graph (before partitioning).

    Matches: `fsdp.unshard` nodes. For `reshard_after_forward=True` it tags the node and every view chained
    on it (and every copy of one: the rows layout's copy-out) `meta["recompute"] = MUST_RECOMPUTE`, so the partitioner saves only the shard and the backward
    re-gathers; for False it tags the gather `MUST_SAVE`, so the backward reuses it and gathers nothing. A gather
    the forward outputs (kept past the step by `set_reshard_after_backward(False)`) lives on anyway: `MUST_SAVE`.
    View and copy ops have exactly one tensor input, so this walk can never reach tangent-dependent nodes: no tangent
    detection is needed. Inside an activation-checkpoint region the tags override the region's (a gathered
    parameter is never worth saving) but each node keeps its region's `ac_graph_id`.

    `post_forward_world` k > 1 (`reshard_after_forward=k`), resharded: the node is split into its two steps,
    `piece = fsdp.unshard(shard, group=piece_group, world=world / k)` (tagged `MUST_SAVE`: the forward keeps this
    1/k piece) and `fsdp.unshard(piece, group=post_forward_group, world=k)` followed by `emit_rank_order` (tagged
    `MUST_RECOMPUTE` with every view: the backward gathers within the node group only). Both steps are plain
    gathers, so the lowering needs nothing more; the gradient's reduction (already in the joint graph) stays over
    the whole group. No-op when nothing matches.
    """
    _tag_region_params(graph)
    _bypass_passthroughs(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in UNSHARD_TARGETS:
            continue
        views = _view_closure(node)
        args = bind_args(node)
        if not args["reshard_after_forward"] or any(u.op == "output" for v in views for u in v.users):
            _tag(node, CheckpointPolicy.MUST_SAVE)
            continue
        if args["post_forward_world"] > 1 and args["gathered"] is None:
            node = _split_gather(graph, node, args)
            views = _view_closure(node)
        for view in views:
            _tag(view, CheckpointPolicy.MUST_RECOMPUTE)
    return graph


def _tag_region_params(graph: fx.Graph) -> None:
    """A reused block's body (`fully_shard(reuse_blocks=True)`; Inductor runs this pass on each body's joint graph
    too): its parameters are views and copies of input placeholders (the gathered flats, an argument), annotated
    by the runtime. Tag them `MUST_RECOMPUTE`, so the body saves its input and never a copy of a parameter; the
    outer graph's tags on the gather then decide whether that input is re-gathered in backward or kept."""
    for placeholder in graph.find_nodes(op="placeholder"):
        for view in _view_closure(placeholder)[1:]:
            custom = view.meta.get("custom") or {}
            if all(custom.get(key) == value for key, value in REGION_PARAM_ANNOTATION.items()):
                _tag(view, CheckpointPolicy.MUST_RECOMPUTE)


def _bypass_passthroughs(graph: fx.Graph) -> None:
    """After AOT autograd partitioned a reused block's body, the outer joint graph's forward `invoke_subgraph`
    returns every input the body's backward needs, a gathered flat included, and the backward call reads that
    output: the gather would be kept alive to the backward whatever its tags say. Such an output is its input
    (the body returns the placeholder itself), so its readers read the input instead, and the gather's tags apply."""
    module = graph.owning_module
    for node in graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        body = getattr(module, node.args[0].target, None) if isinstance(node.args[0], fx.Node) else None
        if not isinstance(body, fx.GraphModule):
            continue
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        outputs = body.graph.output_node().args[0]
        for user in list(node.users):
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                continue
            out = outputs[user.args[1]]
            if isinstance(out, fx.Node) and out.op == "placeholder":
                user.replace_all_uses_with(node.args[2 + placeholders.index(out)])
                graph.erase_node(user)


def _split_gather(graph: fx.Graph, node: fx.Node, args: dict) -> fx.Node:
    """`node` (a gather under `reshard_after_forward=k`) as its piece gather (tagged `MUST_SAVE`) and the node-group
    gather of the piece; returns the latter, which now has `node`'s users (through the rank-order permutation)."""
    k, world = args["post_forward_world"], args["world"]
    meta = {key: value for key, value in node.meta.items() if key in ("ac_graph_id", "stack_trace", "seq_nr")}
    emit = NodeEmitter(graph, meta, before=node)
    piece_values = {
        "shard": args["shard"],
        "unit": args["unit"],
        "group": args["piece_group"],
        "world": world // k,
        "dtype": args["dtype"],
        "compute_device": args["compute_device"],
    }
    piece = emit(UNSHARD, UNSHARD_SIGNATURE.call_args(piece_values))
    _tag(piece, CheckpointPolicy.MUST_SAVE)
    node_values = {"shard": piece, "unit": args["unit"], "group": args["post_forward_group"], "world": k}
    node_major = emit(UNSHARD, UNSHARD_SIGNATURE.call_args(node_values), val=INFER)
    full = emit_rank_order(emit, node_major, k, world)
    node.replace_all_uses_with(full)
    graph.erase_node(node)
    return node_major


def _view_closure(node: fx.Node) -> list[fx.Node]:
    """`node` and every view chained on it."""
    todo, seen = [node], [node]
    while todo:
        current = todo.pop()
        for user in current.users:
            if _is_view_of(user, current) and user not in seen:
                seen.append(user)
                todo.append(user)
    return seen


def _tag(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta.setdefault("ac_graph_id", 0)
