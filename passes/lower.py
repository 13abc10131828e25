"""Forward/backward-graph pass: expand `fsdp` ops into casts and `_c10d_functional` collectives."""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_graph.ir import (
    ALL_GATHER,
    ALL_REDUCE,
    META_ROLE,
    META_UNIT,
    REDUCE_GRAD_TARGETS,
    REDUCE_SCATTER,
    ROLE_REDUCE,
    ROLE_UNSHARD,
    UNSHARD_TARGETS,
    WAIT,
    reduction_divisors,
)
from passes.fx_nodes import INFER, NodeEmitter, bind_args, fake_value, finish

_aten, _prims = torch.ops.aten, torch.ops.prims


class _Lowering(NodeEmitter):
    """Inserts nodes before the fsdp op `anchor`, each carrying the fsdp meta of the op it lowers."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, unit: str, role: str):
        super().__init__(graph, {META_UNIT: unit, META_ROLE: role}, before=anchor)

    def op(self, target, args: tuple, val: torch.Tensor | None) -> fx.Node:
        """A node whose fake value the lowering knows (None: its input has none, so neither does it)."""
        return self(target, args, val=val)

    def cast(self, node: fx.Node, dtype: torch.dtype | None) -> fx.Node:
        val = fake_value(node)
        if dtype is None or (val is not None and val.dtype == dtype):
            return node
        return self.op(_prims.convert_element_type.default, (node, dtype), None if val is None else val.to(dtype))

    def to_device(self, node: fx.Node, device: torch.device | None) -> fx.Node:
        """CPU offload's copies are kept even when the device is the same (a CPU-only run exercises the path).
        Asynchronous (non_blocking): the host-to-device copy reads a pinned shard that nothing writes during the
        graph; Inductor gives the device-to-host copy a pinned output, which the runtime reads only after the
        copy (fsdp_graph.runtime.offload.GradFence)."""
        if device is None:
            return node
        val = fake_value(node)
        return self.op(_prims.device_put.default, (node, device, True), None if val is None else val.to(device))


def _lower_unshard(graph: fx.Graph, node: fx.Node) -> fx.Node:
    a = bind_args(node)
    if a["gathered"] is not None:  # kept from an earlier step (set_reshard_after_backward(False)): no gather
        return a["gathered"]
    emit = _Lowering(graph, node, a["unit"], ROLE_UNSHARD)
    shard = emit.to_device(a["shard"], a["compute_device"])
    shard = emit.cast(shard, a["dtype"])
    if a["world"] == 1:
        return shard
    out_val = node.meta.get("val")
    k = a["post_forward_world"]
    if k > 1:  # reshard_after_forward=k, where the reshard pass left it whole (inference; a gather kept for later)
        pieces = a["world"] // k
        piece_val = None if out_val is None else out_val.new_empty(out_val.numel() // k)
        piece = emit.op(ALL_GATHER, (shard, pieces, a["piece_group"]), piece_val)
        piece = emit.op(WAIT, (piece,), piece_val)
        gathered = emit.op(ALL_GATHER, (piece, k, a["post_forward_group"]), out_val)
        return emit_rank_order(emit, emit.op(WAIT, (gathered,), out_val), k, a["world"])
    gathered = emit.op(ALL_GATHER, (shard, a["world"], a["group"]), out_val)
    return emit.op(WAIT, (gathered,), out_val)


def emit_rank_order(emit: NodeEmitter, node_major: fx.Node, k: int, world: int) -> fx.Node:
    """`fsdp_graph.ir.ops.rank_order` as nodes (view, permute, contiguous copy, view): the node group's gather of
    pieces in rank order. No rank-dependent constant: every rank emits the same nodes."""
    val = fake_value(node_major)

    def step(target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return emit(target, args, kwargs, val=INFER if val is not None else None)

    blocks = step(_aten.view.default, (node_major, [k, world // k, -1]))
    swapped = step(_aten.permute.default, (blocks, [1, 0, 2]))
    copied = step(_aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format})
    return step(_aten.view.default, (copied, [-1]))


def _lower_reduce(graph: fx.Graph, node: fx.Node) -> fx.Node:
    a = bind_args(node)
    emit = _Lowering(graph, node, a["unit"], ROLE_REDUCE)
    grad = emit.cast(a["full_grad"], a["dtype"])
    gval = grad.meta.get("val")
    accumulates = a["partial"] is not None or not a["all_reduce"]
    before, after_scatter, last = reduction_divisors(
        a["world"] * a["replicate_world"], a["divide_factor"], None if gval is None else gval.dtype, accumulates
    )
    if before > 1:
        grad = emit.op(_aten.div.Tensor, (grad, before), gval)
    shard_val = None if gval is None else gval.new_empty(gval.numel() // a["world"])
    if a["world"] > 1:
        grad = emit.op(REDUCE_SCATTER, (grad, "sum", a["world"], a["group"]), shard_val)
        grad = emit.op(WAIT, (grad,), shard_val)
    if after_scatter > 1:
        grad = emit.op(_aten.div.Tensor, (grad, after_scatter), shard_val)
    if a["partial"] is not None:  # set_requires_all_reduce: the partial sum accumulated since the last all-reduce
        grad = emit.op(
            _aten.add.Tensor, (grad, emit.cast(a["partial"], None if shard_val is None else shard_val.dtype)), shard_val
        )
    if not a["all_reduce"]:
        return emit.to_device(emit.cast(grad, a["out_dtype"]), a["out_device"])
    if a["replicate_world"] > 1:
        grad = emit.op(ALL_REDUCE, (grad, "sum", a["replicate_group"]), shard_val)
        grad = emit.op(WAIT, (grad,), shard_val)
    averaged = emit.op(_aten.div.Tensor, (grad, last), shard_val)
    return emit.to_device(emit.cast(averaged, a["out_dtype"]), a["out_device"])


def lower_fsdp_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """In place on a partitioned forward or backward graph.

    Matches: `fsdp.unshard` -> [`device_put` to compute_device] + [cast to dtype] + `all_gather_into_tensor` +
    `wait_tensor` (world 1: no gather; with `gathered`, a flat parameter kept from an earlier step, that input
    itself; with `post_forward_world` k > 1, a gather over `piece_group` (world / k ranks), one over
    `post_forward_group` (k ranks) and `emit_rank_order`); `fsdp.reduce_grad` -> [cast to dtype] + [div by `pre` if > 1] +
    [`reduce_scatter_tensor(sum)` + `wait_tensor` if world > 1] + [`all_reduce(sum)` + `wait_tensor` over the
    replicate group if replicate_world > 1] + div by `post` + [cast to out_dtype] + [`device_put` to out_device],
    with (pre, post) = `gradient_divide_factors(world * replicate_world)`, the eager op's own factors; a reduce
    dtype with fp32's range divides by `pre * post` after the reductions instead (by `pre` after the reduce-scatter
    when a partial sum is added or not all-reduced), as the eager op does (`reduction_divisors`). Every produced
    node carries `meta["fsdp_unit"]` and `meta["fsdp_role"]`.
    Guarantees: no fsdp op is left, the collectives are the ones Inductor's bucketing and overlap passes
    recognise, and the numerics equal the ops' eager implementations. No-op when nothing matches.
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in UNSHARD_TARGETS:
            replacement = _lower_unshard(graph, node)
        elif node.target in REDUCE_GRAD_TARGETS:
            replacement = _lower_reduce(graph, node)
        else:
            continue
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        changed = True
    return finish(gm, changed)
