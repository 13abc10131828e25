"""Read-only memory model of lowered forward/backward graphs: the liveness of every tensor storage, per rank.

`estimate_memory` lays a forward and a backward graph on one position axis (saved activations, gathered
parameters, gradients, communication buffers) and returns the predicted peak and where it happens. A call of a
compile region (`invoke_subgraph`: `fully_shard`'s shared block body) is looked into: its body's temporaries are
live while the call runs, its outputs are the body's storages (an output that is one of its inputs is that input).
It reads only node targets, arguments and `meta["val"]` (FakeTensors; symbolic sizes count at their hints).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from passes.cost import _collective_of_wait, _input_nodes, collective_kind, unit_labels
from passes.fusion import fusion_groups
from passes.fx_nodes import alias_source, fake_value, tensor_bytes

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


@dataclass(eq=False)
class _Storage:
    nbytes: int
    persistent: bool = False
    alloc: int = 0
    last_use: int = 0


@dataclass(frozen=True)
class _BodyMemory:
    """What running a region's body adds to memory. `outputs[i]`: ("input", k) when output i is (a view of) the
    body's k-th input, ("fresh", g) when it is (a view of) the g-th storage the body allocates and returns, None when
    it is no tensor. `fresh_bytes[g]`: that storage's size. `transient_bytes`: the body's peak above its fresh
    outputs (the temporaries it frees before returning)."""

    outputs: tuple[tuple[str, int] | None, ...]
    fresh_bytes: tuple[int, ...]
    transient_bytes: int


class _Liveness:
    """Storages of the nodes of one or two graphs laid out on one position axis."""

    def __init__(self, bodies: dict[int, _BodyMemory] | None = None, fused: bool = False):
        self.fused = fused  # Inductor's fusion: nodes inside a fused kernel allocate nothing
        self.internal: set[fx.Node] = set()
        self.storages: list[_Storage] = []
        self.refs: dict[fx.Node, list[_Storage]] = {}  # a tensor node -> the storages it keeps alive
        self.elems: dict[fx.Node, list[list[_Storage]]] = {}  # a tuple/list node -> per element
        self.bodies = {} if bodies is None else bodies  # id(body graph module) -> its memory, computed once

    def new(self, nbytes: int, position: int, persistent: bool = False) -> _Storage:
        storage = _Storage(nbytes, persistent, position, position)
        self.storages.append(storage)
        return storage

    def allocate(self, node: fx.Node, position: int, persistent: bool = False) -> None:
        val = fake_value(node)
        if node in self.internal:
            self.refs[node] = []
            return
        if isinstance(val, (tuple, list)):
            self.elems[node] = [
                [self.new(tensor_bytes(v), position, persistent)] if isinstance(v, torch.Tensor) else [] for v in val
            ]
            self.refs[node] = [s for elem in self.elems[node] for s in elem]
        elif isinstance(val, torch.Tensor):
            self.refs[node] = [self.new(tensor_bytes(val), position, persistent)]
        else:
            self.refs[node] = []

    def define(self, node: fx.Node, position: int) -> None:
        if node.target is operator.getitem:
            base, index = node.args
            elems = self.elems.get(base)
            self.refs[node] = elems[index] if elems is not None and index < len(elems) else self.refs.get(base, [])
            return
        if node.target is _INVOKE_SUBGRAPH:
            self.call_region(node, position)
            return
        source = alias_source(node)
        if source is not None:
            self.refs[node] = self.refs.get(source, [])
            val = fake_value(node)
            if isinstance(val, (tuple, list)):  # split/unbind/chunk: every piece views the input
                self.elems[node] = [self.refs[node]] * len(val)
            return
        self.allocate(node, position)

    def call_region(self, node: fx.Node, position: int) -> None:
        """A region call: its body's fresh outputs are allocated, its temporaries live for the call only, and an
        output that is an input of the body is the caller's operand."""
        body = getattr(node.graph.owning_module, node.args[0].target)
        if id(body) not in self.bodies:
            self.bodies[id(body)] = _body_memory(body, self.bodies, self.fused)
        memory = self.bodies[id(body)]
        operands = node.args[2:]
        fresh = [self.new(nbytes, position) for nbytes in memory.fresh_bytes]
        elems = []
        for output in memory.outputs:
            if output is None:
                elems.append([])
            elif output[0] == "input":
                operand = operands[output[1]]
                elems.append(self.refs.get(operand, []) if isinstance(operand, fx.Node) else [])
            else:
                elems.append([fresh[output[1]]])
        self.elems[node] = elems
        self.refs[node] = list({id(s): s for elem in elems for s in elem}.values())
        if memory.transient_bytes:
            self.new(memory.transient_bytes, position)

    def use(self, nodes, position: int) -> None:
        for node in nodes:
            for storage in self.refs.get(node, ()):
                storage.last_use = max(storage.last_use, position)

    def run(self, node: fx.Node, position: int, last_wait: int) -> None:
        """A node that computes: it defines its output, and its inputs live to here (a collective's: to its wait,
        `last_wait`, the work holds them)."""
        self.define(node, position)
        self.use(_input_nodes(node), position)
        if collective_kind(node) is not None:
            self.use(_input_nodes(node), last_wait)

    def curve(self, length: int) -> tuple[int, list[int]]:
        """(persistent bytes, bytes live above them at each of `length` positions)."""
        delta = [0] * (length + 1)
        persistent = 0
        for storage in self.storages:
            if storage.persistent:
                persistent += storage.nbytes
            else:
                delta[storage.alloc] += storage.nbytes
                delta[storage.last_use + 1] -= storage.nbytes
        running, curve = 0, []
        for p in range(length):
            running += delta[p]
            curve.append(running)
        return persistent, curve


