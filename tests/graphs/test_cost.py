"""The cost model (passes/cost.py) on hand-built graphs with exact expected numbers, and explain() on the fake PG."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_graph
from fsdp_graph.ir import META_ROLE, META_UNIT, ROLE_REDUCE, ROLE_UNSHARD
from fsdp_graph.runtime.unit import flat_params
from passes.cost import Hardware, collective_cost, node_flops, simulate, unit_labels
from passes.memory import estimate_memory
from tests.graphs.capture import TwoBlock
from tests.workers.models import GPT, GPTConfig

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
AG, RS, AR, WAIT = (
    c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
    c10d.wait_tensor.default,
)
# Round numbers: 1 GFLOP/s, free memory traffic, 10 MB/s links with 10 us per ring step.
ROUND = Hardware("round", flops_per_s=1e9, memory_bytes_per_s=math.inf, link_bytes_per_s=1e7, link_latency_s=10e-6)


class Builder:
    """An FX graph whose nodes carry meta vals computed on the meta device (or given), named as asked."""

    def __init__(self):
        self.graph = fx.Graph()

    def input(self, name: str, *shape: int) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, device="meta")
        return node

    def __call__(self, name: str, target, *args, unit: str | None = None, role: str | None = None) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, name=name)
        node.meta["val"] = target(*fx.map_arg(args, lambda n: n.meta["val"]))
        if unit is not None:
            node.meta.update({META_UNIT: unit, META_ROLE: role})
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def forward_and_backward() -> tuple[fx.GraphModule, fx.GraphModule]:
    """A one-unit step. Forward: gather the flat param p, h = x @ W, a = relu(h), loss = a.sum(); a is saved.
    Backward: re-gather, grad of x, grad of W reduce-scattered while relu(gx) runs, then div."""
    f = Builder()
    p, x = f.input("p", 100), f.input("x", 10, 20)  # 400 + 800 B persistent
    ag = f("ag", AG, p, 4, "0", unit="u", role=ROLE_UNSHARD)  # 1600 B, allocated when issued
    w = f("w", WAIT, ag, unit="u", role=ROLE_UNSHARD)
    weight = f("weight", aten.view.default, w, [20, 20])
    h = f("h", aten.mm.default, x, weight)  # 800 B
    a = f("a", aten.relu.default, h)  # 800 B, saved for backward
    loss = f("loss", aten.sum.default, a)
    fw = f.done(loss, p, a)

    b = Builder()
    p, a, tangent = b.input("p", 100), b.input("a", 10, 20), b.input("tangents_1")
    ag2 = b("ag2", AG, p, 4, "0", unit="u", role=ROLE_UNSHARD)
    g = b("g", aten.expand.default, tangent, [10, 20])
    gr = b("gr", aten.threshold_backward.default, g, a, 0)  # 800 B; a and the tangent die here
    w2 = b("w2", WAIT, ag2, unit="u", role=ROLE_UNSHARD)
    wt = b("wt", aten.view.default, w2, [20, 20])
    t = b("t", aten.t.default, wt)
    gx = b("gx", aten.mm.default, gr, t)  # 800 B; the gathered W dies here
    gw = b("gw", aten.mm.default, b("tgr", aten.t.default, gr), gr)  # 1600 B
    rs = b("rs", RS, b("flat", aten.view.default, gw, [400]), "sum", 4, "0", unit="u", role=ROLE_REDUCE)
    gx2 = b("gx2", aten.relu.default, gx)  # 800 B, while the reduce-scatter still holds gw
    ws = b("ws", WAIT, rs, unit="u", role=ROLE_REDUCE)
    d = b("d", aten.div.Tensor, ws, 4)
    return fw, b.done(d, gx2)


def test_memory_liveness_exact():
    fw, bw = forward_and_backward()
    est = estimate_memory(fw, bw)
    assert est.persistent_bytes == 1200 and est.outputs_bytes == 1200
    by_node = {(p.stage, p.node): p.bytes for p in est.curve}
    assert by_node[("fw", "ag")] == 1600  # the gather's buffer exists from its issue on
    assert by_node[("fw", "h")] == 2400  # gathered W + h
    assert by_node[("fw", "loss")] == 804  # W freed after its last view's use; h after relu
    assert by_node[("bw", "tangents_1")] == 804  # the saved activation crossed over, the tangent arrived
    assert by_node[("bw", "gr")] == 3204
    assert by_node[("bw", "gx")] == 3200  # a and the tangent died at threshold_backward
    # gw stays live until the reduce-scatter's wait (the work holds its input): gx + gw + rs + gx2.
    assert by_node[("bw", "gx2")] == 3600
    assert by_node[("bw", "output")] == 1200  # the gradient shard and gx2
    assert (est.peak_bytes, est.peak.stage, est.peak.node, est.peak.unit) == (3600, "bw", "gx2", "u")
    assert est.total_peak_bytes == 4800


def test_memory_executor_holding_inputs():
    """The eager-kernel executor keeps the backward's inputs (a, the tangent) until it returns: +804 B at gx2."""
    fw, bw = forward_and_backward()
    est = estimate_memory(fw, bw, release_inputs=False)
    assert (est.peak_bytes, est.peak.node) == (4404, "gx2")


