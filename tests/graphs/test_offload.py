"""CPU offload on the host: gradients read only after their asynchronous copy, pinned shards stay pinned.

Without an accelerator nothing is asynchronous, so these tests observe the ordering through a fake event and
treat the CPU compute device as an accelerator, and observe pinning through a fake `pin_memory`."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fsdp_graph
from fsdp_graph.api.sync import reduce_accumulated
from fsdp_graph.runtime import offload
from fsdp_graph.runtime.flat_param import FlatParamLayout
from fsdp_graph.runtime.grads import install_grad_hook
from fsdp_graph.runtime.offload import GradFence
from fsdp_graph.runtime.unit import flat_params
from tests.graphs.capture import TwoBlock

CPU, META = torch.device("cpu"), torch.device("meta")


class _Log(list):
    watch = None  # what to note at each wait, e.g. whether a gradient was handed out before it

    def event(self, device: torch.device):
        log = self

        class FakeEvent:
            def synchronize(self) -> None:
                log.append("synchronize" if log.watch is None else ("synchronize", log.watch()))

        self.append(("record", device))
        return FakeEvent()


def test_grad_fence_hands_out_the_gradient_after_waiting_for_its_copy():
    log = _Log()
    flat = torch.zeros(4, requires_grad=True)
    view = nn.Parameter(flat.detach()[1:3])
    fence = GradFence(make_event=log.event)
    layout = FlatParamLayout.build(
        [(("a",), torch.Size([1])), (("v",), torch.Size([2])), (("b",), torch.Size([1]))], 1, 0
    )
    frozen = [nn.Parameter(flat.detach()[i : i + 1], requires_grad=False) for i in (0, 3)]
    step = [lambda: log.append(("step", view.grad.tolist()))]
    install_grad_hook(flat, [frozen[0], view, frozen[1]], layout, step, fence=(fence, CPU))
    log.watch = lambda: None if view.grad is None else view.grad.tolist()

    (flat * torch.arange(4.0)).sum().backward()
    assert log == [("record", CPU), ("synchronize", None), ("step", [1.0, 2.0])]

    log.clear()  # the next backward accumulates, again only after its wait
    (flat * 2).sum().backward()
    assert log == [("record", CPU), ("synchronize", [1.0, 2.0]), ("step", [3.0, 4.0])]


def test_grad_fence_drops_the_work_of_a_backward_that_raised():
    log = _Log()
    flat = torch.zeros(2, requires_grad=True)
    view = nn.Parameter(flat.detach())
    layout = FlatParamLayout.build([(("v",), torch.Size([2]))], 1, 0)
    install_grad_hook(flat, [view], layout, [lambda: log.append("step")], fence=(GradFence(log.event), CPU))

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom")

    failing = Fail.apply(torch.zeros((), requires_grad=True))  # made first: the engine runs it last
    with pytest.raises(RuntimeError, match="boom"):
        (flat.sum() + failing).backward()
    assert log == [("record", CPU)]  # deferred, never run: the backward raised before its end
    log.clear()
    flat.sum().backward()
    assert log == [("record", CPU), "synchronize", "step"] and view.grad.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("compiled", [False, True])
def test_offloaded_optimizer_in_backward_steps_after_the_copies(fake_pg, monkeypatch, compiled):
    """Every unit records an event during the backward; each optimizer step runs after its wait, at the end."""
    log = _Log()
    monkeypatch.setattr(offload, "is_accelerator", lambda device: device is not None)  # the CPU plays the GPU
    monkeypatch.setattr(offload, "recorded_event", log.event)
    model = fsdp_graph.fully_shard(TwoBlock(), cpu_offload=fsdp_graph.CPUOffload(offload_params=True), device="cpu")
    for opt in fsdp_graph.optimizer_in_backward(model, torch.optim.SGD, lr=0.1):
        opt.register_step_pre_hook(lambda *args: log.append("step"))
    step = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False)) if compiled else model
    step(torch.randn(2, 4)).sum().backward()
    units = len(flat_params(model))
    assert log == [("record", CPU)] * units + ["synchronize", "step"] * units


def test_offload_without_an_accelerator_defers_nothing(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock(), cpu_offload=fsdp_graph.CPUOffload(offload_params=True), device="cpu")
    grads = []
    fsdp_graph.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    flat_params(model)[0].after_grad.insert(0, lambda: grads.append(torch._C._current_graph_task_id()))
    model(torch.randn(2, 4)).sum().backward()
    assert len(grads) == 1 and grads[0] != -1  # handed out inside the backward, as without offload


@pytest.fixture
def fake_pinning(monkeypatch):
    """A CUDA machine's pinning, on the CPU: `pin_memory()` returns a marked copy, `is_pinned()` reads the mark."""

    def pin_memory(self, device=None):
        copy = self.clone()
        copy._fake_pinned = True
        return copy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: getattr(self, "_fake_pinned", False))


