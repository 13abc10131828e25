"""Read-only cost model of lowered forward/backward graphs: a step timeline per rank, one compute lane and a
communication lane per link.

(The peak memory is `passes.memory`'s, which uses this module's collective and unit helpers.) `simulate` replays one graph on a compute lane and communication lanes with a roofline cost per
kernel and an alpha-beta (ring) cost per collective, and returns the step time and the communication the compute
lane had to wait for (exposed communication). It reads only node targets, arguments and `meta["val"]`
(FakeTensors; symbolic sizes count at their hints), plus the `fsdp_*` meta keys of `fsdp_graph.ir`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fsdp_graph.ir import META_COMPRESSED, META_ROLE, META_UNIT, ROLE_UNSHARD, WAIT
from passes.fusion import FusionPlan, fusion_groups
from passes.fx_nodes import alias_source, bind_args, fake_value, hint, value_bytes, written_args
from passes.hardware import HARDWARE, Hardware, collective_seconds, span
from passes.kernels import is_fp32_matmul, kernel_seconds, kind_of, node_flops

__all__ = ["HARDWARE", "Hardware", "node_flops"]  # re-exported: their home is passes.hardware / passes.kernels

_aten = torch.ops.aten


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]


def collective_kind(node: fx.Node) -> str | None:
    """ "all_gather", "reduce_scatter", "all_reduce", "all_to_all" or another `_c10d_functional` op's name for a
    collective node (coalesced variants included); None for anything else, `wait_tensor` included."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target == WAIT:
        return None
    if target.namespace != "_c10d_functional":
        return None
    name = target._opname
    for prefix, kind in (
        ("all_gather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("all_reduce", "all_reduce"),
        ("all_to_all", "all_to_all"),
    ):
        if name.startswith(prefix):
            return kind
    return name


def _collective_of_wait(node: fx.Node) -> fx.Node | None:
    """The collective a `wait_tensor` waits for (through `getitem` for coalesced collectives)."""
    if node.op != "call_function" or node.target != WAIT:
        return None
    arg = node.args[0]
    if isinstance(arg, fx.Node) and arg.target is operator.getitem:
        arg = arg.args[0]
    return arg if isinstance(arg, fx.Node) and collective_kind(arg) is not None else None


def unit_labels(gm: fx.GraphModule) -> list[str | None]:
    """For every node, the FSDP unit it works for: its own `fsdp_unit` (collectives, casts, waits), else the unit
    whose gathered parameters it reads (through views of the gather), else the label of the node before it
    (nodes before the first labelled one take that one's label). None when the graph has no FSDP unit at all."""
    labels: list[str | None] = []
    params: dict[fx.Node, str] = {}  # node -> the unit whose gathered buffer it is a view of
    current = None
    for node in gm.graph.nodes:
        own = node.meta.get(META_UNIT)
        if node.op == "call_function" and node.meta.get(META_ROLE) == ROLE_UNSHARD and own is not None:
            params[node] = own
        elif node.op == "call_function":
            source = node.args[0] if node.target is operator.getitem else alias_source(node)
            if isinstance(source, fx.Node) and source in params:
                params[node] = params[source]
        read = next((params[a] for a in _input_nodes(node) if a in params), None)
        current = own if own is not None else (read if read is not None else current)
        labels.append(current)
    first = next((label for label in labels if label is not None), None)
    return [first if label is None else label for label in labels]


@dataclass(frozen=True)
class Event:
    """A bar of the timeline. lane: "compute" or "comm". kind: "compute", "wait" (the compute lane blocked on
    a collective: exposed communication) or the collective's kind. `unit`: the FSDP unit it belongs to."""

    lane: str
    kind: str
    start: float
    end: float
    label: str
    unit: str | None = None


@dataclass
class Simulation:
    """One graph replayed from `start`: its bars, every node's [start, end) on the compute lane (graph order),
    and totals in seconds. `exposed_comm` is the time the compute lane waited for collectives."""

    events: list[Event]
    node_times: list[tuple[float, float]]
    start: float
    end: float
    compute_time: float
    comm_time: float
    exposed_comm: float
    flops: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def kernel_cost(
    node: fx.Node,
    hardware: Hardware,
    bodies: dict | None = None,
    *,
    fused: bool = False,
    attention_window: int | None = None,
) -> tuple[float, int]:
    """(seconds, flops) of one compute node as a kernel of its own (`passes.kernels.kernel_seconds`: max(flops /
    rate, bytes / memory rate) + the per-kernel overhead, the rate by the kernel's class). A call of a compile
    region (`invoke_subgraph`, `fully_shard(reuse_blocks=True)`'s block body) costs its body's kernels, each
    priced the same way (views free), fused as Inductor would with `fused` (`passes.fusion`); computed once per
    body in `bodies`."""
    if node.target is torch.ops.higher_order.invoke_subgraph:
        body = getattr(node.graph.owning_module, node.args[0].target)
        bodies = {} if bodies is None else bodies
        if id(body) not in bodies:
            bodies[id(body)] = _graph_compute(body, hardware, bodies, fused, attention_window)
        return bodies[id(body)]
    n_flops = node_flops(node, attention_window)
    kind = kind_of(node)
    return kernel_seconds(
        n_flops, _moved_bytes(node), kind, hardware, kind == "matmul" and is_fp32_matmul(node)
    ), n_flops


def _graph_compute(
    gm: fx.GraphModule, hardware: Hardware, bodies: dict, fused: bool, attention_window: int | None
) -> tuple[float, int]:
    """(seconds, flops) of every kernel of `gm`, collectives and waits aside."""
    plan = fusion_groups(gm) if fused else None
    seconds = flops = 0
    for node in gm.graph.nodes:
        if not _is_compute(node):
            continue
        cost = _node_cost(node, hardware, bodies, plan, attention_window)
        seconds += cost[0]
        flops += cost[1]
    return seconds, flops


def _node_cost(
    node: fx.Node, hardware: Hardware, bodies: dict, plan: FusionPlan | None, attention_window: int | None
) -> tuple[float, int]:
    """A node's cost in a timeline: its own kernel's, or (fused) its kernel's at the kernel's first member and
    nothing at the others."""
    kernel = plan.kernel_of.get(node) if plan is not None else None
    if kernel is None or not kernel.fused:
        return kernel_cost(node, hardware, bodies, fused=plan is not None, attention_window=attention_window)
    if kernel.nodes[0] is not node:
        return 0.0, 0
    n_flops = sum(node_flops(n, attention_window) for n in kernel.nodes)
    return kernel_seconds(n_flops, kernel.moved_bytes, "other", hardware), n_flops


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and collective_kind(node) is None and node.target != WAIT and not _is_free(node)


def _is_free(node: fx.Node) -> bool:
    """Views cost nothing; an in-place op aliases its input too but still moves its bytes."""
    if node.target is operator.getitem:
        return True
    if alias_source(node) is None:
        return False
    return not written_args(node)


def _moved_bytes(node: fx.Node) -> int:
    return sum(value_bytes(fake_value(n)) for n in _input_nodes(node)) + value_bytes(fake_value(node))


def collective_cost(
    node: fx.Node,
    hardware: Hardware,
    world: int,
    group_sizes: Mapping[str, int] | None = None,
    group_ranks: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[int, int, float]:
    """(group size, unsharded payload bytes, seconds) of a collective node (`passes.hardware.collective_seconds`).
    The group size is the op's `group_size` argument, else `group_sizes[group_name]`, else `world`. Which links it
    crosses comes from the group's ranks (`group_ranks[group_name]`) and `hardware.ranks_per_node`; a group whose
    ranks are not given is taken as n consecutive ranks."""
    kind = collective_kind(node)
    n, nodes, per_node = _group(node, hardware, world, group_sizes, group_ranks)
    if kind == "all_gather":
        payload = value_bytes(fake_value(node))
    else:
        payload = sum(value_bytes(fake_value(a)) for a in _input_nodes(node))
    if n <= 1:
        return n, payload, 0.0
    return n, payload, collective_seconds(kind, payload, n, hardware, nodes, per_node)


def _group(
    node: fx.Node,
    hardware: Hardware,
    world: int,
    group_sizes: Mapping[str, int] | None,
    group_ranks: Mapping[str, tuple[int, ...]] | None,
) -> tuple[int, int, int]:
    """(size, nodes, most ranks on one node) of a collective's group (see `collective_cost`)."""
    args = bind_args(node)
    name = args.get("group_name")
    n = args.get("group_size")
    n = hint(n if n is not None else (group_sizes or {}).get(name, world))
    ranks = (group_ranks or {}).get(name) or tuple(range(n))
    return (n, *span(ranks, hardware.ranks_per_node))


def collective_link(
    node: fx.Node,
    hardware: Hardware,
    world: int,
    group_sizes: Mapping[str, int] | None = None,
    group_ranks: Mapping[str, tuple[int, ...]] | None = None,
) -> str:
    """The link a collective's time is spent on: "network" where its group's ranks sit on more than one node (a
    ring through several nodes runs at the NICs' rate), else "node" (inside one node; every group, without
    `hardware.ranks_per_node`)."""
    n, nodes, _ = _group(node, hardware, world, group_sizes, group_ranks)
    return "network" if n > 1 and nodes > 1 else "node"


def unit_name(unit: str | None) -> str:
    """A unit label for people: "<root>" for the root's "", and so inside bucket labels ("+blocks.1")."""
    return "-" if unit is None else "+".join(part or "<root>" for part in unit.split("+"))


def _label(kind: str, unit: str | None) -> str:
    return kind if unit is None else f"{kind} {unit_name(unit)}"


def simulate(
    gm: fx.GraphModule,
    hardware: Hardware,
    world: int,
    *,
    group_sizes: Mapping[str, int] | None = None,
    start: float = 0.0,
    fused: bool = False,
    group_ranks: Mapping[str, tuple[int, ...]] | None = None,
    attention_window: int | None = None,
) -> Simulation:
    """Replay `gm` in graph order on a compute lane and a communication lane per link. Compute lane: each kernel
    costs `kernel_cost` (with `fused`, the kernels are Inductor's fusion groups, `passes.fusion`, each charged
    where its first node runs); views, getitem and collective issues are free. Comm lanes, each serial: a
    collective starts when the compute lane reaches it and its link's lane is free, and lasts `collective_cost`.
    The links are `collective_link`'s: the network between nodes and the links inside one. NCCL runs each process
    group's collectives on a stream of its own, so collectives on different links (tensor parallelism's
    all-reduces inside a node beside FSDP's gathers across nodes; HSDP's replica all-reduce beside its shard
    group's reduce-scatter) overlap; collectives on one link share its bandwidth, which one after another models.
    Without `hardware.ranks_per_node` there is one link. A wait holds the compute lane until its collective ends:
    that holding is exposed communication. So a gather issued early overlaps the compute between its issue and its
    wait, and one issued right before its wait is fully exposed. A compile region's call runs its body's kernels
    (`kernel_cost`)."""
    labels = unit_labels(gm)
    clock = start
    comm_free: dict[str, float] = {}
    ends: dict[fx.Node, float] = {}
    lanes: dict[str, list[Event]] = {"compute": [], "comm": []}
    node_times: list[tuple[float, float]] = []
    compute = comm = exposed = flops = 0.0
    bodies: dict = {}
    plan = fusion_groups(gm) if fused else None
    for node, unit in zip(gm.graph.nodes, labels):
        begin = clock
        if node.op != "call_function":
            pass
        elif (kind := collective_kind(node)) is not None:
            owner = node.meta.get(META_UNIT)
            _, _, seconds = collective_cost(node, hardware, world, group_sizes, group_ranks)
            link = collective_link(node, hardware, world, group_sizes, group_ranks)
            comm_start = max(clock, comm_free.get(link, start))
            comm_free[link] = ends[node] = comm_start + seconds
            comm += seconds
            lanes["comm"].append(Event("comm", kind, comm_start, ends[node], _label(kind, owner), owner))
        elif node.target == WAIT:
            collective = _collective_of_wait(node)
            done = ends.get(collective, clock)
            if done > clock:
                owner = collective.meta.get(META_UNIT)
                label = "wait " + _label(collective_kind(collective), owner)
                lanes["compute"].append(Event("compute", "wait", clock, done, label, owner))
                exposed += done - clock
                clock = done
        elif not _is_free(node):
            seconds, n_flops = _node_cost(node, hardware, bodies, plan, attention_window)
            flops += n_flops
            compute += seconds
            bars = lanes["compute"]
            if seconds > 0:
                last = bars[-1] if bars else None
                if last is not None and last.kind == "compute" and last.unit == unit and last.end == clock:
                    bars[-1] = Event("compute", "compute", last.start, clock + seconds, last.label, unit)
                else:
                    label = "compute" if unit is None else unit_name(unit)
                    bars.append(Event("compute", "compute", clock, clock + seconds, label, unit))
            clock += seconds
        node_times.append((begin, clock))
    end = max([clock, *comm_free.values()])
    return Simulation(lanes["compute"] + lanes["comm"], node_times, start, end, compute, comm, exposed, flops)


def iter_collectives(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, str, str | None]]:
    """(node, kind, fsdp unit) of every collective of `gm`, in graph order."""
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            yield node, kind, node.meta.get(META_UNIT)


@dataclass
class CompressionCost:
    """What `passes.compress` changed in one or more graphs, per rank: the bytes its collectives send ((n - 1) / n of
    the payload), what the collectives they replaced would have sent, and the quantize/dequantize kernels' time
    (`kernel_cost`; already part of `simulate`'s compute lane)."""

    schemes: set[str] = field(default_factory=set)
    collectives: int = 0
    sent_bytes: float = 0.0
    uncompressed_sent_bytes: float = 0.0
    codec_seconds: float = 0.0

    def add(self, gm: fx.GraphModule, hardware: Hardware, world: int, group_sizes: Mapping[str, int] | None = None):
        """Adds `gm`'s compressed collectives and codec kernels; returns self."""
        for node in gm.graph.nodes:
            if META_COMPRESSED not in node.meta:
                continue
            scheme, original = node.meta[META_COMPRESSED]
            self.schemes.add(scheme)
            if collective_kind(node) is not None:
                n, payload, _ = collective_cost(node, hardware, world, group_sizes)
                self.collectives += 1
                self.sent_bytes += payload * (n - 1) / n
                self.uncompressed_sent_bytes += original * (n - 1) / n
            elif _is_compute(node):
                self.codec_seconds += kernel_cost(node, hardware)[0]
        return self
