"""Read-only check of a lowered graph: every collective is used only through its wait, its buffers are left alone
while it is in flight, it is waited for before the graph returns, and serial groups never run two at once."""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_graph.ir import COLLECTIVES, WAIT
from passes.fx_nodes import alias_source, collective_group, written_args

# Reads of a tensor's sizes, not its data: an all-to-all with data-dependent split sizes (expert parallelism's token
# dispatch) has an output of unbacked size, which the graph reads from the issue node itself.
_METADATA_READS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default)


def _storage_root(node: fx.Node, roots: dict[fx.Node, fx.Node]) -> fx.Node:
    return roots.get(node, node)


def check_collectives(gm: fx.GraphModule, serial_groups: frozenset[str] | set[str] = frozenset()) -> None:
    """Raises RuntimeError naming the node if a lowered graph breaks a collective's contract.

    Matches: `_c10d_functional` issue nodes (all_gather_into_tensor, reduce_scatter_tensor, all_reduce,
    all_to_all_single) and their `wait_tensor`. Guarantees, when it returns:
    - an issue's result is read only by `wait_tensor` (nothing reads a buffer that is still being filled), and by
      reads of its sizes (`sym_size`: an all-to-all's data-dependent output size);
    - between issue and wait no op writes (schema `(a!)`) to the storage of the collective's input or output,
      views included;
    - every issue is waited for before the graph's output (nothing is still in flight when the graph returns and
      its inputs may be freed or overwritten by the optimizer);
    - on each group in `serial_groups`, at most one collective is in flight at any point.
    Pure: the graph is not changed. A graph without collectives passes.
    """
    roots: dict[fx.Node, fx.Node] = {}
    in_flight: dict[fx.Node, set[fx.Node]] = {}  # issue -> storage roots it reads or writes
    flying_on_group: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            if in_flight:
                names = ", ".join(n.name for n in in_flight)
                raise RuntimeError(f"check_collectives: {names} still in flight when the graph returns (no wait)")
            continue
        if node.op != "call_function":
            continue
        if node.target is WAIT:
            issue = node.args[0]
            in_flight.pop(issue, None)
            group = collective_group(issue) if isinstance(issue, fx.Node) else None
            if group is not None and flying_on_group.get(group) is issue:
                del flying_on_group[group]
            roots[node] = _storage_root(issue, roots) if isinstance(issue, fx.Node) else node
            continue
        if node.target in COLLECTIVES:
            readers = [u for u in node.users if u.target is not WAIT and u.target not in _METADATA_READS]
            if readers:
                raise RuntimeError(
                    f"check_collectives: {readers[0].name} reads {node.name}'s result without waiting for it"
                )
            group = collective_group(node)
            if group in serial_groups and group in flying_on_group:
                raise RuntimeError(
                    f"check_collectives: {node.name} is issued on serial group {group!r} while "
                    f"{flying_on_group[group].name} is still in flight there"
                )
            if group in serial_groups:
                flying_on_group[group] = node
            source = node.args[0]
            buffers = {node}
            if isinstance(source, fx.Node):
                buffers.add(_storage_root(source, roots))
            in_flight[node] = buffers
            continue
        for written in written_args(node):
            root = _storage_root(written, roots)
            for issue, buffers in in_flight.items():
                if root in buffers:
                    raise RuntimeError(
                        f"check_collectives: {node.name} writes to a buffer of {issue.name} while it is in flight"
                    )
        source = alias_source(node)
        if source is not None:
            roots[node] = _storage_root(source, roots)
