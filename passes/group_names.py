"""Forward/backward-graph pass: the process groups that collectives name, renamed to the names given."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx


def _group_name_index(target: object) -> int | None:
    """The position of `target`'s `group_name` argument (functional collectives' schema), None where it has none."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for index, argument in enumerate(target._schema.arguments):
        if argument.name == "group_name":
            return index
    return None


def rename_groups(gm: fx.GraphModule, names: Mapping[str, str]) -> fx.GraphModule:
    """In place: every op's `group_name` argument (torch's functional collectives, `_c10d_functional.*`, and any
    op whose schema names its group so) that is a key of `names` becomes its value, in the graph and in every
    nested graph (higher-order-op bodies).

    Matches: the collectives AOT autograd traces out of DTensor code (tensor parallelism), which name this rank's
    group of a mesh dimension (c10d's name, which differs from rank to rank). Guarantees: the same ops in the same
    order on the same tensors; only the group argument changes, to a name that resolves to the same group on this
    rank (`names` maps each group to a rank-independent alias of it, `api.groups.dtensor_group_name`), so ranks of
    different groups compile the same code. No-op when nothing matches, or `names` maps every name to itself.
    """
    renames = {old: new for old, new in names.items() if old != new}
    if not renames:
        return gm
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            index = _group_name_index(node.target) if node.op == "call_function" else None
            if index is None:
                continue
            if "group_name" in node.kwargs:
                if node.kwargs["group_name"] in renames:
                    node.update_kwarg("group_name", renames[node.kwargs["group_name"]])
                    changed = True
            elif index < len(node.args) and isinstance(node.args[index], str) and node.args[index] in renames:
                node.update_arg(index, renames[node.args[index]])
                changed = True
        if changed:
            module.recompile()
    return gm