def test_memory_forward_only():
    fw, _ = forward_and_backward()
    est = estimate_memory(fw)
    assert (est.peak_bytes, est.peak.node, len(est.curve)) == (2400, "h", 9)


def test_unit_labels_follow_gathered_params():
    b = Builder()
    p0, p1, x = b.input("p0", 8), b.input("p1", 8), b.input("x", 2, 4)
    a0 = b("a0", AG, p0, 2, "0", unit="blocks.0", role=ROLE_UNSHARD)
    a1 = b("a1", AG, p1, 2, "0", unit="", role=ROLE_UNSHARD)  # prefetched root
    w0 = b("w0", WAIT, a0, unit="blocks.0", role=ROLE_UNSHARD)
    w1 = b("w1", WAIT, a1, unit="", role=ROLE_UNSHARD)
    h = b("h", aten.mm.default, x, b("v0", aten.view.default, w0, [4, 4]))
    r = b("r", aten.relu.default, h)
    out = b("out", aten.mm.default, r, b("v1", aten.view.default, w1, [4, 4]))
    gm = b.done(out)
    labels = dict(zip([n.name for n in gm.graph.nodes], unit_labels(gm)))
    assert labels["x"] == labels["a0"] == "blocks.0"  # before the first labelled node: its label
    assert labels["a1"] == labels["w1"] == ""
    assert labels["h"] == labels["r"] == "blocks.0"  # h reads blocks.0's weight; relu inherits
    assert labels["out"] == ""  # reads the root's weight although blocks.0's wait came last but one


def _overlap_graph(early: bool) -> fx.GraphModule:
    b = Builder()
    p, x, y = b.input("p", 500), b.input("x", 10, 50), b.input("y", 50, 100)
    if early:
        ag = b("ag", AG, p, 2, "0", unit="u", role=ROLE_UNSHARD)
        h = b("h", aten.mm.default, x, y)  # 2 * 10 * 50 * 100 = 1e5 flops: 100 us
    else:
        h = b("h", aten.mm.default, x, y)
        ag = b("ag", AG, p, 2, "0", unit="u", role=ROLE_UNSHARD)
    s = b("s", aten.sum.default, b("w", WAIT, ag, unit="u", role=ROLE_UNSHARD))
    return b.done(h, s)


def test_gather_issued_early_overlaps_compute():
    # 4000 B gathered over 2 ranks: 1 ring step of 10 us + 2000 B at 10 MB/s = 210 us.
    sim = simulate(_overlap_graph(early=True), ROUND, world=2)
    assert sim.comm_time == pytest.approx(210e-6) and sim.compute_time == pytest.approx(100e-6)
    assert sim.exposed_comm == pytest.approx(110e-6)  # waits at 100 us for a gather ending at 210 us
    assert sim.end == pytest.approx(210e-6) and sim.flops == 1e5
    bars = {(e.lane, e.kind): (e.start, e.end, e.label) for e in sim.events}
    assert bars[("comm", "all_gather")][:2] == pytest.approx((0.0, 210e-6))
    assert bars[("comm", "all_gather")][2] == "all_gather u"
    assert bars[("compute", "wait")][:2] == pytest.approx((100e-6, 210e-6))


def test_gather_issued_late_is_exposed():
    sim = simulate(_overlap_graph(early=False), ROUND, world=2)
    assert sim.exposed_comm == pytest.approx(210e-6) and sim.end == pytest.approx(310e-6)
    node_times = dict(zip([n.name for n in _overlap_graph(False).graph.nodes], sim.node_times))
    assert node_times["w"] == pytest.approx((100e-6, 310e-6))


