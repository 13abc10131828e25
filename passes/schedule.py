"""Forward/backward-graph pass: issue gathers early (prefetch) and wait for gradient reductions late.

Runs after lowering (and bucketing): a collective is an issue node (`all_gather_into_tensor`, `reduce_scatter_tensor`,
...) whose result is read through `wait_tensor`. Reordering FX nodes is the whole mechanism: the eager-kernel
backend runs nodes in graph order, and Inductor keeps the order of its collective kernels and waits (proved by the
executed-op-stream test), so a gather issued before unrelated compute overlaps with it.
"""

from __future__ import annotations

import itertools
import statistics

import torch
import torch.fx as fx

from fsdp_graph.ir import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVES,
    META_ALL_REDUCE_STEP,
    META_ROLE,
    REDUCE_SCATTER,
    ROLE_REDUCE,
    ROLE_UNSHARD,
    WAIT,
)
from passes.fx_nodes import alias_source, collective_group, finish, node_bytes

DEVICE_PUT = torch.ops.prims.device_put.default


def _live_spans(nodes: list[fx.Node], order: dict[fx.Node, int]) -> dict[fx.Node, tuple[int, int, int]]:
    """The unsharded buffers a graph holds (every new tensor a lowering of `unshard` made: gather outputs, bucket
    copies) -> (start, end, bytes): alive from the node that makes it to the last use of anything aliasing it."""
    spans = {}
    for buf in nodes:
        if (
            buf.op != "call_function"
            or buf.meta.get(META_ROLE) != ROLE_UNSHARD
            or alias_source(buf) is not None
            or not node_bytes(buf)
        ):
            continue
        last, stack = order[buf], [buf]
        while stack:
            current = stack.pop()
            for user in current.users:
                last = max(last, order[user])
                if alias_source(user) is current:
                    stack.append(user)
        spans[buf] = (order[buf], last, node_bytes(buf))
    return spans


def _issue_chain(issue: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """The gather and the nodes preparing its input (casts, device copies: `unshard`-role nodes feeding only it),
    in graph order."""
    chain, stack = [issue], [issue]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg.op == "call_function" and arg.meta.get(META_ROLE) == ROLE_UNSHARD and set(arg.users) <= set(chain):
                chain.append(arg)
                stack.append(arg)
    return sorted(chain, key=order.__getitem__)


def _move_before(nodes: list[fx.Node], anchor: fx.Node) -> None:
    for node in nodes:
        if node is not anchor:
            anchor.prepend(node)


def _same_group_neighbours(
    nodes: list[fx.Node], serial_groups: frozenset[str]
) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, fx.Node]]:
    """For every collective issue on a serial group: the one issued before it and the one after it on the same
    group, in the order of `nodes` (one sweep)."""
    previous: dict[fx.Node, fx.Node] = {}
    following: dict[fx.Node, fx.Node] = {}
    last: dict[str, fx.Node] = {}
    for node in nodes:
        group = collective_group(node)
        if group not in serial_groups:
            continue
        if group in last:
            previous[node], following[last[group]] = last[group], node
        last[group] = node
    return previous, following


def _wait_position(issue: fx.Node, order: dict[fx.Node, int]) -> int:
    return max((order[u] for u in issue.users if u.target is WAIT), default=order[issue])