def _last_waits(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Collective -> the position of its last wait, in `nodes`."""
    waits: dict[fx.Node, int] = {}
    for p, node in enumerate(nodes):
        collective = _collective_of_wait(node)
        if collective is not None:
            waits[collective] = p
    return waits


def _body_memory(body: fx.GraphModule, bodies: dict[int, _BodyMemory], fused: bool = False) -> _BodyMemory:
    """The liveness of a region's body on its own, its inputs held by the caller for the whole call."""
    live = _Liveness(bodies, fused)
    if fused:
        live.internal = fusion_groups(body).internal
    nodes = list(body.graph.nodes)
    last_wait = _last_waits(nodes)
    input_index: dict[int, int] = {}  # id(storage) -> the body input it is
    for p, node in enumerate(nodes):
        if node.op == "placeholder":
            live.allocate(node, p, persistent=True)
            input_index.update((id(s), len(input_index)) for s in live.refs[node])
        elif node.op == "get_attr":
            live.allocate(node, p, persistent=True)
        elif node.op == "output":
            live.use(_input_nodes(node), p)
        else:
            live.run(node, p, last_wait.get(node, p))
    outputs: list[tuple[str, int] | None] = []
    fresh: dict[int, int] = {}  # id(storage) -> its index among the fresh outputs
    fresh_bytes: list[int] = []
    for value in _output_values(body):
        storage = next(iter(live.refs.get(value, ()) if isinstance(value, fx.Node) else ()), None)
        if storage is None:
            outputs.append(None)
        elif storage.persistent:
            outputs.append(("input", input_index[id(storage)]))
        else:
            if id(storage) not in fresh:
                fresh[id(storage)] = len(fresh_bytes)
                fresh_bytes.append(storage.nbytes)
            outputs.append(("fresh", fresh[id(storage)]))
    _, curve = live.curve(len(nodes))
    transient = max(max(curve, default=0) - sum(fresh_bytes), 0)
    return _BodyMemory(tuple(outputs), tuple(fresh_bytes), transient)


@dataclass(frozen=True)
class MemoryPoint:
    """Bytes live (above the persistent baseline) while the node at `index` of the `stage` graph runs."""

    stage: str
    index: int
    node: str
    unit: str | None
    bytes: int


@dataclass
class MemoryEstimate:
    """Predicted memory of one rank over a forward and a backward graph.

    `persistent_bytes`: the forward graph's inputs (flat shards, buffers, the batch), live before and after the
    step. `peak_bytes`: the most bytes live on top of them, at `peak`. `curve`: one point per node, forward then
    backward. `outputs_bytes`: what the backward leaves allocated (the gradient shards)."""

    persistent_bytes: int
    peak_bytes: int
    peak: MemoryPoint
    curve: list[MemoryPoint] = field(default_factory=list)
    outputs_bytes: int = 0
    # The allocations behind the curve: persistent sizes, and (alloc position, last use, bytes, returned by the last
    # graph) of the others, in creation order (`allocation_events`).
    persistent_blocks: list[int] = field(default_factory=list, repr=False)
    blocks: list[tuple[int, int, int, bool]] = field(default_factory=list, repr=False)
    # Bytes the forward saves for the backward, by the FSDP unit of the node that made them (distinct storages).
    saved_by_unit: dict[str | None, int] = field(default_factory=dict, repr=False)
    # Bytes live at the peak (above the persistent ones), by the FSDP unit of the node that allocated them.
    peak_by_unit: dict[str | None, int] = field(default_factory=dict, repr=False)

    @property
    def total_peak_bytes(self) -> int:
        return self.persistent_bytes + self.peak_bytes


def allocation_events(estimate: MemoryEstimate, first_id: int = 0) -> tuple[list[tuple[str, int, int]], list[int]]:
    """The step as ("malloc", id, bytes) / ("free", id, 0) events in position order (at one position, what a node
    allocates before what dies after it), ids from `first_id`, for `passes.allocator.replay`. The last graph's
    returned storages (the gradient shards) are allocated but not freed: their ids come back second."""
    at: dict[int, list[int]] = {}
    dies: dict[int, list[int]] = {}
    kept = []
    for i, (alloc, last_use, nbytes, returned) in enumerate(estimate.blocks):
        if nbytes <= 0:
            continue
        at.setdefault(alloc, []).append(i)
        if returned:
            kept.append(first_id + i)
        else:
            dies.setdefault(last_use, []).append(i)
    events: list[tuple[str, int, int]] = []
    for position in sorted(set(at) | set(dies)):
        events += [("malloc", first_id + i, estimate.blocks[i][2]) for i in at.get(position, ())]
        events += [("free", first_id + i, 0) for i in dies.get(position, ())]
    return events, kept


def _output_values(gm: fx.GraphModule) -> list:
    """The graph's returned values, in order (a body returns a flat tuple; nested containers are flattened)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(tree_flatten(output.args)[0])


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [a for a in _output_values(gm) if isinstance(a, fx.Node)]


def estimate_memory(
    fw: fx.GraphModule, bw: fx.GraphModule | None = None, *, release_inputs: bool = True, fused: bool = False
) -> MemoryEstimate:
    """Liveness of every tensor storage over `fw` then `bw` (the partitioned, lowered graphs of one compile).

    A storage is allocated by the node producing it and freed after its last use; view, in-place and wait nodes
    alias their input's storage and extend its life. A collective's inputs stay live until its wait (the work
    holds them); a gather's output buffer is allocated when it is issued. A region call (`invoke_subgraph`) adds its
    body's peak of temporaries for the call's duration and allocates the body's fresh outputs. The forward's inputs
    are the persistent baseline. Forward outputs the backward takes as inputs (saved activations, matched by name:
    the partitioner names backward inputs after forward nodes) stay live until their last use in the backward; other
    forward outputs (what the user gets) are released when the forward returns, and the backward's other inputs
    (the incoming gradients) are allocated when it starts. `release_inputs=False` models an executor that holds its
    argument list for the whole call (the eager-kernel backend: `make_boxed_func`), so backward inputs then live
    until the backward returns; Inductor's code frees each one at its last use. `fused=True` models Inductor's
    fusion too: a node inside a fused kernel whose value never leaves the kernel (`passes.fusion`) allocates
    nothing."""
    live = _Liveness(fused=fused)
    graphs = [("fw", fw)] + ([("bw", bw)] if bw is not None else [])
    positions: list[tuple[str, int, fx.Node, str | None]] = []
    for stage, gm in graphs:
        if fused:
            live.internal |= fusion_groups(gm).internal
        labels = unit_labels(gm)
        positions += [(stage, i, node, labels[i]) for i, node in enumerate(gm.graph.nodes)]
    fw_outputs = _output_nodes(fw)
    fw_by_name = {node.name: node for node in fw_outputs}
    bw_inputs = [n for n in bw.graph.nodes if n.op == "placeholder"] if bw is not None else []
    saved = {fw_by_name[n.name] for n in bw_inputs if n.name in fw_by_name}
    bw_output_position = len(positions) - 1
    last_wait = _last_waits([node for _, _, node, _ in positions])

    for p, (stage, _, node, _) in enumerate(positions):
        if node.op == "placeholder":
            if stage == "fw":
                live.allocate(node, p, persistent=True)
            elif node.name in fw_by_name:
                live.refs[node] = live.refs.get(fw_by_name[node.name], [])
                if not release_inputs:
                    live.use([node], bw_output_position)
            else:
                live.allocate(node, p)
                if not release_inputs:
                    live.use([node], bw_output_position)
        elif node.op == "get_attr":
            live.allocate(node, p, persistent=True)
        elif node.op == "output":
            live.use([n for n in fw_outputs if n not in saved] if stage == "fw" else _input_nodes(node), p)
        else:
            live.run(node, p, last_wait.get(node, p))

    persistent, running = live.curve(len(positions))
    curve = [
        MemoryPoint(stage, index, node.name, unit, running[p]) for p, (stage, index, node, unit) in enumerate(positions)
    ]
    peak = max(curve, key=lambda point: point.bytes)
    last_graph = graphs[-1][1]
    outputs = {id(s): s.nbytes for n in _output_nodes(last_graph) for s in live.refs.get(n, ()) if not s.persistent}
    blocks = [(s.alloc, s.last_use, s.nbytes, id(s) in outputs) for s in live.storages if not s.persistent]
    fw_labels = dict(zip(fw.graph.nodes, unit_labels(fw)))
    saved_by_unit: dict[str | None, int] = {}
    counted: set[int] = set()
    for node in fw.graph.nodes:
        if node not in saved:
            continue
        for storage in live.refs.get(node, ()):
            if not storage.persistent and id(storage) not in counted:
                counted.add(id(storage))
                unit = fw_labels.get(node)
                saved_by_unit[unit] = saved_by_unit.get(unit, 0) + storage.nbytes
    persistent_blocks = [s.nbytes for s in live.storages if s.persistent]
    at_peak = curve.index(peak)
    peak_by_unit: dict[str | None, int] = {}
    for storage in live.storages:
        if not storage.persistent and storage.alloc <= at_peak <= storage.last_use:
            unit = positions[storage.alloc][3]
            peak_by_unit[unit] = peak_by_unit.get(unit, 0) + storage.nbytes
    return MemoryEstimate(
        persistent,
        peak.bytes,
        peak,
        curve,
        sum(outputs.values()),
        persistent_blocks,
        blocks,
        saved_by_unit,
        peak_by_unit,
    )
