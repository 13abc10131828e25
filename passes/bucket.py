"""Forward/backward-graph pass: merge consecutive small units' collectives into one collective per bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fsdp_graph.ir import (
    ALL_GATHER,
    ALL_REDUCE,
    META_BUCKET,
    META_ROLE,
    META_UNIT,
    REDUCE_SCATTER,
    ROLE_REDUCE,
    ROLE_UNSHARD,
    WAIT,
)
from passes.fx_nodes import NodeEmitter, bind_args, fake_value, finish

_aten, _prims = torch.ops.aten, torch.ops.prims

# What the lowering may put between a placeholder shard and its gather; only these are hoisted.
_SHARD_CASTS = (_prims.convert_element_type.default, _prims.device_put.default)


@dataclass
class _Collective:
    """One lowered collective and its wait. `numel` is the shard's element count (the gather's input, the
    reduce-scatter's output); `nbytes` the unsharded side's bytes; `key` what must match to share a bucket."""

    start: fx.Node
    wait: fx.Node
    unit: str
    key: tuple
    numel: int
    nbytes: int
    args: dict[str, Any]  # the issue node's arguments by name

    @property
    def source(self) -> fx.Node:
        return self.args["input"]


def _static_1d(node: Any) -> torch.Tensor | None:
    val = fake_value(node)
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or not isinstance(val.numel(), int):
        return None  # unknown or symbolic size: this collective is left alone
    return val


def _match(node: fx.Node, target, role: str) -> _Collective | None:
    """The collective at `node` if it is a lowering's `target` with a static 1-D input and a single wait."""
    if node.op != "call_function" or node.target is not target or node.meta.get(META_ROLE) != role:
        return None
    users, a = list(node.users), bind_args(node)
    val = _static_1d(a["input"])
    if val is None or len(users) != 1 or users[0].target is not WAIT:
        return None
    world, group = a["group_size"], a["group_name"]
    if target is ALL_GATHER:
        numel, key = val.numel(), ("all_gather", group, world)
        nbytes = world * numel * val.element_size()
    else:
        if val.numel() % world:
            return None
        numel, key = val.numel() // world, ("reduce_scatter", a["reduce_op"], group, world)
        nbytes = val.numel() * val.element_size()
    key += (val.dtype, val.device)
    return _Collective(node, users[0], node.meta.get(META_UNIT, "?"), key, numel, nbytes, a)


def _runs(graph: fx.Graph, target, role: str, cap: int, can_join) -> list[list[_Collective]]:
    """Greedy maximal runs of consecutive (in graph order) matching collectives with one key and at most `cap`
    bytes in all. A collective that does not match ends the run. Only runs of two or more are returned."""
    runs: list[list[_Collective]] = [[]]
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not target or node.meta.get(META_ROLE) != role:
            continue
        c, run = _match(node, target, role), runs[-1]
        fits = run and c is not None and c.key == run[0].key and sum(r.nbytes for r in run) + c.nbytes <= cap
        if fits and can_join(run, c):
            run.append(c)
        else:
            runs.append([c] if c is not None else [])
    return [run for run in runs if len(run) > 1]


def _bucket_emitter(graph: fx.Graph, run: list[_Collective], role: str) -> NodeEmitter:
    """Creates nodes carrying the bucket's meta (its units joined by "+", and their tuple)."""
    units = tuple(c.unit for c in run)
    return NodeEmitter(graph, {META_UNIT: "+".join(units), META_ROLE: role, META_BUCKET: units})


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for node in nodes:
        graph.erase_node(node)


