"""Forward/backward-graph pass: reduce-scatters over process groups without a native one become all-to-alls.

gloo has no reduce-scatter: `reduce_scatter_tensor` runs as an all-reduce of the whole unsharded tensor (the
profiler shows `gloo:all_reduce`), which sends 2(N-1)/N of it per rank, twice what a reduce-scatter needs. An
all-to-all sends each rank exactly the chunk it will own ((N-1)/N), and each rank sums the N chunks it receives.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_graph.ir import ALL_TO_ALL, META_BUCKET, META_ROLE, META_UNIT, REDUCE_SCATTER, WAIT
from passes.fx_nodes import NodeEmitter, bind_args, fake_value, finish

_aten = torch.ops.aten


def reduce_scatter_as_all_to_all(gm: fx.GraphModule, groups: frozenset[str] | set[str]) -> fx.GraphModule:
    """In place on a lowered graph.

    Matches: `reduce_scatter_tensor(x, "sum", world, group)` whose `group` is in `groups` and whose only user is
    its `wait_tensor` (x: 1-D, numel divisible by world). Rewrites it to `all_to_all_single(x, [n/world] * world,
    [n/world] * world, group)` + `wait_tensor` + `view(world, n/world)` + `sum(0)`. Guarantees: the same values up
    to floating-point summation order (a reduce-scatter's order is the backend's anyway), the fsdp meta of the
    reduce-scatter on every new node, and the issue node still the first node of the reduction, so scheduling
    treats it like a reduce-scatter. No-op when nothing matches.
    """
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not REDUCE_SCATTER:
            continue
        a = bind_args(node)
        grad, op, world, group = a["input"], a["reduce_op"], a["group_size"], a["group_name"]
        waits = list(node.users)
        val = fake_value(grad)
        if group not in groups or op != "sum" or len(waits) != 1 or waits[0].target is not WAIT or val is None:
            continue
        numel = val.numel()
        if not isinstance(numel, int) or val.dim() != 1 or numel % world:
            continue
        chunk = numel // world
        emit = NodeEmitter(graph, {k: node.meta[k] for k in (META_UNIT, META_ROLE, META_BUCKET) if k in node.meta})
        wait = waits[0]
        issue = emit(ALL_TO_ALL, (grad, [chunk] * world, [chunk] * world, group), before=node, val=val)
        arrived = emit(WAIT, (issue,), before=wait, val=val)
        # a fresh value, not a view of `val`: torch's GraphPickler (AOT autograd's cache of eager-kernel graphs)
        # cannot pickle a fake view
        blocks = emit(_aten.view.default, (arrived, [world, chunk]), before=wait, val=val.new_empty(world, chunk))
        summed = emit(_aten.sum.dim_IntList, (blocks, [0]), before=wait, val=val.new_empty(chunk))
        wait.replace_all_uses_with(summed)
        graph.erase_node(wait)
        graph.erase_node(node)
        changed = True
    return finish(gm, changed)