def test_offloaded_shards_stay_pinned_after_conversions(fake_pg, fake_pinning):
    model = fsdp_graph.fully_shard(TwoBlock(), cpu_offload=fsdp_graph.CPUOffload(offload_params=True), device="cpu")
    assert all(state.flat_shard.is_pinned() for state in flat_params(model))
    model.double()
    assert all(state.flat_shard.is_pinned() and state.flat_shard.dtype == torch.float64 for state in flat_params(model))
    model.to("cpu", torch.float32)
    assert all(state.flat_shard.is_pinned() and state.flat_shard.dtype == torch.float32 for state in flat_params(model))


def test_shards_without_offload_are_not_pinned(fake_pg, fake_pinning):
    model = fsdp_graph.fully_shard(TwoBlock(), device="cpu")
    model.double()
    assert not any(state.flat_shard.is_pinned() for state in flat_params(model))


_READS_NO_DATA = (torch.ops.aten.new_empty_strided.default, torch.ops.aten.new_empty.default)


class _HostReadsOfReduced(TorchDispatchMode):
    """Logs each `fsdp.reduce_grad` output (under offload: the target of an asynchronous device-to-host copy) and
    every later op that reads one's data (on a GPU such a read must wait for the copy; views and allocations like
    it do not read)."""

    def __init__(self, log: list):
        super().__init__()
        self.log, self.reduced = log, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        reads = not func.is_view and func not in _READS_NO_DATA
        if reads and any(t.untyped_storage().data_ptr() in self.reduced for t in tensors):
            self.log.append(("read", func.__name__))
        out = func(*args, **kwargs)
        if func is torch.ops.fsdp.reduce_grad.default:
            self.reduced.add(out.untyped_storage().data_ptr())
            self.log.append("reduced")
        return out


def test_stage_end_reduction_reads_no_offloaded_gradient_before_its_copy(fake_pg, monkeypatch):
    """Issue 27 item 1: `reduce_accumulated` (pipeline stages) handed autograd gradients its own list still held, so
    autograd copied them on the host at once, before their asynchronous device-to-host copies had landed (the
    GradFence only delays the hook). Every read of a reduced gradient must follow a wait on the compute device."""
    log = _Log()
    monkeypatch.setattr(offload, "is_accelerator", lambda device: device is not None)  # the CPU plays the GPU
    monkeypatch.setattr(offload, "recorded_event", log.event)
    model = fsdp_graph.fully_shard(TwoBlock(), cpu_offload=fsdp_graph.CPUOffload(offload_params=True), device="cpu")
    fsdp_graph.set_requires_gradient_sync(model, False)
    model(torch.randn(2, 4)).sum().backward()
    log.clear()
    with _HostReadsOfReduced(log):
        assert reduce_accumulated(model) == len(flat_params(model))
    first_read = next(i for i, entry in enumerate(log) if entry[0] == "read")
    assert "synchronize" in log[:first_read], log
    assert all(p.grad is not None for p in model.parameters())


