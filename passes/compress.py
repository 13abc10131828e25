"""Forward/backward-graph pass: quantized weight gathers and gradient reductions (ZeRO++'s qwZ and qgZ).

Runs after lowering and bucketing, before `passes.all_to_all` and scheduling. Weights: each rank's shard is packed
(`passes.quantize`: codes and block scales in one uint8 buffer), the packed rows are all-gathered and every rank
restores the full flat parameter in the gather's dtype. Gradients: the reduce-scatter's input, one row per receiving
rank, is packed once and sent by an all-to-all; each rank restores the rows it receives and sums them in float32.
A gradient all-reduce over replicas (HYBRID_SHARD's replica step, NO_SHARD's) becomes the same all-to-all, a sum of
this rank's row piece, the summed piece packed again and all-gathered (ZeRO++'s qgZ across nodes).
The master shard, the optimizer and every dtype outside the collective are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from fsdp_graph.ir import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    META_ALL_REDUCE_STEP,
    META_BUCKET,
    META_COMPRESSED,
    META_ROLE,
    META_UNIT,
    REDUCE_SCATTER,
    ROLE_REDUCE,
    ROLE_UNSHARD,
    WAIT,
)
from passes.fx_nodes import NodeEmitter, bind_args, fake_value, finish, node_bytes
from passes.quantize import (
    check_scheme,
    pack_rows,
    pack_segments,
    packed_bytes,
    segmented_bytes,
    unpack_rows,
    unpack_segments,
)
from passes.weight_rows import row_segments

_aten, _prims = torch.ops.aten, torch.ops.prims


def _selected(node: fx.Node, units: frozenset[str] | None) -> bool:
    """Whether every unit a collective serves (a bucket's members, or its own unit) is in `units` (None: all)."""
    if units is None:
        return True
    members = node.meta.get(META_BUCKET) or (node.meta.get(META_UNIT),)
    return all(m in units for m in members)


def _static_float_1d(arg) -> torch.Tensor | None:
    val = fake_value(arg)
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or not val.is_floating_point():
        return None
    return val if isinstance(val.numel(), int) else None


def _single_wait(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is WAIT else None


def _emitter(graph: fx.Graph, node: fx.Node, scheme: str, original_bytes: int) -> NodeEmitter:
    meta = {k: node.meta[k] for k in (META_UNIT, META_ROLE, META_BUCKET) if k in node.meta}
    return NodeEmitter(graph, meta | {META_COMPRESSED: (scheme, original_bytes)})


def _emit_call(emit: NodeEmitter, before: fx.Node):
    def call(target, *args, **kwargs):
        return emit(target, args, kwargs, before=before)

    return call


def _compress_gather(
    graph: fx.Graph, node: fx.Node, scheme: str, block_size: int, rows: int, per_row_ok: bool
) -> bool:
    a, wait = bind_args(node), _single_wait(node)
    val = _static_float_1d(a["input"])
    if val is None or wait is None or val.numel() % rows:
        return False
    n, world, group = val.numel() // rows, a["group_size"], a["group_name"]
    # fp8: one scale per row of each parameter where the graph's copy-out shows the rows (passes.weight_rows).
    per_row = row_segments(wait, world, n, block_size) if scheme == "fp8" and per_row_ok else None
    segments = per_row or ((n, block_size),)
    emit = _emitter(graph, node, f"{scheme} per row" if per_row else scheme, node_bytes(node))
    before = _emit_call(emit, node)
    row = before(_aten.view.default, a["input"], [rows, n])
    packed = before(_aten.view.default, pack_segments(row, rows, segments, scheme, before), [-1])
    size = segmented_bytes(segments, scheme)
    gathered_val = packed.meta["val"].new_empty(world * rows * size)
    gathered = emit(ALL_GATHER, (packed, world, group), before=node, val=gathered_val)
    arrived = emit(WAIT, (gathered,), before=wait, val=gathered_val)
    after = _emit_call(emit, wait)
    received = after(_aten.view.default, arrived, [world * rows, size])
    restored = unpack_segments(received, world * rows, segments, val.dtype, scheme, after)
    full = after(_aten.view.default, restored, [world * rows * n])
    wait.replace_all_uses_with(full)
    graph.erase_node(wait)
    graph.erase_node(node)
    return True


def _compress_reduce_scatter(graph: fx.Graph, node: fx.Node, scheme: str, block_size: int) -> bool:
    a, wait = bind_args(node), _single_wait(node)
    val = _static_float_1d(a["input"])
    world = a["group_size"]
    if val is None or wait is None or a["reduce_op"] != "sum" or val.numel() % world:
        return False
    chunk, group = val.numel() // world, a["group_name"]
    emit = _emitter(graph, node, scheme, node_bytes(a["input"]))
    before = _emit_call(emit, node)
    rows = before(_aten.view.default, a["input"], [world, chunk])
    packed = before(_aten.view.default, pack_rows(rows, world, chunk, scheme, block_size, before), [-1])
    size = packed_bytes(chunk, scheme, block_size)
    sent_val = packed.meta["val"]
    issue = emit(ALL_TO_ALL, (packed, [size] * world, [size] * world, group), before=node, val=sent_val)
    arrived = emit(WAIT, (issue,), before=wait, val=sent_val)
    after = _emit_call(emit, wait)
    received = after(_aten.view.default, arrived, [world, size])
    restored = unpack_rows(received, world, chunk, torch.float32, scheme, block_size, after)
    summed = after(_aten.sum.dim_IntList, restored, [0])
    if val.dtype != torch.float32:
        summed = after(_prims.convert_element_type.default, summed, val.dtype)
    wait.replace_all_uses_with(summed)
    graph.erase_node(wait)
    graph.erase_node(node)
    return True


def _compress_all_reduce(graph: fx.Graph, node: fx.Node, scheme: str, block_size: int, replicas: int) -> bool:
    a, wait = bind_args(node), _single_wait(node)
    val = _static_float_1d(a["input"])
    if val is None or wait is None or a["reduce_op"] != "sum":
        return False
    n, group = val.numel(), a["group_name"]
    chunk = -(-n // replicas)  # row j (the piece replica j sums) holds elements [j * chunk, (j + 1) * chunk)
    emit = _emitter(graph, node, scheme, node_bytes(a["input"]))
    before = _emit_call(emit, node)
    flat = a["input"]
    if chunk * replicas != n:
        flat = before(_aten.constant_pad_nd.default, flat, [0, chunk * replicas - n], 0.0)
    rows = before(_aten.view.default, flat, [replicas, chunk])
    packed = before(_aten.view.default, pack_rows(rows, replicas, chunk, scheme, block_size, before), [-1])
    size = packed_bytes(chunk, scheme, block_size)
    sent_val = packed.meta["val"]
    issue = emit(ALL_TO_ALL, (packed, [size] * replicas, [size] * replicas, group), before=node, val=sent_val)
    issue.meta[META_ALL_REDUCE_STEP] = 1
    arrived = emit(WAIT, (issue,), before=wait, val=sent_val)
    after = _emit_call(emit, wait)
    received = after(_aten.view.default, arrived, [replicas, size])
    summed = after(
        _aten.sum.dim_IntList, unpack_rows(received, replicas, chunk, torch.float32, scheme, block_size, after), [0]
    )
    piece_row = after(_aten.view.default, summed, [1, chunk])
    piece = after(_aten.view.default, pack_rows(piece_row, 1, chunk, scheme, block_size, after), [-1])
    gathered_val = sent_val.new_empty(replicas * size)
    gathered = emit(ALL_GATHER, (piece, replicas, group), before=wait, val=gathered_val)
    gathered.meta[META_ALL_REDUCE_STEP] = 2
    pieces = after(_aten.view.default, emit(WAIT, (gathered,), before=wait, val=gathered_val), [replicas, size])
    restored = unpack_rows(pieces, replicas, chunk, val.dtype, scheme, block_size, after)
    full = after(_aten.view.default, restored, [replicas * chunk])
    if chunk * replicas != n:
        full = after(
            _aten.clone.default, after(_aten.slice.Tensor, full, 0, 0, n), memory_format=torch.contiguous_format
        )
    wait.replace_all_uses_with(full)
    graph.erase_node(wait)
    graph.erase_node(node)
    return True


def compress_collectives(
    gm: fx.GraphModule,
    weights: str | None = None,
    grads: str | None = None,
    block_size: int = 256,
    units: frozenset[str] | None = None,
    replica_sizes: Mapping[str, int] | None = None,
    piece_rows: Mapping[str, int] | None = None,
) -> fx.GraphModule:
    """In place on a lowered (and bucketed) forward or backward graph.

    Matches, for collectives whose units (`fsdp_unit`, or every member of a bucket) are all in `units` (None: every
    unit), with a static 1-D floating input and a single `wait_tensor`:
    - with `weights` (a `passes.quantize` scheme): `all_gather_into_tensor` of role "unshard" (forward gathers and
      FULL_SHARD's backward re-gathers) -> `pack_rows` of the shard as one row + a gather of the uint8 rows + wait +
      `unpack_rows` of the `world` rows to the gather's dtype, flattened. "fp8" takes one scale per row of each
      parameter the graph reads back in rows (`passes.weight_rows`: the rows layout), blocks elsewhere and in every
      graph with a `reshard_after_forward=k` gather (the piece and node gathers must cut the shard alike). On a
      group named in `piece_rows`
      ({group: P}: `reshard_after_forward=k`'s node groups, whose input is a piece of P = world / k shards) the
      input is packed as P rows, one per shard, so its blocks are the ones the piece gather quantized: their
      codes come back unchanged and so, as measured, do their scales (docs/design-notes.md), so the weights are
      in effect quantized once;
    - with `grads`: `reduce_scatter_tensor(sum)` of role "reduce_grad" -> `pack_rows` of the input as `world` rows
      + `all_to_all_single` of the packed rows + wait + `unpack_rows` to float32 + sum over the ranks + cast back to
      the input's dtype (the reduce dtype);
    - with `grads`: `all_reduce(sum)` of role "reduce_grad" over a group of R ranks named in `replica_sizes`
      ({group name: R}; HYBRID_SHARD's replica all-reduce, NO_SHARD's) -> [zero pad to a multiple of R] + the
      input viewed as R rows, each packed + `all_to_all_single` + wait + `unpack_rows` to float32 + sum over the
      replicas (this rank's row, summed) + the sum packed as one row + `all_gather_into_tensor` of the R packed
      pieces + wait + `unpack_rows` to the input's dtype, flattened [and cut to its length]. Two roundings: each
      replica's contribution, then the sum. The all-to-all and the all-gather carry `meta["fsdp_all_reduce_step"]`
      1 and 2. An all-reduce on a group not in `replica_sizes` is left alone.
    Every new node carries the replaced collective's fsdp meta and `meta["fsdp_compressed"] = (scheme, bytes the
    uncompressed collective moved)` (an all-reduce: on both of its collectives, which together send what its ring
    would), the scheme "fp8 per row" where fp8 found rows.
    Guarantees: the values equal the eager `passes.quantize` functions applied per rank (the same ops); collectives
    keep their order and groups; the issue node stays the first node of its reduction. No-op without a scheme.
    """
    for scheme in (weights, grads):
        if scheme is not None:
            check_scheme(scheme, block_size)
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or not _selected(node, units):
            continue
        role = node.meta.get(META_ROLE)
        if weights is not None and node.target is ALL_GATHER and role == ROLE_UNSHARD:
            rows = (piece_rows or {}).get(bind_args(node)["group_name"], 1)
            changed |= _compress_gather(graph, node, weights, block_size, rows, not piece_rows)
        elif grads is not None and node.target is REDUCE_SCATTER and role == ROLE_REDUCE:
            changed |= _compress_reduce_scatter(graph, node, grads, block_size)
        elif grads is not None and node.target is ALL_REDUCE and role == ROLE_REDUCE:
            replicas = (replica_sizes or {}).get(bind_args(node)["group_name"], 1)
            if replicas > 1:
                changed |= _compress_all_reduce(graph, node, grads, block_size, replicas)
    return finish(gm, changed)