def test_comm_lane_is_serial_and_ring_costs():
    b = Builder()
    p, g = b.input("p", 500), b.input("g", 1000)
    a1 = b("a1", AG, p, 2, "0")
    a2 = b("a2", AG, p, 2, "0")
    rs = b("rs", RS, g, "sum", 4, "0")  # 3 steps of (10 us + 1000 B / 10 MB/s) = 330 us
    ar = b("ar", AR, g, "sum", "replicas")  # 2 * 3 steps (group of 4 from the mapping) = 660 us
    outs = [b(f"w{i}", WAIT, n) for i, n in enumerate((a1, a2, rs, ar))]
    gm = b.done(*outs)
    sim = simulate(gm, ROUND, world=2, group_sizes={"replicas": 4})
    comm = [(e.label, e.start, e.end) for e in sim.events if e.lane == "comm"]
    assert [c[0] for c in comm] == ["all_gather", "all_gather", "reduce_scatter", "all_reduce"]
    ends = [c[2] for c in comm]
    assert ends == pytest.approx([210e-6, 420e-6, 750e-6, 1410e-6])
    assert sim.exposed_comm == pytest.approx(1410e-6) and sim.end == pytest.approx(1410e-6)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert collective_cost(nodes["ar"], ROUND, 2, {"replicas": 4}) == (4, 4000, pytest.approx(660e-6))
    assert collective_cost(nodes["ar"], ROUND, 2)[0] == 2  # no mapping: the world


def test_flops_of_cpu_attention():
    b = Builder()
    q = b.input("q", 2, 4, 16, 8)
    attn = b("attn", aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q)
    b.done(attn)
    assert node_flops(attn) == 2 * (2 * 2 * 4 * 16 * 16 * 8)  # QK^T and (softmax) V


def _gpt(device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig())
    fsdp_graph.fully_shard(model, device=device if device == "meta" else None)
    idx = torch.randint(0, 96, (4, 16), device=device)
    return model, idx


def _ce(idx):
    return lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())