_DEVICE_MOVES = (torch.ops.prims.device_put.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


def _mixed_device_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes (other than device moves) whose tensor inputs live on more than one device (0-dim CPU scalars aside,
    which torch lets mix): under eager kernels a device mismatch, under Inductor a mixed-device kernel."""
    mixed = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _DEVICE_MOVES:
            continue
        values = [a.meta.get("val") for a in node.all_input_nodes]
        devices = {v.device for v in values if isinstance(v, torch.Tensor) and v.ndim > 0}
        if len(devices) > 1:
            mixed.append(f"{node.format_node()} {sorted(map(str, devices))}")
    return mixed


def test_partial_sums_of_offloaded_units_stay_on_the_compute_device(fake_pg):
    """Issue 27 item 2: with set_requires_all_reduce(False) under CPU offload the partial sum lived on the host, so
    the lowering added the device gradient into a host tensor (and eagerly, autograd accumulated into it while
    the asynchronous copy was in flight). Meta is the compute device: eagerly the partial sums accumulate there;
    compiled, the forward compiles the graphs that add them before the all-reduce, and neither mixes devices (the
    graph without all-reduce has no such add; the eager run shows its partial sums' device)."""
    from torch.distributed.device_mesh import init_device_mesh

    def sharded() -> tuple[nn.Module, list]:
        model = fsdp_graph.fully_shard(
            TwoBlock(),
            init_device_mesh("cpu", (2, 2)),
            strategy=fsdp_graph.ShardingStrategy.HYBRID_SHARD,
            cpu_offload=fsdp_graph.CPUOffload(offload_params=True),
            device="meta",
        )
        return model, [m for m in model.modules() if isinstance(m, fsdp_graph.FSDPModule)]

    model, units = sharded()
    for unit in units:
        unit.set_requires_all_reduce(False)
    for _ in range(2):  # the second adds into the first's partial sums
        model(torch.randn(2, 4, device="meta")).sum().backward()
    assert [state.partial.grad.device for state in flat_params(model)] == [META] * len(units)

    model, units = sharded()
    for unit in units:  # the graph that adds the partial sums before the all-reduce, as after the loop above
        unit.set_requires_all_reduce(False)
        unit.set_requires_all_reduce(True)
    for state in flat_params(model):
        state.partial.grad = torch.zeros_like(state.partial)
    backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 4, device="meta"))
    assert [r.stage for r in backend.reports] == ["fw", "bw"]
    assert [_mixed_device_nodes(r.graph) for r in backend.reports] == [[], []]


@pytest.mark.parametrize("shard_world", [4, 1])
def test_backward_copies_gradients_to_the_host_after_the_last_reduction_issue(fake_pg, shard_world):
    """Issue 27 item 4: Inductor follows each copy into pinned memory with `event.synchronize()`, and each unit's
    device-to-host copy sat in its reduction's tail, mid-backward: one host stall per unit. The schedule groups
    them after the last reduction's issue, with no compute after them (world 1, no reduction: at the end). The CPU
    plays the compute device: the copies are kept."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_graph.ir import COLLECTIVES, META_ROLE, ROLE_REDUCE

    mesh = None if shard_world == 4 else init_device_mesh("cpu", (4, 1), mesh_dim_names=("other", "dp"))["dp"]
    offload = fsdp_graph.CPUOffload(offload_params=True)
    model = fsdp_graph.fully_shard(TwoBlock(), mesh, cpu_offload=offload, device="cpu")
    backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 4)).sum().backward()
    (bw,) = [r.graph for r in backend.reports if r.stage == "bw"]
    nodes = list(bw.graph.nodes)
    reductions = [k for k, n in enumerate(nodes) if n.target in COLLECTIVES and n.meta.get(META_ROLE) == ROLE_REDUCE]
    copies = [
        k
        for k, n in enumerate(nodes)
        if n.target is torch.ops.prims.device_put.default and n.meta.get(META_ROLE) == ROLE_REDUCE
    ]
    computes = [
        k
        for k, n in enumerate(nodes)
        if n.op == "call_function" and n.meta.get(META_ROLE) is None and not getattr(n.target, "is_view", False)
    ]
    assert len(copies) == 3 and len(reductions) == (3 if shard_world == 4 else 0)
    assert min(copies) > max(reductions + computes), (reductions, computes, copies)
