"""Where the rows of each parameter lie in a gathered flat parameter, read from the graph's own copy-out.

fp8 weight compression wants one scale per row of each parameter (`passes.compress`). A lowered gather moves a
1-D shard and carries no layout; but with `fully_shard(layout="rows")` the graph reads each parameter back from the
gathered flat with a fixed pattern (`RowShardLayout.param_of`):

    fsdp.rows_copy_out(wait, world, S, lo, hi - lo) -> view([world * rows, *trailing])

(the same read written out, `view(wait, [world, S]) -> slice(dim 1, lo, hi) -> clone -> view`, is matched too), or,
for a unit of one parameter whose rows divide evenly, `view(wait, [d0, *trailing])` directly. Column range `[lo, hi)`
of every rank's shard is then `rows` rows of `prod(trailing)` elements (a 1-D parameter: one row, its whole block). A reused block body
(`invoke_subgraph`) is read through its input. Every range found this way becomes a segment with that row length;
the ranges the graph does not read, or reads some other way (a bucket's copy-out, `reshard_after_forward=k`'s rank
reorder, the flat layout), keep `block_size` blocks. Values of a range nobody reads do not matter, so a backward
that re-reads fewer parameters than the forward may cut the shard differently without changing any result.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from fsdp_graph.ir import ROWS_COPY_OUT
from passes.quantize import Segments

_aten = torch.ops.aten
_VIEWS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)


def _shape(node: fx.Node) -> list[int] | None:
    if node.op != "call_function" or node.target not in _VIEWS:
        return None
    shape = node.args[1]
    return list(shape) if all(isinstance(d, int) for d in shape) else None


def _row_length(node: fx.Node, world: int, width: int) -> int | None:
    """The row length a view of `world * width` elements reads them as: prod(trailing) for >= 2 dims (rows whole
    per rank), `width` for 1 dim; None if it is not such a view."""
    shape = _shape(node)
    if shape is None or math.prod(shape) != world * width:
        return None
    if len(shape) == 1:
        return width
    row = math.prod(shape[1:])
    return row if row and width % row == 0 else None


def _read_rows(sliced: fx.Node, world: int, width: int) -> int | None:
    """The row length of one column range's copy-out (slice -> clone -> view, or slice -> view where the
    partitioner made the recomputed copy a view); None if it is read otherwise."""
    lengths = set()
    for user in sliced.users:
        views = user.users if user.target is _aten.clone.default else (user,)
        lengths.update(_row_length(view, world, width) for view in views)
    return lengths.pop() if len(lengths) == 1 else None


def _collect(gathered: fx.Node, world: int, n: int, found: dict[tuple[int, int], int]) -> bool:
    """Adds to `found` each column range `[lo, hi)` the graph reads in rows, with its row length; False when two
    reads of one range disagree. Follows the gathered flat into reused block bodies (`invoke_subgraph`)."""
    for user in gathered.users:
        if user.target is torch.ops.higher_order.invoke_subgraph:
            body = getattr(gathered.graph.owning_module, user.args[0].target, None)
            if not isinstance(body, fx.GraphModule):
                continue
            inputs = [p for p in body.graph.nodes if p.op == "placeholder"]
            for i, operand in enumerate(user.args[2:]):
                if operand is gathered and i < len(inputs) and not _collect(inputs[i], world, n, found):
                    return False
            continue
        if user.target is ROWS_COPY_OUT:
            _, copy_world, shard, lo, width = user.args
            lengths = {_row_length(view, world, width) for view in user.users}
            row = lengths.pop() if len(lengths) == 1 else None
            if (copy_world, shard) == (world, n) and width > 0 and row is not None:
                if found.setdefault((lo, lo + width), row) != row:
                    return False
            continue
        shape = _shape(user)
        if shape == [world, n]:
            for sliced in user.users:
                if sliced.target is not _aten.slice.Tensor or len(sliced.args) < 4 or sliced.args[1] != 1:
                    continue
                lo, hi, *step = sliced.args[2:]
                if not (isinstance(lo, int) and isinstance(hi, int) and step in ([], [1])):
                    continue
                hi = min(hi, n)  # a slice to the end may say so with a huge end
                if not 0 <= lo < hi:
                    continue
                row = _read_rows(sliced, world, hi - lo)
                if row is not None and found.setdefault((lo, hi), row) != row:
                    return False
        elif shape is not None and len(shape) > 1 and (row := _row_length(user, world, n)) is not None:
            if found.setdefault((0, n), row) != row:
                return False
    return True


def row_segments(gathered: fx.Node, world: int, n: int, block_size: int) -> Segments | None:
    """Segments of a rank's shard of `n` elements, from the copy-out of the gathered flat `gathered` (see the module
    docstring); None when the graph shows no row (then the caller keeps `block_size` blocks everywhere)."""
    found: dict[tuple[int, int], int] = {}
    if not _collect(gathered, world, n, found) or not found:
        return None
    segments, at = [], 0
    for (lo, hi), row in sorted(found.items()):
        if lo < at:  # overlapping ranges: not a layout this module knows
            return None
        if lo > at:
            segments.append((lo - at, block_size))
        segments.append((hi - lo, row))
        at = hi
    if at < n:
        segments.append((n - at, block_size))
    return tuple(segments)