def test_explain_world_4(fake_pg, tmp_path):
    model, idx = _gpt()
    sentinel = torch.ones_like(next(model.parameters()))
    first = next(model.parameters())
    first.grad = sentinel
    calls = []
    states = fsdp_graph.runtime.unit.flat_params(model)
    states[0].after_grad.append(lambda: calls.append(1))  # e.g. optimizer_in_backward: must not step
    report = fsdp_graph.explain(model, idx, loss_fn=_ce(idx), hardware="nvlink")
    assert first.grad is sentinel and calls == [] and len(states[0].after_grad) == 1
    assert all(p.grad is None for p in list(model.parameters())[1:])

    rows = {r.unit: r for r in report.units}
    assert list(rows) == ["blocks.0", "blocks.1", ""]
    for state in states:
        row = rows[state.name]
        assert row.params == state.layout.numel and row.world == 4
        assert row.shard_bytes == 4 * state.layout.padded_numel // 4
        assert row.unsharded_bytes == 4 * state.layout.padded_numel
        assert (row.gathers, row.reduce_scatters, row.all_reduces) == (2, 1, 0)  # FULL_SHARD re-gathers
    assert report.world == 4 and not report.other_collectives
    assert report.peak_memory_bytes == report.memory.persistent_bytes + report.memory.peak_bytes > 0
    assert report.memory.persistent_bytes >= sum(r.shard_bytes for r in report.units)
    assert 0 < report.exposed_comm <= report.comm_time and report.step_time == report.backward.end
    text = report.to_text()
    for needle in ("blocks.0", "blocks.1", "<root>", "peak memory per rank", "exposed", "4 ranks", "nvlink"):
        assert needle in text, text
    fast = report.with_hardware("nvlink", link_latency_s=0.0)  # re-timed without compiling again
    slow = report.with_hardware(fast.hardware, link_bytes_per_s=20e9)
    assert slow.comm_time == pytest.approx(fast.comm_time * 10) and slow.memory is report.memory

    path = tmp_path / "schedule.png"
    report.save(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def _lm_loss(idx):
    """Cross-entropy from ops that have meta autograd kernels (nll_loss has none in torch 2.13)."""
    return lambda logits: -logits.log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()


def test_explain_plans_64_ranks_from_a_meta_model():
    """A meta-device model runs no kernel, so any size plans on one machine. The units and collectives are the
    CPU model's; memory differs only where kernels are chosen per device (on meta, attention plans as the fused kernel)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    try:
        model, idx = _gpt()
        cpu = fsdp_graph.explain(model, idx, loss_fn=_lm_loss(idx))
        meta_model, meta_idx = _gpt("meta")
        meta = fsdp_graph.explain(meta_model, meta_idx, loss_fn=_lm_loss(meta_idx))
        with pytest.raises(RuntimeError, match="does not use the loss's gradient"), pytest.warns(UserWarning):
            fsdp_graph.explain(meta_model, meta_idx, loss_fn=_ce(meta_idx))
    finally:
        dist.destroy_process_group()
    assert cpu.world == meta.world == 64
    blocks = {  # the rows layout: every parameter's Shard(0) block, ceil(d0 / 64) rows
        state.name: sum(math.ceil(s.shape[0] / 64) * s.shape[1:].numel() for s in state.layout.slots)
        for state in flat_params(model)
    }
    for row in cpu.units:
        assert row.shard_bytes == 4 * blocks[row.unit] and row.params == sum(
            s.numel for state in flat_params(model) if state.name == row.unit for s in state.layout.slots
        )
    assert cpu.units == meta.units
    assert cpu.comm_time == pytest.approx(meta.comm_time)
    assert cpu.memory.persistent_bytes == meta.memory.persistent_bytes
    assert 1.0 <= meta.memory.peak_bytes / cpu.memory.peak_bytes < 1.1  # the math attention's scores


def test_explain_prefetch_hides_communication(fake_pg):
    model, idx = _gpt()
    on = fsdp_graph.explain(model, idx, loss_fn=_ce(idx), hardware="nvlink")
    off = fsdp_graph.explain(model, idx, loss_fn=_ce(idx), hardware="nvlink", prefetch=False)
    assert on.comm_time == pytest.approx(off.comm_time)  # the same collectives, in another order
    assert on.exposed_comm < off.exposed_comm == pytest.approx(off.comm_time)  # unscheduled: nothing overlaps


def test_explain_defaults_and_errors(fake_pg):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="fully_shard"):
        fsdp_graph.explain(TwoBlock(), torch.randn(2, 4))
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False)
    with pytest.raises(ValueError, match="unknown hardware"):
        fsdp_graph.explain(model, torch.randn(2, 4), hardware="abacus")
    fsdp_graph.explain(model, torch.randn(3, 4))  # an earlier plan of another shape must not make this one dynamic
    report = fsdp_graph.explain(model, torch.randn(2, 4))  # no loss_fn: the output's sum
    assert report.hardware.name == "cpu-gloo" and report.executor == "inductor"
    assert report.with_hardware("h200").hardware.name == "h200"  # plan()'s GPU presets, by name
    # The backward needs blocks.0's weights only for the input's gradient, which nothing asks for: no re-gather.
    assert [(r.unit, r.gathers) for r in report.units] == [("blocks.0", 1), ("blocks.1", 2), ("", 2)]
    eager = fsdp_graph.explain(model, torch.randn(2, 4), inductor=False)
    assert eager.executor == "eager kernels" and eager.memory.peak_bytes >= report.memory.peak_bytes


def test_memory_looks_into_a_region_body():
    """A shared block body (`invoke_subgraph`) is looked into: its temporaries count while it runs, the tensor it
    returns lives on, and an input it returns (AOT saves the block's input that way) is the caller's own tensor."""
    body = Builder()
    bx, bw = body.input("x", 10, 20), body.input("w", 20, 40)
    h = body("h", aten.mm.default, bx, bw)  # 1600 B, freed inside the body
    a = body("a", aten.relu.default, h)  # 1600 B, returned
    root = torch.nn.Module()
    root.body = body.done(a, bx)

    f = Builder()
    x, p = f.input("x", 10, 20), f.input("p", 800)  # 800 + 3200 B persistent
    weight = f("weight", aten.view.default, p, [20, 40])
    operands = (f.graph.get_attr("body"), "body", x, weight)
    call = f.graph.create_node("call_function", torch.ops.higher_order.invoke_subgraph, operands, name="call")
    call.meta["val"] = (a.meta["val"], bx.meta["val"])
    out = f.graph.create_node("call_function", operator.getitem, (call, 0), name="out")
    out.meta["val"] = a.meta["val"]
    loss = f("loss", aten.sum.default, out)
    f.graph.output((loss,))
    fw = fx.GraphModule(root, f.graph)

    est = estimate_memory(fw)
    by_node = {p.node: p.bytes for p in est.curve}
    assert est.persistent_bytes == 4000
    assert by_node["call"] == 3200  # the body's relu runs while its mm's output is still live
    assert by_node["loss"] == 1604  # only the returned activation is left (the returned input is no copy)
    assert (est.peak_bytes, est.peak.node) == (3200, "call")
