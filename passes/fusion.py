"""Which nodes of a lowered graph Inductor runs as one kernel, and the bytes each kernel moves.

Inductor generates one kernel for a connected run of pointwise and reduction ops that loop over the same
elements, and calls library kernels for the rest (matmuls, attention, collectives). A memory-bound kernel then
moves only its group's inputs from outside the group and the values it hands on, not the intermediates between its
ops, so charging every FX node its own reads and writes overstates the step (issue 37: 0.63 s of memory-bound time
in a 3.3 s plan, where eager and compiled differ by 0.39 s in published measurements).

The model (`fusion_groups`):
- Barriers, each a kernel of its own: matmuls, attention, collectives and their waits, region calls, custom ops,
  and scatter-like kernels (`SEPARATE`). Views, `getitem` and placeholders are no kernels; a view passes its
  producer on to its users.
- A node's level is the most barriers on a path to it. Two fusible nodes share a kernel only at one level: a
  kernel cannot run both before and after a matmul.
- A fusible node loops over `total` elements: its output's, or a reduction's input's. It joins the group of a
  fusible producer (a direct input, or the source of a viewed input) at its level when its total equals the
  group's, or equals the output size of a reduction in the group (an epilogue such as RMSNorm's rsqrt). Groups a
  node joins are merged. This is Inductor's vertical and horizontal fusion over equal iteration spaces, without
  its cost heuristics (which can split a group) or its cycle checks beyond levels.
- A group's bytes: each distinct outside value its members read, plus each member's output read outside the group
  or returned by the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fsdp_graph.ir import WAIT
from passes.fx_nodes import alias_source, fake_value, hint, value_bytes
from passes.kernels import RNG_WRAPPERS, kind_of

_aten = torch.ops.aten
_REDUCTIONS = frozenset(
    {
        _aten.sum,
        _aten.mean,
        _aten.amax,
        _aten.amin,
        _aten.max,
        _aten.min,
        _aten.var,
        _aten.var_mean,
        _aten.std,
        _aten.prod,
        _aten.any,
        _aten.all,
        _aten.argmax,
        _aten.argmin,
        _aten.logsumexp,
        _aten.norm,
        _aten.linalg_vector_norm,
    }
)
# Kernels Inductor emits on their own (scatters with atomics, sorts, scans) or calls from a library.
SEPARATE = frozenset(
    {
        _aten.embedding_dense_backward,
        _aten.index_put,
        _aten.index_put_,
        _aten.scatter_add,
        _aten.scatter_add_,
        _aten.scatter_reduce,
        _aten.sort,
        _aten.topk,
        _aten.cumsum,
        _aten.nonzero,
    }
)


@dataclass
class Kernel:
    """One kernel: its member nodes (graph order), the bytes it reads and writes, and its class ("matmul",
    "attention", "other")."""

    nodes: list[fx.Node]
    moved_bytes: int
    kind: str
    fused: bool = False  # a group of fusible nodes (even of one); False: a barrier's own kernel


@dataclass
class FusionPlan:
    """The kernels of one graph. `kernel_of[node]` is the kernel a computing node belongs to; `internal` holds
    the fused nodes whose outputs never leave their kernel (Inductor does not allocate them)."""

    kernels: list[Kernel] = field(default_factory=list)
    kernel_of: dict[fx.Node, Kernel] = field(default_factory=dict)
    internal: set[fx.Node] = field(default_factory=set)


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or (
        alias_source(node) is not None and node.target != WAIT and not _writes(node)
    )


def _writes(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_barrier(node: fx.Node) -> bool:
    target = node.target
    if target is torch.ops.higher_order.invoke_subgraph or target in RNG_WRAPPERS or target == WAIT:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return True
    if target.namespace not in ("aten", "prims"):
        return True  # collectives, fsdp ops, custom ops
    return target.overloadpacket in SEPARATE or kind_of(node) != "other"


def _numel(val) -> int:
    return hint(val.numel()) if isinstance(val, torch.Tensor) else 0


def _inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]


def _iteration(node: fx.Node) -> tuple[int, int]:
    """(elements the node's loop runs over, elements it writes)."""
    out = _numel(fake_value(node))
    packet = getattr(node.target, "overloadpacket", None)
    if packet in _REDUCTIONS and node.args and isinstance(node.args[0], fx.Node):
        return max(_numel(fake_value(node.args[0])), out), out
    return out, out


class _Group:
    def __init__(self, total: int):
        self.total = total
        self.reduction_outputs: set[int] = set()
        self.members: list[fx.Node] = []


def fusion_groups(gm: fx.GraphModule) -> FusionPlan:
    """The kernels Inductor would run for `gm` (see the module docstring), in graph order."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    source: dict[fx.Node, fx.Node] = {}  # a view -> the computing node whose value it views
    level: dict[fx.Node, int] = {}
    group: dict[fx.Node, _Group] = {}
    for node in nodes:
        inputs = [source.get(a, a) for a in _inputs(node)]
        if _is_view(node):
            base = inputs[0] if inputs else None
            if base is not None:
                source[node] = base
            level[node] = level.get(base, 0) if base is not None else 0
            continue
        level[node] = max((level.get(a, 0) + _is_barrier_node(a) for a in inputs), default=0)
        if _is_barrier(node):
            continue
        total, written = _iteration(node)
        joined: list[_Group] = []
        for producer in inputs:
            g = group.get(producer)
            if g is None or level.get(producer) != level[node] or g in joined:
                continue
            if total == g.total or total in g.reduction_outputs:
                joined.append(g)
        target = joined[0] if joined else _Group(total)
        for other in joined[1:]:
            target.members += other.members
            target.reduction_outputs |= other.reduction_outputs
            for member in other.members:
                group[member] = target
        if written < total:
            target.reduction_outputs.add(written)
        target.members.append(node)
        group[node] = target
    return _plan(gm, nodes, source, group)


def _is_barrier_node(node: fx.Node) -> bool:
    return node.op == "call_function" and _is_barrier(node)


def _plan(gm: fx.GraphModule, nodes: list[fx.Node], source: dict, group: dict) -> FusionPlan:
    plan = FusionPlan()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: dict[int, Kernel] = {}
    for node in nodes:
        if node in source or node.target is operator.getitem:
            continue
        g = group.get(node)
        if g is None:  # a barrier: its own kernel, its own reads and writes
            kernel = Kernel([node], _moved(node), kind_of(node))
            plan.kernels.append(kernel)
            plan.kernel_of[node] = kernel
            continue
        if id(g) in seen:
            plan.kernel_of[node] = seen[id(g)]
            continue
        members = sorted(g.members, key=order.__getitem__)
        kernel = Kernel(members, 0, "other", fused=True)
        seen[id(g)] = kernel
        plan.kernels.append(kernel)
        plan.kernel_of[node] = kernel
    for kernel in plan.kernels:
        if kernel.fused:
            kernel.moved_bytes = _group_bytes(kernel.nodes, source, plan)
    return plan


def _moved(node: fx.Node) -> int:
    return sum(value_bytes(fake_value(n)) for n in _inputs(node)) + value_bytes(fake_value(node))


def _group_bytes(members: list[fx.Node], source: dict, plan: FusionPlan) -> int:
    inside = set(members)
    read: dict[fx.Node, int] = {}
    for member in members:
        for arg in _inputs(member):
            if source.get(arg, arg) not in inside:
                read.setdefault(arg, value_bytes(fake_value(arg)))
    written = 0
    for member in members:
        if _used_outside(member, inside, source):
            written += value_bytes(fake_value(member))
        else:
            plan.internal.add(member)
    return sum(read.values()) + written


def _used_outside(node: fx.Node, inside: set, source: dict) -> bool:
    for user in node.users:
        if user.op == "output":
            return True
        if user in source:  # a view: where does it go?
            if _used_outside(user, inside, source):
                return True
        elif user not in inside:
            return True
    return False