def _serial_earliest(previous: fx.Node, previous_on_group: dict[fx.Node, fx.Node], order: dict[fx.Node, int]) -> int:
    """The first index a gather may be issued at on a serial group, given `previous`, the collective issued before it
    there: after `previous`'s wait. When `previous` is a gradient reduction with a collective before it on the group,
    the gather may instead move above the reduction, to halfway between that collective's wait and the reduction's
    issue: in a backward, unit k-1's re-gather then overlaps the second half of unit k's compute (it is waited before
    unit k's reduction is issued) and unit k's reduction the first half of unit k-1's, where otherwise the one channel
    would carry both, exposed, between the two units."""
    if previous.meta.get(META_ROLE) == ROLE_REDUCE and previous in previous_on_group:
        after_wait = _wait_position(previous_on_group[previous], order) + 1
        return max(after_wait, (after_wait + order[previous]) // 2)
    return _wait_position(previous, order) + 1


def _prefetch_gathers(graph: fx.Graph, max_inflight_bytes: int | None, serial_groups: frozenset[str]) -> bool:
    """Each gather moves up to just after the previous gather's issue (gather k+1 in flight while unit k computes;
    on a serial group no earlier than `_serial_earliest`), as long as the bytes of gathered buffers alive at its new position plus its
    own stay within the budget; else to the first later position where they do.

    Positions are the ORIGINAL node indices throughout: a chain moves in front of the node that held its target
    index, and the live-bytes curve is updated in place for the moved span, so the pass is linear in the graph."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    gathers = [n for n in nodes if n.target is ALL_GATHER and n.meta.get(META_ROLE) == ROLE_UNSHARD]
    if len(gathers) < 2:
        return False
    spans = _live_spans(nodes, order)
    delta = [0] * (len(nodes) + 1)
    for start, end, size in spans.values():
        delta[start] += size
        delta[end + 1] -= size
    live = list(itertools.accumulate(delta[:-1]))
    if max_inflight_bytes is None:
        # One typical unit more in flight than the graph holds without scheduling. The median, not the largest:
        # a big root (embedding + head) must not let every block's gather start at once.
        max_inflight_bytes = max(live, default=0) + statistics.median_low(node_bytes(g) for g in gathers)
    changed = False
    # Chains placed before the same anchor keep their order, so the floor is the previous gather's anchor if it
    # moved, else the index right after it.
    floor = order[gathers[0]] + 1
    # On a serial group a gather may not be issued before the previous collective there has been waited for.
    previous_on_group, _ = _same_group_neighbours(nodes, serial_groups)
    for gather in gathers[1:]:
        chain = _issue_chain(gather, order)
        first, own = order[chain[0]], node_bytes(gather)
        start, end, _ = spans.get(gather, (order[gather], order[gather], 0))
        for p in range(start, end + 1):  # the curve without this buffer
            live[p] -= own
        earliest = max(
            [floor]
            + (
                [_serial_earliest(previous_on_group[gather], previous_on_group, order)]
                if gather in previous_on_group
                else []
            )
            + [order[a] + 1 for n in chain for a in n.all_input_nodes if a not in chain]
        )
        # Issued at p, the buffer is alive over [p, its first use]: the busiest point of that range must fit.
        target, busiest = first, 0
        for position in range(order[gather], earliest - 1, -1):
            busiest = max(busiest, live[position])
            if busiest + own > max_inflight_bytes:
                break
            target = min(target, position)
        for p in range(target, end + 1):
            live[p] += own
        if target < first:
            _move_before(chain, nodes[target])
            changed = True
        floor = target if target < first else order[gather] + 1
    return changed


def _wait_chain(wait: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The wait and everything downstream of it made by the same reduction (all-reduce, scale, casts, copies),
    when those feed only the graph's output; None if something else reads them (then the wait stays)."""
    chain, stack = [wait], [wait]
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user in chain:
                continue
            if user.meta.get(META_ROLE) != ROLE_REDUCE:
                return None
            chain.append(user)
            stack.append(user)
    return sorted(chain, key=order.__getitem__)


def _sink_waits(graph: fx.Graph, kinds: set[tuple], serial_groups: frozenset[str]) -> bool:
    """Each reduction collective of `kinds` ((target, its `fsdp_all_reduce_step` meta or None) pairs) has its wait
    (and the reduction's tail after it) moved down to just before the next such collective is issued; the last one
    waits just before the output. On a serial group the wait stops before the next collective of any kind on that
    group, not counting those in the tail itself (a compressed all-reduce's all-gather moves with it)."""
    issues = [
        n
        for n in graph.nodes
        if n.meta.get(META_ROLE) == ROLE_REDUCE and (n.target, n.meta.get(META_ALL_REDUCE_STEP)) in kinds
    ]
    output = next(n for n in graph.nodes if n.op == "output")
    order = {n: k for k, n in enumerate(graph.nodes)}  # original order: chains only move down, anchors stay
    _, next_on_group = _same_group_neighbours(list(graph.nodes), serial_groups)
    changed = False
    for i, issue in enumerate(issues):
        waits = [u for u in issue.users if u.target is WAIT]
        if len(waits) != 1:
            continue
        chain = _wait_chain(waits[0], order)
        if chain is None:
            continue
        anchor = issues[i + 1] if i + 1 < len(issues) else output
        following = next_on_group.get(issue)
        while following in chain:
            following = next_on_group.get(following)
        if following is not None and order[following] < order[anchor]:
            anchor = following
        if order[anchor] > order[chain[-1]]:
            # The next issue's input preparation (casts) stays before the anchor; we go right before the issue.
            _move_before(chain, anchor)
            changed = True
    return changed


def _sink_reduce_waits(graph: fx.Graph, serial_groups: frozenset[str]) -> bool:
    """Three sweeps of `_sink_waits`. First each reduce-scatter's wait, with everything after it (a replica
    all-reduce's issue included), sinks to the next reduce-scatter's issue, so one reduction is in flight while the
    next unit's backward computes: at most two full-size gradients are held by reductions at any time. Then each
    gradient all-reduce's wait (NO_SHARD's, HYBRID's replica one) sinks to the next all-reduce's issue: HYBRID's
    replica all-reduce of unit k then runs while unit k-1's reduce-scatter waits and unit k-2 computes, NO_SHARD's
    while unit k-1 computes; each holds one reduced shard (HYBRID) or one gradient (NO_SHARD) more.
    A compressed all-reduce (`passes.compress`: an all-to-all, then an all-gather) is an all-reduce in the second
    sweep through its all-to-all (the all-gather moves with its wait); a third sweep sinks each such all-gather's wait
    to the next one's issue (on a serial group: to the next collective there, the following all-to-all)."""
    changed = _sink_waits(graph, {(REDUCE_SCATTER, None), (ALL_TO_ALL, None)}, serial_groups)
    changed |= _sink_waits(graph, {(ALL_REDUCE, None), (ALL_TO_ALL, 1)}, serial_groups)
    return _sink_waits(graph, {(ALL_GATHER, 2)}, serial_groups) | changed


def _copy_out_after_last_reduction(graph: fx.Graph) -> bool:
    """The reduction's copies to `out_device` (CPU offload's device-to-host copies of reduced gradients) that feed
    only the output move to just after the last reduction collective's issue (none, world 1: to the end), in their
    order. Inductor follows a copy into pinned memory with `event.record(); event.synchronize()`: once per unit
    mid-backward, each such stall drained the device's queue while the host had the rest of the backward still to
    enqueue. Grouped, they stall the host once while the last reduction is in flight (and once more at the end for
    the copies after it), at the cost of holding every earlier unit's reduced shard on the device until then."""
    nodes = list(graph.nodes)
    last_issue = max(
        (k for k, n in enumerate(nodes) if n.target in COLLECTIVES and n.meta.get(META_ROLE) == ROLE_REDUCE),
        default=len(nodes) - 2,  # no reduction: the node before the output
    )
    copies = [
        n
        for n in nodes[: last_issue + 1]
        if n.target is DEVICE_PUT
        and n.meta.get(META_ROLE) == ROLE_REDUCE
        and all(user.op == "output" for user in n.users)
    ]
    moved = [n for n in nodes[: last_issue + 1] if n not in copies] + copies
    if not copies or moved == nodes[: last_issue + 1]:
        return False
    _move_before(copies, nodes[last_issue + 1])
    return True


def _serialize_groups(graph: fx.Graph, serial_groups: frozenset[str]) -> bool:
    """On each serial group, a collective issued while another one is in flight gets the earlier one's wait moved
    up to just before it (always legal: a wait reads only its issue). Afterwards at most one collective per serial
    group is in flight at any point of the graph."""
    if not serial_groups:
        return False
    changed = False
    in_flight: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is WAIT:
            issue = node.args[0]
            group = collective_group(issue) if isinstance(issue, fx.Node) else None
            if group is not None and in_flight.get(group) is issue:
                del in_flight[group]
            continue
        group = collective_group(node)
        if group not in serial_groups:
            continue
        earlier = in_flight.pop(group, None)
        if earlier is not None:
            for wait in [u for u in earlier.users if u.target is WAIT]:
                node.prepend(wait)
            changed = True
        in_flight[group] = node
    return changed


def schedule_collectives(
    gm: fx.GraphModule,
    prefetch: bool = True,
    max_inflight_bytes: int | None = None,
    serial_groups: frozenset[str] | set[str] = frozenset(),
) -> fx.GraphModule:
    """In place on a lowered forward or backward graph.

    Matches: `all_gather_into_tensor` nodes of role "unshard" (`fsdp_role` meta) and `reduce_scatter_tensor` (or
    its `all_to_all_single` form) and `all_reduce` nodes of role "reduce_grad" with their `wait_tensor`. With
    `prefetch`:
    - every gather after the first is issued right after the previous gather's issue (gather k+1 in flight while
      unit k computes), unless the bytes of gathered buffers alive there plus its own would exceed
      `max_inflight_bytes` (None: the unscheduled graph's peak plus its median gather, i.e. one typical unit more
      in flight than without scheduling); then at the first later point where they fit;
    - every reduce-scatter's wait, with the scale/cast/copy nodes after it, moves to just before the next
      reduce-scatter's issue (the last one: before the output);
    - then every gradient all-reduce's wait (NO_SHARD; HYBRID's replica all-reduce, issued where its
      reduce-scatter was waited), with the nodes after it, moves to just before the next all-reduce's issue (a
      compressed all-reduce counts by its all-to-all, `fsdp_all_reduce_step` 1; then its all-gather's wait, step 2,
      moves to just before the next such all-gather);
    - the reductions' copies to their out_device (CPU offload's device-to-host copies) move to just after the last
      reduction's issue: Inductor syncs the host after each copy into pinned memory.
    `serial_groups` are process groups that must never run two collectives at once (gloo: torch's
    ProcessGroupGloo corrupts its heap when two collectives finish together on its two worker threads; see
    docs/design-notes.md). On them a gather is prefetched no earlier than the previous collective's wait (or, when
    that collective is a gradient reduction, no earlier than halfway through the compute before the reduction: it
    moves above it, `_serial_earliest`), a reduce wait sinks no further than the next collective's issue, and any
    remaining overlap is removed by moving the earlier collective's wait up, even with `prefetch` off.
    Guarantees: only node order changes (same nodes, same values); the issue order of collectives is unchanged
    except that on a serial group a gather may move above a reduction (the same graph on every rank: every rank
    still issues the same sequence); at most one collective in flight per serial group; the graph stays
    topologically valid. No-op when nothing matches.
    """
    serial = frozenset(serial_groups)
    changed = False
    if prefetch:
        changed |= _prefetch_gathers(gm.graph, max_inflight_bytes, serial)
        changed |= _sink_reduce_waits(gm.graph, serial)
        changed |= _copy_out_after_last_reduction(gm.graph)
    changed |= _serialize_groups(gm.graph, serial)
    return finish(gm, changed)