def _hoistable(positions: dict[fx.Node, int], anchor: fx.Node, c: _Collective) -> list[fx.Node] | None:
    """The cast chain of `c`'s shard lying after `anchor` (to move before it), or None if anything else does."""
    chain, node = [], c.source
    while positions[node] > positions[anchor]:
        if node.op != "call_function" or node.target not in _SHARD_CASTS or node.meta.get(META_ROLE) != ROLE_UNSHARD:
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _bucket_gathers(graph: fx.Graph, cap: int) -> int:
    positions = {n: i for i, n in enumerate(graph.nodes)}
    chains: dict[fx.Node, list[fx.Node]] = {}

    def can_join(run: list[_Collective], c: _Collective) -> bool:
        chain = _hoistable(positions, run[0].start, c)
        if chain is not None:
            chains[c.start] = chain
        return chain is not None

    runs = _runs(graph, ALL_GATHER, ROLE_UNSHARD, cap, can_join)
    for run in runs:
        first, emit = run[0], _bucket_emitter(graph, run, ROLE_UNSHARD)
        for c in run[1:]:
            for node in chains[c.start]:
                first.start.prepend(node)
        world, group = first.args["group_size"], first.args["group_name"]
        total = sum(c.numel for c in run)
        flat = emit(_aten.cat.default, ([c.source for c in run],), before=first.start)
        gathered_val = flat.meta["val"].new_empty(world * total)
        gathered = emit(ALL_GATHER, (flat, world, group), before=first.start, val=gathered_val)
        wait = emit(WAIT, (gathered,), val=gathered_val, before=first.wait)
        # Rank-major: row r is rank r's [shard 1 | shard 2 | ...]; a unit's full flat param is its column block.
        rows = emit(_aten.view.default, (wait, [world, total]), before=first.wait)
        offset = 0
        for c in run:
            block = emit(_aten.slice.Tensor, (rows, 1, offset, offset + c.numel), before=first.wait)
            dense = emit(_aten.clone.default, (block,), {"memory_format": torch.contiguous_format}, before=first.wait)
            c.wait.replace_all_uses_with(emit(_aten.view.default, (dense, [world * c.numel]), before=first.wait))
            offset += c.numel
        _erase(graph, [n for c in run for n in (c.wait, c.start)])
    return len(runs)


def _replica_all_reduce(c: _Collective) -> tuple[fx.Node, fx.Node, tuple] | None:
    """HSDP: (all_reduce, its wait, (op, group)) if the scatter's wait feeds exactly one all_reduce + wait."""
    users = list(c.wait.users)
    if len(users) != 1 or users[0].target is not ALL_REDUCE or users[0].meta.get(META_ROLE) != ROLE_REDUCE:
        return None
    reduce, waits = users[0], list(users[0].users)
    if len(waits) != 1 or waits[0].target is not WAIT:
        return None
    a = bind_args(reduce)
    return reduce, waits[0], (a["reduce_op"], a["group_name"])


def _sink_dependents(graph: fx.Graph, produced: set[fx.Node], tail: fx.Node) -> None:
    """Move every node before `tail` that depends on `produced` to just after `tail`, in order. Such nodes are
    the earlier units' gradient epilogues (division, casts, copies), which only feed the graph's output."""
    tainted, moving = set(produced), []
    for node in graph.nodes:
        if node is tail:
            break
        if node not in produced and any(i in tainted for i in node.all_input_nodes):
            tainted.add(node)
            moving.append(node)
    cursor = tail
    for node in moving:
        cursor.append(node)
        cursor = node


def _feeds(starts: list[fx.Node], target: fx.Node) -> bool:
    """Whether `target` depends on any of `starts`."""
    seen, stack = set(starts), list(starts)
    while stack:
        node = stack.pop()
        if node is target:
            return True
        fresh = [u for u in node.users if u not in seen]
        seen.update(fresh)
        stack.extend(fresh)
    return False


