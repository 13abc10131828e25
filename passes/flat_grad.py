"""Backward-graph pass: build each flat gradient with one `cat` instead of a sum of zero-padded slices.

Autograd differentiates `flat[off:off + n].view(shape)` (how every original parameter reads its unit's gathered flat
parameter) into a full-size zero tensor with the parameter's gradient in its slot: `slice_backward`, or after
Inductor's decompositions `slice_scatter` into `full(0)`. The flat gradient is then the sum of one such full-size
tensor per parameter: P full-size temporaries and P - 1 full-size additions per unit (P times the memory traffic,
and a large fused kernel for Inductor to generate). The slots are disjoint, so a concatenation of the pieces, with
zeros for the gaps (padding), is the same tensor.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.fx_nodes import bind_args, finish

_aten = torch.ops.aten


def _padded_slot(node: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(gradient, full size, start, end) when `node` places a 1-D gradient into zeros of a 1-D full size."""
    if node.op != "call_function":
        return None
    if node.target is _aten.slice_backward.default:
        a = bind_args(node)
        grad, sizes = a["grad_output"], a["input_sizes"]
    elif node.target is _aten.slice_scatter.default:
        a = bind_args(node)
        base, grad = a["self"], a["src"]
        if not (
            isinstance(base, fx.Node)
            and base.target is _aten.full.default
            and base.args[1] == 0
            and len(base.users) == 1
        ):
            return None
        sizes = base.args[0]
    else:
        return None
    dim, start, end, step = a["dim"], a["start"], a["end"], a["step"]
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() == 1 and dim == 0 and step == 1 and len(sizes) == 1):
        return None
    if not all(isinstance(x, int) for x in (sizes[0], start, end)):
        return None
    return grad, sizes[0], start, min(end, sizes[0])


def _add_tree(root: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(inner add nodes, leaves) of the tree of single-use `add.Tensor` nodes under `root`, or None if a leaf is
    not a zero-padded slot."""
    adds, leaves, stack = [], [], [root]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and node.target is _aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            if node is not root and len(node.users) != 1:
                return None
            adds.append(node)
            stack.extend(a for a in node.args if isinstance(a, fx.Node))
            if not all(isinstance(a, fx.Node) for a in node.args):
                return None
        elif _padded_slot(node) is not None and len(node.users) == 1:
            leaves.append(node)
        else:
            return None
    return adds, leaves


def cat_flat_grads(gm: fx.GraphModule) -> fx.GraphModule:
    """In place on a backward graph.

    Matches: a tree of `add.Tensor` nodes (each used once) whose leaves are 1-D gradients placed into zeros of one
    full size along dim 0 (`slice_backward`, or `slice_scatter` into `full(0)`), at least two leaves. Rewrites it
    to `cat([zeros(gap), piece, zeros(gap), piece, ...])`; pieces with the same slot (a parameter read twice) are
    added first. Guarantees: the same values (slots that overlap without being equal leave the tree untouched), no
    full-size temporaries but the result. No-op when nothing matches.
    """
    graph, changed = gm.graph, False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for root in reversed(list(order)):
        if root.op != "call_function" or root.target is not _aten.add.Tensor or not _alive(root):
            continue
        if any(u.op == "call_function" and u.target is _aten.add.Tensor and len(u.users) == 1 for u in root.users):
            continue  # not a root: its parent add will take the whole tree
        tree = _add_tree(root)
        if tree is None or len(tree[1]) < 2:
            continue
        adds, leaves = tree
        placed = [_padded_slot(leaf) for leaf in leaves]
        slots = {}
        for grad, _, start, end in placed:
            slots.setdefault((start, end), []).append(grad)
        sizes = {size for _, size, _, _ in placed}
        ordered = sorted(slots)
        if len(sizes) != 1 or any(a[1] > b[0] for a, b in zip(ordered, ordered[1:])):
            continue
        (size,) = sizes
        val = root.meta["val"]
        with graph.inserting_before(root):
            pieces, cursor = [], 0
            for start, end in ordered:
                if start > cursor:
                    pieces.append(_zeros(graph, val, start - cursor))
                total = slots[(start, end)][0]
                for other in slots[(start, end)][1:]:
                    total = graph.call_function(_aten.add.Tensor, (total, other))
                    total.meta["val"] = val.new_empty(end - start)
                pieces.append(total)
                cursor = end
            if cursor < size:
                pieces.append(_zeros(graph, val, size - cursor))
            cat = graph.call_function(_aten.cat.default, (pieces,))
        cat.meta.update(root.meta)
        root.replace_all_uses_with(cat)
        for node in sorted(adds + leaves, key=lambda n: -order[n]):  # users before what they use
            bases = [node.args[0]] if node.target is _aten.slice_scatter.default else []
            graph.erase_node(node)
            for base in bases:
                if not base.users:
                    graph.erase_node(base)
        changed = True
    return finish(gm, changed)


def _zeros(graph: fx.Graph, like: torch.Tensor, numel: int) -> fx.Node:
    node = graph.call_function(
        _aten.full.default,
        ([numel], 0),
        {"dtype": like.dtype, "layout": torch.strided, "device": like.device, "pin_memory": False},
    )
    node.meta["val"] = like.new_zeros(numel)
    return node


def _alive(node: fx.Node) -> bool:
    """False for a node an earlier rewrite erased (iteration runs over a snapshot of the graph)."""
    return not getattr(node, "_erased", False)
