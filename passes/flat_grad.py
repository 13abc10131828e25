"""Backward-graph pass: build each flat gradient with one `cat` instead of a sum of zero-padded slices.

Autograd differentiates `flat[off:off + n].view(shape)` (how every original parameter reads its unit's gathered flat
parameter) into a full-size zero tensor with the parameter's gradient in its slot: `slice_backward`, or after
Inductor's decompositions `slice_scatter` into `full(0)`. The flat gradient is then the sum of one such full-size
tensor per parameter: P full-size temporaries and P - 1 full-size additions per unit (P times the memory traffic,
and a large fused kernel for Inductor to generate). The slots are disjoint, so a concatenation of the pieces, with
zeros for the gaps (padding), is the same tensor. The rows layout reads a parameter as a column range of the
gathered flat viewed `(world, shard)`, so its pieces are placed along dim 1 of that matrix, and concatenated there.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.fx as fx

from passes.fx_nodes import bind_args, finish

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)


class _Placed(NamedTuple):
    """A gradient piece placed into zeros: `grad` fills columns `[start, end)` of `size` (1-D; or, rows layout, of
    each of `rows` rows of a `(rows, size)` matrix viewed as 1-D, then `inner` is that matrix's node)."""

    grad: fx.Node
    size: int
    start: int
    end: int
    rows: int | None = None
    inner: fx.Node | None = None


def _scatter(node: fx.Node) -> tuple[fx.Node, list, int, int, int, int] | None:
    """(gradient, full sizes, dim, start, end, step) when `node` places a gradient into zeros (either form)."""
    if node.op != "call_function":
        return None
    if node.target is _aten.slice_backward.default:
        a = bind_args(node)
        grad, sizes = a["grad_output"], a["input_sizes"]
    elif node.target is _aten.slice_scatter.default:
        a = bind_args(node)
        base, grad = a["self"], a["src"]
        # The zeros may be shared: Inductor's CSE gives every same-sized `full(0)` one node (every block of a
        # transformer), and `slice_scatter` does not write its base. The base goes when its last user does.
        if not (isinstance(base, fx.Node) and base.target is _aten.full.default and base.args[1] == 0):
            return None
        sizes = base.args[0]
    else:
        return None
    return grad, list(sizes), a["dim"], a["start"], a["end"], a["step"]


def _padded_slot(node: fx.Node) -> _Placed | None:
    """The placed piece `node` is: a 1-D gradient in zeros of a 1-D size (the flat layout's slot), or the 1-D view
    of a `(world, shard)` matrix holding a gradient in one column range (the rows layout's copy-in)."""
    inner, rows = None, None
    if node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], fx.Node):
        inner = node.args[0]
        found = _scatter(inner)
        if found is None or len(inner.users) != 1 or len(found[1]) != 2 or found[2] != 1:
            return None
        rows = found[1][0]
    else:
        found = _scatter(node)
        if found is None or len(found[1]) != 1 or found[2] != 0:
            return None
    grad, sizes, _, start, end, step = found
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() == 1 and step == 1):
        return None
    if not all(isinstance(x, int) for x in (*sizes, start, end)) or val.numel() != math.prod(sizes):
        return None
    return _Placed(grad, sizes[-1], start, min(end, sizes[-1]), rows, inner)


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
    to `cat([zeros(gap), piece, zeros(gap), piece, ...])`. Also matches the rows layout's form, where every leaf is
    the 1-D view of a `(world, shard)` gradient placed into zeros along dim 1: then the pieces are concatenated
    along dim 1 and viewed as 1-D; pieces with the same slot (a parameter read twice) are
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
        for piece in placed:
            slots.setdefault((piece.start, piece.end), []).append(piece.grad)
        shapes = {(piece.size, piece.rows) for piece in placed}
        ordered = sorted(slots)
        if len(shapes) != 1 or any(a[1] > b[0] for a, b in zip(ordered, ordered[1:])):
            continue
        ((size, rows),) = shapes
        lead = [] if rows is None else [rows]
        val = root.meta["val"]
        with graph.inserting_before(root):
            pieces, cursor = [], 0
            for start, end in ordered:
                if start > cursor:
                    pieces.append(_zeros(graph, val, [*lead, start - cursor]))
                total = slots[(start, end)][0]
                for other in slots[(start, end)][1:]:
                    total = graph.call_function(_aten.add.Tensor, (total, other))
                    total.meta["val"] = val.new_empty([*lead, end - start])
                pieces.append(total)
                cursor = end
            if cursor < size:
                pieces.append(_zeros(graph, val, [*lead, size - cursor]))
            cat = graph.call_function(_aten.cat.default, (pieces,) if rows is None else (pieces, 1))
            cat.meta["val"] = val.new_empty([*lead, size])
            if rows is not None:
                cat = graph.call_function(_aten.view.default, (cat, [rows * size]))
        cat.meta.update(root.meta)
        root.replace_all_uses_with(cat)
        inners = [piece.inner for piece in placed if piece.inner is not None]
        for node in sorted(adds + leaves + inners, key=lambda n: -order[n]):  # users before what they use
            bases = [node.args[0]] if node.target is _aten.slice_scatter.default else []
            graph.erase_node(node)
            for base in bases:
                if not base.users:
                    graph.erase_node(base)
        changed = True
    return finish(gm, changed)


def _zeros(graph: fx.Graph, like: torch.Tensor, shape: list[int]) -> fx.Node:
    node = graph.call_function(
        _aten.full.default,
        (shape, 0),
        {"dtype": like.dtype, "layout": torch.strided, "device": like.device, "pin_memory": False},
    )
    node.meta["val"] = like.new_zeros(shape)
    return node


def _alive(node: fx.Node) -> bool:
    """False for a node an earlier rewrite erased (iteration runs over a snapshot of the graph)."""
    return not getattr(node, "_erased", False)