def _bucket_reduce_scatters(graph: fx.Graph, cap: int) -> int:
    # A gradient computed from an earlier member's reduced shard cannot wait for a reduction that needs it.
    runs = _runs(graph, REDUCE_SCATTER, ROLE_REDUCE, cap, lambda run, c: not _feeds([r.wait for r in run], c.source))
    for run in runs:
        last, emit = run[-1], _bucket_emitter(graph, run, ROLE_REDUCE)
        op, world, group = last.args["reduce_op"], last.args["group_size"], last.args["group_name"]
        total = sum(c.numel for c in run)
        # Row r of (world, total) is what rank r receives: every unit's r-th chunk, side by side.
        rows = [emit(_aten.view.default, (c.source, [world, c.numel]), before=last.start) for c in run]
        flat = emit(
            _aten.view.default,
            (emit(_aten.cat.default, (rows, 1), before=last.start), [world * total]),
            before=last.start,
        )
        shard_val = flat.meta["val"].new_empty(total)
        scattered = emit(REDUCE_SCATTER, (flat, op, world, group), val=shard_val, before=last.start)
        reduced = emit(WAIT, (scattered,), val=shard_val, before=last.wait)
        old = [n for c in run for n in (c.wait, c.start)]
        replicas = [_replica_all_reduce(c) for c in run]
        if all(r is not None for r in replicas) and len({r[2] for r in replicas}) == 1:
            # HSDP: the replica all-reduce of the bucket's shard is one collective too.
            all_reduce = emit(ALL_REDUCE, (reduced, *replicas[0][2]), val=shard_val, before=last.wait)
            reduced = emit(WAIT, (all_reduce,), val=shard_val, before=last.wait)
            ends = [r[1] for r in replicas]
            old = [n for r in replicas for n in (r[1], r[0])] + old
        else:
            ends = [c.wait for c in run]
        offset, pieces = 0, []
        for c, end in zip(run, ends):
            pieces.append(emit(_aten.slice.Tensor, (reduced, 0, offset, offset + c.numel), before=last.wait))
            end.replace_all_uses_with(pieces[-1])
            offset += c.numel
        _erase(graph, old)
        _sink_dependents(graph, set(pieces), pieces[-1])
    return len(runs)


def bucket_collectives(gm: fx.GraphModule, bucket_bytes: int) -> fx.GraphModule:
    """In place on a lowered forward or backward graph (after `passes.lower`, before `passes.schedule`).

    Matches the lowering's collectives (`meta["fsdp_role"]`): each `all_gather_into_tensor` ("unshard") and each
    `reduce_scatter_tensor` ("reduce_grad") whose flat input has a static size and whose only user is its
    `wait_tensor`. Consecutive ones in graph order (per kind) with the same group, world size, dtype, device (and
    reduce op) form a bucket while their unsharded bytes (gather output, scatter input) total <= `bucket_bytes`;
    a collective that does not match (symbolic size, other group) ends a bucket.
    - Gathers merge at the first one: the later shards' casts/copies are hoisted there (a shard is a graph input,
      so nothing else needs moving); `cat` of the shards -> one gather -> one wait -> `view(world, S)` -> per unit
      a column block copied out contiguous (rank-major layout: the gather is [rank 0: s1|s2|.., rank 1: ..]).
    - Reduce-scatters merge at the last one: per unit `view(world, s_i)`, `cat(dim=1)`, flatten -> one
      reduce-scatter -> one wait -> per unit a slice of the shard. The earlier units' epilogues (division, casts,
      copies) move after it. HSDP: when every unit's wait feeds one replica all-reduce over the same group, those
      merge into one all-reduce of the bucket's shard.
    Guarantees: values equal the unbucketed graph's (a re-layout only); fewer collectives of the same total
    bytes; every node it creates has `meta["val"]`, `fsdp_role`, `fsdp_unit` (the units joined by "+") and
    `fsdp_bucket` (the tuple of unit names); the graph lints. No-op when `bucket_bytes <= 0` or no two
    consecutive collectives fit in one bucket.
    """
    if bucket_bytes <= 0:
        return gm
    changed = _bucket_gathers(gm.graph, bucket_bytes) + _bucket_reduce_scatters(gm.graph, bucket_bytes)
    return finish(gm, bool(changed))
