"""Count the collectives that actually execute (torch.profiler), with their payload and wire bytes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile

_ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "signed char": 1,
    "unsigned char": 1,  # pickled objects (all_gather_object, DCP's plans)
    "bool": 1,
    "int": 4,
    "long int": 8,
}
_KINDS = {
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_to_all_single": "all_to_all",
}
# What the process-group backend itself ran (gloo/nccl events): a functional reduce-scatter on gloo shows up as
# `gloo:all_reduce` of the whole tensor.
_BACKEND_PREFIXES = ("gloo:", "nccl:")


@dataclass
class ExecutedCollectives:
    """Per kind: how many ran, their payload (unsharded side: gather output, scatter input, all-reduce
    tensor) in bytes, and the bytes each rank sends with ring algorithms: (N-1)/N of the payload for gathers
    and scatters, 2(N-1)/N for all-reduce, N = the group size the collective ran with."""

    counts: Counter = field(default_factory=Counter)
    payload_bytes: Counter = field(default_factory=Counter)
    wire_bytes: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    backend_counts: Counter = field(default_factory=Counter)  # e.g. {"gloo:all_reduce": 5}
    backend_wire_bytes: Counter = field(default_factory=Counter)  # ring-algorithm bytes each rank sends, per event

    @property
    def total_wire_bytes(self) -> float:
        return sum(self.wire_bytes.values())


def executed_collectives(
    fn: Callable[[], object], group_size_of_all_reduce: int | None = None, group_size: int | None = None
) -> ExecutedCollectives:
    """Run `fn()` under the profiler and count the `_c10d_functional` collectives it executed (eager, compiled
    with eager kernels or with Inductor: all of them call these ops). The profiler does not record group names,
    so all-reduce wire bytes need `group_size_of_all_reduce` (its payload is counted regardless).

    Also counts the events of the process-group backend (`gloo:*`, `nccl:*`): what really went on the wire, with
    ring-algorithm bytes for a group of `group_size` ranks (default: the default group's size)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    result = ExecutedCollectives()
    events = prof.profiler.kineto_results.events()
    _count_backend_events(events, result, group_size)
    for event in events:
        kind = _KINDS.get(event.name())
        if kind is None:
            continue
        numel = 1
        for dim in event.shapes()[0]:
            numel *= dim
        dtype = event.dtypes()[0]
        size = numel * _ELEMENT_BYTES[dtype]
        inputs = event.concrete_inputs()
        if kind == "all_gather":
            n = int(inputs[1])
            payload, wire = size * n, size * (n - 1)
        elif kind == "reduce_scatter":
            n = int(inputs[2])
            payload, wire = size, size * (n - 1) / n
        elif kind == "all_to_all":  # the split sizes list has one entry per rank of the group
            n = len(inputs[1]) if isinstance(inputs[1], list) else _default_group_size(group_size)
            payload, wire = size, size * (n - 1) / n
        else:
            n = group_size_of_all_reduce
            payload, wire = size, (0.0 if n is None else 2 * size * (n - 1) / n)
        result.counts[kind] += 1
        result.payload_bytes[kind] += payload
        result.wire_bytes[kind] += wire
        result.dtypes[(kind, dtype)] += 1
    return result


def _default_group_size(group_size: int | None) -> int:
    import torch.distributed as dist

    return group_size or (dist.get_world_size() if dist.is_initialized() else 1)


def _count_backend_events(events, result: ExecutedCollectives, group_size: int | None) -> None:
    n = _default_group_size(group_size)
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "all_to_all": (n - 1) / n}
    factor["reduce_scatter"] = (n - 1) / n
    for event in events:
        name = event.name()
        if not name.startswith(_BACKEND_PREFIXES) or not event.shapes() or not event.shapes()[0]:
            continue
        numel = 1
        for dim in event.shapes()[0]:
            numel *= dim
        size = numel * _ELEMENT_BYTES.get(event.dtypes()[0], 4)
        result.backend_counts[name] += 1
        result.backend_wire_bytes[name] += size * factor.get(name.split(":", 1)[1], 1.0)


def peak_allocated_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """(peak bytes allocated above the starting point while `fn()` ran, fn's result), from the profiler's
    memory events: works on CPU, where no allocator statistics exist."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    running = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak, result


def collectives_per_group(
    fn: Callable[[], object], group_names: list[str] | tuple[str, ...], device: str = "cpu"
) -> dict[str, int]:
    """How many collectives each named process group ran on `device`'s backend during `fn()`, from the sequence
    number that backend keeps (gloo and NCCL count every collective issued on the group). The profiler names no
    groups: this tells apart groups of one size, e.g. `reshard_after_forward=k`'s piece and node groups."""
    import torch
    import torch.distributed as dist

    backends = {}
    for name in dict.fromkeys(group_names):
        backends[name] = dist.distributed_c10d._resolve_process_group(name)._get_backend(torch.device(device))
    before = {name: b._get_sequence_number_for_group() for name, b in backends.items()}
    fn()
    return {name: b._get_sequence_number_for_group() - before[name] for name, b in backends.items()}


def wire_bytes_per_group(fn: Callable[[], object]) -> dict[str, Counter]:
    """Bytes this rank sends with ring algorithms, per process group (by name) and collective kind, while `fn()`
    runs: the functional collectives seen by a dispatch mode, with their groups (which the profiler does not
    record). The `fsdp` ops run their Python bodies under the mode, so their collectives are seen too.

    Eager code only: Dynamo runs a compiled callable's original code under a dispatch mode, so a compiled step
    measured here is its eager path. A compiled graph's collectives, groups and sizes are in its report's
    fingerprint; `collectives_per_group` counts what ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_graph.ir import ops

    bodies = {"unshard": ops.unshard._init_fn, "reduce_grad": ops.reduce_grad._init_fn}
    sent: dict[str, Counter] = {}

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "fsdp" and func._opname in bodies:  # the others (copies, hand-offs) send nothing
                with self:
                    return bodies[func._opname](*args, **kwargs)
            # wait_tensor and _wrap_tensor_autograd (DTensor's async all-reduce wraps its result) send nothing.
            if func.namespace == "_c10d_functional" and func._opname not in ("wait_tensor", "_wrap_tensor_autograd"):
                kind = _KINDS.get(f"_c10d_functional::{func._opname}")
                if kind is None:
                    raise NotImplementedError(f"wire_bytes_per_group: {func} is not counted; add it to _KINDS")
                group = args[-1] if isinstance(args[-1], str) else kwargs["group_name"]
                sent.setdefault(group, Counter())[kind] += _sent_bytes(kind, args[0], group)
            return func(*args, **kwargs)

    with _Count():
        fn()
    return sent


def _sent_bytes(kind: str, tensor, group: str) -> float:
    import torch.distributed as dist

    n = dist.distributed_c10d._resolve_process_group(group).size()
    size = tensor.numel() * tensor.element_size()
    return {"all_gather": size * (n - 1), "all_reduce": 2 * size * (n - 1) / n}.get(kind, size * (n - 1) / n)
