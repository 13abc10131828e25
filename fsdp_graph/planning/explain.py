"""`explain()`: what a sharded model's compiled step will cost, per rank, before training it.

One forward + backward of the model (and its loss) is compiled by the fsdp backend with eager kernels and run
once; the lowered forward and backward graphs then go through the cost model: tensor liveness for the peak memory
(`passes.memory`), a two-lane (compute / communication) replay for the step time and the communication the
compute has to wait for (`passes.cost`). The process group may be the fake one, so a single machine can plan for any world size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from fsdp_graph.compiler.backend import GraphReport, make_backend
from fsdp_graph.ir import META_BUCKET, META_ROLE, ROLE_REDUCE
from fsdp_graph.planning.attention import fused_attention_on_meta, random_ops_on_meta
from fsdp_graph.planning.groups import group_ranks, group_roles, other_group_sizes
from fsdp_graph.planning.optimizer import OptimizerModel, optimizer_model
from fsdp_graph.planning.step import StepExtras
from fsdp_graph.runtime.unit import FlatParamState, flat_params
from passes.cost import (
    HARDWARE,
    CompressionCost,
    Hardware,
    Simulation,
    collective_cost,
    iter_collectives,
    simulate,
    unit_name,
)
from passes.fx_nodes import bind_args
from passes.memory import MemoryEstimate, estimate_memory

_MIB = 2**20


@dataclass(frozen=True)
class UnitRow:
    """One flat parameter of a unit (a unit with frozen parameters has two: `<unit>[frozen]`). Bytes are per
    rank: `unsharded_bytes` is what a gather materialises (padded, in the gather's dtype), `shard_bytes` what
    the rank keeps. Collective counts are per training step, forward plus backward."""

    unit: str
    params: int
    unsharded_bytes: int
    shard_bytes: int
    world: int
    gathers: int
    reduce_scatters: int
    all_reduces: int

    @property
    def label(self) -> str:
        return unit_name(self.unit)


@dataclass
class ExplainReport:
    """The plan of one training step on one rank (see `explain`). Times in seconds, memory in bytes."""

    world: int
    hardware: Hardware
    executor: str  # "inductor", "unfused kernels" (no torch.compile) or "eager kernels" (the aot backend)
    units: list[UnitRow]
    memory: MemoryEstimate
    forward: Simulation
    backward: Simulation | None
    other_collectives: Counter = field(default_factory=Counter)  # (kind, unit label) not matching a unit row
    graphs: list[GraphReport] = field(default_factory=list, repr=False)  # the lowered forward (and backward)
    group_sizes: dict[str, int] = field(default_factory=dict)  # process group name -> size
    # process group name -> the world mesh dimension whose group it is ("dp", "tp"), where fully_shard got a mesh
    group_roles: dict[str, str] = field(default_factory=dict)
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # process group name -> its ranks
    extras: StepExtras = field(default_factory=StepExtras)  # the optimizer step and the allocator
    attention_window: int | None = None

    @property
    def step_time(self) -> float:
        """The forward and backward (their collectives included), then the optimizer step and clipping."""
        return (self.backward or self.forward).end + self.optimizer_time

    @property
    def optimizer_time(self) -> float:
        return self.extras.optimizer_seconds(self.hardware)

    @property
    def optimizer_state_bytes(self) -> int:
        return self.extras.state_bytes()

    @functools.cached_property
    def reserved_bytes(self) -> int:
        """The CUDA caching allocator's peak reserved bytes for this plan (`passes.allocator`; over two steps,
        the optimizer's state and temporaries included): what `torch.cuda.max_memory_reserved` reports."""
        return self.extras.reserved_bytes(self.memory)

    @property
    def comm_time(self) -> float:
        return sum(s.comm_time for s in self._simulations)

    @property
    def exposed_comm(self) -> float:
        return sum(s.exposed_comm for s in self._simulations)

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm / self.step_time if self.step_time > 0 else 0.0

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends per step under ring algorithms: (n-1)/n of each gather's and reduce-scatter's
        payload over a group of n, twice that for an all-reduce."""
        return sum(self.sent_bytes_by_group.values())

    @property
    def sent_bytes_by_group(self) -> dict[str, float]:
        """`sent_bytes` per process group, by the group's role (`group_roles`: the world mesh dimension, e.g. "dp",
        "tp") where known, else its name. Each collective is sized by its own group (a tensor-parallel all-reduce
        by the tp dimension's size)."""
        sent: Counter = Counter()
        for graph in self.graphs:
            for node, kind, _ in iter_collectives(graph.graph):
                n, payload, _ = collective_cost(node, self.hardware, self.world, self.group_sizes)
                if n > 1:
                    group = bind_args(node).get("group_name")
                    sent[self.group_roles.get(group, group)] += (
                        payload * (n - 1) / n * (2 if kind == "all_reduce" else 1)
                    )
        return dict(sent)

    @property
    def compression(self) -> CompressionCost:
        """The compressed collectives' bytes against the uncompressed ones, and the codec kernels' time."""
        cost = CompressionCost()
        for graph in self.graphs:
            cost.add(graph.graph, self.hardware, self.world, self.group_sizes)
        return cost

    @property
    def peak_memory_bytes(self) -> int:
        """Persistent bytes (flat shards, buffers, the batch) plus the peak of what the step allocates, with the
        optimizer's state (and its step's temporaries) when `explain(optimizer=...)` planned one: the peak
        `torch.cuda.max_memory_allocated` reports."""
        return self.extras.peak_bytes(self.memory)

    @property
    def _simulations(self) -> list[Simulation]:
        return [self.forward] + ([self.backward] if self.backward is not None else [])

    def with_hardware(self, hardware: str | Hardware, **overrides) -> ExplainReport:
        """The same plan timed on other hardware (a preset name or a `Hardware`; keyword arguments override its
        fields, e.g. `link_bytes_per_s=100e9`), without compiling again."""
        hw = dataclasses.replace(_hardware(hardware), **overrides)
        forward, backward = _simulate(
            self.graphs,
            hw,
            self.world,
            self.group_sizes,
            self.executor == "inductor",
            self.group_ranks,
            self.attention_window,
        )
        return dataclasses.replace(self, hardware=hw, forward=forward, backward=backward)

    def to_text(self) -> str:
        """The report for people: hardware, the unit table, peak memory and where, step time and exposure."""
        hw = self.hardware
        lines = [
            f"fsdp_graph.explain: {self.world} ranks, hardware {hw.name} ({hw.flops_per_s / 1e12:g} TFLOP/s, "
            f"{hw.memory_bytes_per_s / 1e9:g} GB/s memory, {hw.link_bytes_per_s / 1e9:g} GB/s link, "
            f"{hw.link_latency_s * 1e6:g} us latency), memory as executed by {self.executor}",
            "",
        ]
        header = ("unit", "params", "unsharded MiB", "shard MiB/rank", "gathers", "reduce-scatters", "all-reduces")
        rows = [
            (
                r.label,
                f"{r.params:,}",
                f"{r.unsharded_bytes / _MIB:.3f}",
                f"{r.shard_bytes / _MIB:.3f}",
                str(r.gathers),
                str(r.reduce_scatters),
                str(r.all_reduces),
            )
            for r in self.units
        ]
        totals = [sum(getattr(r, a) for r in self.units) for a in ("params", "unsharded_bytes", "shard_bytes")]
        counts = [sum(getattr(r, a) for r in self.units) for a in ("gathers", "reduce_scatters", "all_reduces")]
        rows.append(
            ("total", f"{totals[0]:,}", f"{totals[1] / _MIB:.3f}", f"{totals[2] / _MIB:.3f}", *map(str, counts))
        )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        lines.append("(collectives per training step, forward + backward)")
        for (kind, unit), n in sorted(self.other_collectives.items()):
            # A unit's row counts our collectives; others (tensor parallel's, DTensor's) carry no unit label.
            lines.append(f"also {n} x {kind} " + ("outside the units" if unit == "None" else f"labelled {unit!r}"))
        by_group = self.sent_bytes_by_group
        if by_group:
            sizes = {self.group_roles.get(g, g): n for g, n in self.group_sizes.items()}
            lines.append(
                "sent per step, by group: "
                + ", ".join(
                    f"{g} ({sizes.get(g, self.world)} ranks) {b / _MIB:.3f} MiB" for g, b in sorted(by_group.items())
                )
            )
        compression = self.compression
        if compression.collectives:
            lines.append(
                f"compressed ({'/'.join(sorted(compression.schemes))}): {compression.collectives} collectives send "
                f"{compression.sent_bytes / _MIB:.3f} MiB instead of {compression.uncompressed_sent_bytes / _MIB:.3f} "
                f"MiB; quantize/dequantize kernels {_fmt_time(compression.codec_seconds)}"
            )
        peak = self.memory.peak
        stage = {"fw": "forward", "bw": "backward"}[peak.stage]
        lines += [
            "",
            f"peak memory per rank: {self.peak_memory_bytes / _MIB:.3f} MiB = "
            f"{self.memory.persistent_bytes / _MIB:.3f} MiB persistent (flat shards, buffers, batch) + "
            f"{self.memory.peak_bytes / _MIB:.3f} MiB live at {stage} node `{peak.node}` "
            f"(unit {unit_name(peak.unit)})",
            f"step time: {_fmt_time(self.step_time)} (forward {_fmt_time(self.forward.duration)}"
            + (f", backward {_fmt_time(self.backward.duration)}" if self.backward else "")
            + f"); communication {_fmt_time(self.comm_time)}, exposed {_fmt_time(self.exposed_comm)} "
            f"({100 * self.exposed_fraction:.1f}% of the step)",
        ]
        if self.extras.optimizer is not None:
            opt = self.extras.optimizer
            lines.append(
                f"optimizer: {opt.name} ({opt.implementation}{', clipping' if opt.clip else ''}), state "
                f"{self.optimizer_state_bytes / _MIB:.3f} MiB, step {_fmt_time(self.optimizer_time)} (in the step time)"
            )
        lines.append(f"reserved by the caching allocator: {self.reserved_bytes / _MIB:.3f} MiB")
        return "\n".join(lines)

    def save(self, path: str) -> None:
        """Draw the timeline (compute lane, communication lane, memory curve) and save it (PNG by extension)."""
        from fsdp_graph.planning.plot import draw

        draw(self, path)


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _default_loss(output):
    """A scalar output is the loss; else `.loss` / `["loss"]`; else the sum of every floating-point output."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if not isinstance(output, torch.Tensor) and getattr(output, "loss", None) is not None:
        return output.loss
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.sum() for t in leaves)


def _step(model: nn.Module, loss_fn: Callable | None, args: tuple, kwargs: dict):
    # Compiled as a whole: the loss is part of the planned step (its activations often make the peak).
    output = model(*args, **kwargs)
    return loss_fn(output) if loss_fn is not None else _default_loss(output)


@contextmanager
def _state_preserved(model: nn.Module, states: Sequence[FlatParamState]):
    """Gradients, buffers and optimizer-in-backward callbacks come back as they were: explain changes nothing."""
    leaves = list(model.parameters()) + [s.flat_shard for s in states]
    leaves += [s.unsynced for s in states if s.unsynced is not None]
    grads = [t.grad for t in leaves]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    callbacks = [list(s.after_grad) for s in states]
    for t in leaves:
        t.grad = None
    for s in states:
        s.after_grad.clear()  # an optimizer stepping inside backward would change the parameters
    try:
        yield
    finally:
        for t, g in zip(leaves, grads):
            t.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for s, saved_callbacks in zip(states, callbacks):
            s.after_grad[:] = saved_callbacks


_ROW_OF_KIND = {"all_gather": "gathers", "reduce_scatter": "reduce_scatters", "all_reduce": "all_reduces"}


def _unit_rows(states: Sequence[FlatParamState], graphs: Sequence[GraphReport]) -> tuple[list[UnitRow], Counter]:
    """One row per flat parameter. A bucketed collective counts for every unit in its bucket; a gradient
    reduce-scatter done as an all-to-all (gloo) counts as a reduce-scatter."""
    counts: Counter = Counter()
    for report in graphs:
        for node, kind, unit in iter_collectives(report.graph):
            if kind == "all_to_all" and node.meta.get(META_ROLE) == ROLE_REDUCE:
                kind = "reduce_scatter"
            for member in node.meta.get(META_BUCKET) or (unit,):
                counts[(_ROW_OF_KIND.get(kind, kind), member)] += 1
    rows = []
    for s in states:
        layout, shard = s.layout, s.flat_shard
        gathered = torch.empty((), dtype=s.param_dtype or shard.dtype).element_size()
        n = {column: counts.pop((column, s.name), 0) for column in _ROW_OF_KIND.values()}
        rows.append(
            UnitRow(
                s.name,
                layout.numel,
                layout.padded_numel * gathered,
                layout.shard_numel * shard.element_size(),
                s.world,
                n["gathers"],
                n["reduce_scatters"],
                n["all_reduces"],
            )
        )
    return rows, Counter({(kind, str(unit)): n for (kind, unit), n in counts.items()})


def explain(
    model: nn.Module,
    *example_inputs,
    loss_fn: Callable | None = None,
    hardware: str | Hardware = "cpu-gloo",
    example_kwargs: dict | None = None,
    fused_attention: bool = True,
    optimizer: str | torch.optim.Optimizer | OptimizerModel | None = None,
    clip_grad: bool = False,
    attention_window: int | None = None,
    expandable_segments: bool = False,
    fusion: bool | None = None,
    **backend_options,
) -> ExplainReport:
    """Plan one training step of a model sharded with `fully_shard`, on this rank.

    Compiles `loss_fn(model(*example_inputs, **example_kwargs))` (without `loss_fn`: a scalar output, else its
    `.loss` / `["loss"]`, else the sum of the outputs) with `make_backend(inductor=False, keep_graphs=True,
    **backend_options)` (`prefetch`, `max_inflight_bytes`, `bucket_bytes`, ...) into one graph (fullgraph), runs
    it forward and backward once, and puts everything back: gradients, buffers (BatchNorm statistics) and
    `optimizer_in_backward` callbacks (which do not run). The compiled code is dropped afterwards.

    `hardware`: a preset name of `passes.hardware.HARDWARE`: "cpu-gloo", "nvlink", "infiniband", or one of its GPUs
    ("a100", "h100", "h100-hbm2e", "h200", "b200": 8 per node, the rates `plan()` uses); or a `Hardware`.
    `inductor` (a backend option, default True like `make_backend`) picks the executor the memory estimate
    models: Inductor frees each graph input at its last use; the eager-kernel backend holds them until the graph
    returns. The graphs are the same either way; Inductor's buffer reuse is not modelled (its fusion is: `fusion`).
    The process group can be the fake one (`dist.init_process_group("fake", ...)`): collectives then move no
    data, and the plan is the one for that world size.

    `fused_attention` (meta-device models): plan `F.scaled_dot_product_attention` as the memory-efficient fused
    kernel a real device runs (`fsdp_graph.planning.attention`), not the math fallback meta tracing would take (an
    fp32 score matrix per layer). False plans what meta traces.

    `optimizer` (a torch.optim AdamW/Adam/SGD, or a name such as "adamw", "adamw-fused", "sgd-momentum"; see
    `fsdp_graph.planning.optimizer`) adds the optimizer step to the plan: its state to the memory, its time (and
    with `clip_grad`, gradient-norm clipping's) to the step. `attention_window` (tokens) plans causal attention
    as a sliding window of that many keys. `expandable_segments` picks the caching allocator's mode for
    `report.reserved_bytes` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). `fusion` (default: as `inductor`)
    costs kernels as Inductor fuses them (`passes.fusion`); `inductor=True, fusion=False` plans PyTorch without
    torch.compile (one kernel per op, each input freed at its last use).
    """
    module = getattr(model, "_orig_mod", model)  # a torch.compile'd module: plan the module itself
    states = flat_params(module)
    if not states:
        raise ValueError(
            "fsdp_graph.explain() needs a sharded model: call fsdp_graph.fully_shard(model) first "
            f"(got an unsharded {type(module).__name__})."
        )
    hardware = _hardware(hardware)
    model_of_optimizer = None if optimizer is None else optimizer_model(optimizer, clip_grad)
    inductor = bool(backend_options.pop("inductor", True))
    fused = inductor if fusion is None else fusion
    backend = make_backend(inductor=False, keep_graphs=True, **backend_options)
    # Static shapes: Dynamo would otherwise make a plan depend on the shapes earlier plans traced (automatic dynamic).
    compiled = torch.compile(_step, backend=backend, fullgraph=True, dynamic=False)
    meta_kernels = fused_attention_on_meta() if fused_attention else nullcontext()
    with _state_preserved(module, states), meta_kernels, random_ops_on_meta():
        try:
            loss = compiled(module, loss_fn, tuple(example_inputs), dict(example_kwargs or {}))
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
        finally:
            torch._dynamo.reset_code(_step.__code__)  # repeated plans never pile up compiled code or recompiles
    forward = [r for r in backend.reports if r.stage in ("fw", "inference")]
    backward = [r for r in backend.reports if r.stage == "bw"]
    if len(forward) != 1 or len(backward) > 1:
        raise RuntimeError(
            f"fsdp_graph.explain(): expected one forward graph and at most one backward, got {backend.reports}"
        )
    graphs = forward + backward
    if backward and _ignores_gradient(backward[0].graph):
        raise RuntimeError(
            "fsdp_graph.explain(): the compiled backward does not use the loss's gradient, so the plan would be "
            "wrong. Some op of the step has no autograd formula on this device: on the meta device (torch 2.13) "
            "cross_entropy/nll_loss is one; write the loss as -logits.log_softmax(-1).gather(-1, target[..., None])"
            ".mean(), or plan a model on the cpu."
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    group_sizes = {s.group_name: s.world for s in states}
    group_sizes.update({s.replicate_group: s.replicate_world for s in states if s.replicate_group})
    group_sizes.update({s.post_forward_group: s.post_forward_world for s in states if s.post_forward_group})
    group_sizes.update({s.piece_group: s.world // s.post_forward_world for s in states if s.piece_group})
    group_sizes.update(other_group_sizes(graphs, group_sizes))
    ranks = group_ranks(group_sizes)
    fw_sim, bw_sim = _simulate(graphs, hardware, world, group_sizes, fused, ranks, attention_window)
    memory = estimate_memory(
        graphs[0].graph, graphs[1].graph if backward else None, release_inputs=inductor, fused=fused
    )
    rows, other = _unit_rows(states, graphs)
    executor = ("inductor" if fused else "unfused kernels") if inductor else "eager kernels"
    extras = StepExtras(model_of_optimizer, _param_elements(states), states[0].world, expandable_segments)
    return ExplainReport(
        world,
        hardware,
        executor,
        rows,
        memory,
        fw_sim,
        bw_sim,
        other,
        graphs,
        group_sizes,
        group_roles(states, list(group_sizes)),
        ranks,
        extras,
        attention_window,
    )


def _param_elements(states: Sequence[FlatParamState]) -> tuple[int, ...]:
    """Elements of this rank's shard of every trainable parameter (what the optimizer steps): each slot's share of
    its unit's shard."""
    elements = []
    for state in states:
        if not state.flat_shard.requires_grad:  # a unit's frozen parameters: nothing to step
            continue
        total = state.layout.numel
        for slot in state.layout.slots:
            elements.append(-(-slot.numel * state.layout.shard_numel // max(total, 1)))
    return tuple(elements)


def _ignores_gradient(bw: fx.GraphModule) -> bool:
    """No incoming gradient (AOT autograd names them tangents_N) is read by the backward. Other placeholders are
    saved forward values, whose names need not match a forward node's."""
    tangents = [n for n in bw.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    return bool(tangents) and all(not n.users for n in tangents)


def _hardware(hardware: str | Hardware) -> Hardware:
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}: use one of {sorted(HARDWARE)} or a passes.cost.Hardware")
    return HARDWARE[hardware]


def _simulate(
    graphs: Sequence[GraphReport],
    hardware: Hardware,
    world: int,
    group_sizes: dict[str, int],
    fused: bool = False,
    group_ranks: Mapping[str, tuple[int, ...]] | None = None,
    attention_window: int | None = None,
) -> tuple[Simulation, Simulation | None]:
    options = {
        "group_sizes": group_sizes,
        "fused": fused,
        "group_ranks": group_ranks,
        "attention_window": attention_window,
    }
    forward = simulate(graphs[0].graph, hardware, world, **options)
    if len(graphs) < 2:
        return forward, None
    return forward, simulate(graphs[1].graph, hardware, world, start=forward.end, **options)
