"""Snapshots of the scheduling passes (fake process group, world 4): the order of the nodes is the spec."""

import pytest
import torch
from expecttest import assert_expected_inline

import fsdp_graph
import passes
from fsdp_graph.ir import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVES, META_ROLE, REDUCE_SCATTER, WAIT
from passes import lower_fsdp_ops, reduce_scatter_as_all_to_all, schedule_collectives, tag_reshard
from tests.graphs.capture import TwoBlock, aot_stages, code


def _lowered(strategy=fsdp_graph.ShardingStrategy.FULL_SHARD, **shard_kwargs):
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(), strategy=strategy, reuse_blocks=False, **shard_kwargs)
    stages = aot_stages(model, torch.randn(2, 4), tag=tag_reshard)
    return lower_fsdp_ops(stages.forward), lower_fsdp_ops(stages.backward)


def _collective_order(gm) -> str:
    """Issue and wait nodes in graph order, with the unit and, for waits, the collective waited on."""
    names = {ALL_GATHER: "gather", REDUCE_SCATTER: "scatter", ALL_TO_ALL: "all_to_all"}
    lines = []
    for node in gm.graph.nodes:
        if node.target in names:
            lines.append(f"{names[node.target]}({node.meta['fsdp_unit'] or '<root>'})")
        elif node.target is WAIT:
            lines.append(f"  wait({node.meta['fsdp_unit'] or '<root>'})")
        elif node.op == "call_function" and node.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            lines.append(f"    {node.name}")
    return "\n".join(lines)


def test_schedule_forward_prefetches_within_two_units(fake_pg):
    fw, _ = _lowered()
    assert_expected_inline(
        _collective_order(fw),
        """\
gather(blocks.0)
  wait(blocks.0)
    addmm
gather(blocks.1)
  wait(blocks.1)
    addmm_1
gather(<root>)
  wait(<root>)
    mm""",
    )
    schedule_collectives(fw)
    # blocks.1's gather is issued before blocks.0's wait; the root's waits for blocks.0's buffer to be freed
    # (the default budget: one unit more in flight than the unscheduled graph's 80 bytes).
    assert_expected_inline(
        _collective_order(fw),
        """\
gather(blocks.0)
gather(blocks.1)
  wait(blocks.0)
    addmm
gather(<root>)
  wait(blocks.1)
    addmm_1
  wait(<root>)
    mm""",
    )


def test_schedule_backward_prefetches_and_sinks_reduce_waits(fake_pg):
    _, bw = _lowered()
    assert_expected_inline(
        _collective_order(bw),
        """\
    mm_1
gather(<root>)
  wait(<root>)
    mm_2
scatter(<root>)
  wait(<root>)
gather(blocks.1)
  wait(blocks.1)
    mm_3
    mm_4
scatter(blocks.1)
  wait(blocks.1)
    mm_5
scatter(blocks.0)
  wait(blocks.0)""",
    )
    schedule_collectives(bw)
    assert_expected_inline(
        _collective_order(bw),
        """\
    mm_1
gather(<root>)
gather(blocks.1)
  wait(<root>)
    mm_2
scatter(<root>)
  wait(blocks.1)
    mm_3
    mm_4
  wait(<root>)
scatter(blocks.1)
    mm_5
  wait(blocks.1)
scatter(blocks.0)
  wait(blocks.0)""",
    )


def test_schedule_respects_max_inflight_bytes(fake_pg):
    fw, _ = _lowered()
    before = _collective_order(fw)
    schedule_collectives(fw, max_inflight_bytes=80)  # one block's 80 bytes: no room to prefetch anything
    assert _collective_order(fw) == before
    fw, _ = _lowered()
    schedule_collectives(fw, max_inflight_bytes=10**9)  # no limit: every gather issued up front
    assert _collective_order(fw).splitlines()[:3] == ["gather(blocks.0)", "gather(blocks.1)", "gather(<root>)"]


def test_schedule_off_and_noop(fake_pg):
    fw, _ = _lowered()
    before = code(fw)
    assert code(schedule_collectives(fw, prefetch=False)) == before
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = code(gm)
    assert code(schedule_collectives(gm)) == before


def test_schedule_changes_only_order(fake_pg):
    fw, bw = _lowered()
    for gm in (fw, bw):
        nodes = {n.name for n in gm.graph.nodes}
        schedule_collectives(gm)
        assert {n.name for n in gm.graph.nodes} == nodes
        gm.graph.lint()


def test_reduce_scatter_as_all_to_all(fake_pg):
    _, bw = _lowered(fsdp_graph.ShardingStrategy.SHARD_GRAD_OP)
    reduce_scatter_as_all_to_all(bw, {"0"})
    assert_expected_inline(
        "\n".join(line for line in code(bw).splitlines() if "div" in line or "_c10d" in line or "sum" in line),
        """\
    all_to_all_single_default = torch.ops._c10d_functional.all_to_all_single.default(view_11, [4, 4, 4, 4], [4, 4, 4, 4], '0');  view_11 = None
    wait_tensor_default_3 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_default);  all_to_all_single_default = None
    sum_dim_int_list = torch.ops.aten.sum.dim_IntList(view_default, [0]);  view_default = None
    div_tensor = torch.ops.aten.div.Tensor(sum_dim_int_list, 4);  sum_dim_int_list = None
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_12 = torch.ops.aten.view.default(sum_1, [4]);  sum_1 = None
    all_to_all_single_default_1 = torch.ops._c10d_functional.all_to_all_single.default(add, [5, 5, 5, 5], [5, 5, 5, 5], '0');  add = None
    wait_tensor_default_4 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_default_1);  all_to_all_single_default_1 = None
    sum_dim_int_list_1 = torch.ops.aten.sum.dim_IntList(view_default_1, [0]);  view_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(sum_dim_int_list_1, 4);  sum_dim_int_list_1 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_17 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    all_to_all_single_default_2 = torch.ops._c10d_functional.all_to_all_single.default(add_1, [5, 5, 5, 5], [5, 5, 5, 5], '0');  add_1 = None
    wait_tensor_default_5 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_default_2);  all_to_all_single_default_2 = None
    sum_dim_int_list_2 = torch.ops.aten.sum.dim_IntList(view_default_2, [0]);  view_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(sum_dim_int_list_2, 4);  sum_dim_int_list_2 = None
    return (None, div_tensor_2, div_tensor_1, div_tensor)""",
    )
    assert not any(n.target is REDUCE_SCATTER for n in bw.graph.nodes)
    _, bw = _lowered(fsdp_graph.ShardingStrategy.SHARD_GRAD_OP)
    before = code(bw)
    assert code(reduce_scatter_as_all_to_all(bw, {"some other group"})) == before


def test_schedule_serial_group_keeps_one_collective_in_flight(fake_pg):
    """A serial group (gloo) never has two collectives in flight: each gather is issued right after the previous
    wait, before the unit computes, and a reduce wait sinks only to the next collective on the group."""
    group = fake_pg.group_name
    fw, bw = _lowered()
    schedule_collectives(fw, max_inflight_bytes=10**9, serial_groups={group})
    assert_expected_inline(
        _collective_order(fw),
        """\
gather(blocks.0)
  wait(blocks.0)
gather(blocks.1)
    addmm
  wait(blocks.1)
gather(<root>)
    addmm_1
  wait(<root>)
    mm""",
    )
    reduce_scatter_as_all_to_all(bw, {group})
    schedule_collectives(bw, serial_groups={group})
    # The backward: a unit's re-gather moves above the next unit's reduction, to the middle of that unit's compute
    # (it is waited before the reduction is issued), so each reduction is in flight over the next unit's compute.
    assert_expected_inline(
        _collective_order(bw),
        """\
    mm_1
gather(<root>)
  wait(<root>)
gather(blocks.1)
    mm_2
  wait(blocks.1)
all_to_all(<root>)
    mm_3
    mm_4
  wait(<root>)
all_to_all(blocks.1)
    mm_5
  wait(blocks.1)
all_to_all(blocks.0)
  wait(blocks.0)""",
    )
    for gm in (fw, bw):
        passes.check_collectives(gm, {group})
        gm.graph.lint()


def test_serialize_repairs_any_overlap_even_without_prefetch(fake_pg):
    """With prefetch on but no serial group, three gathers fly at once; the checker rejects that on a serial group,
    and scheduling the same graph for that group (prefetch off too) leaves at most one in flight."""
    group = fake_pg.group_name
    fw, _ = _lowered()
    schedule_collectives(fw, max_inflight_bytes=10**9)
    with pytest.raises(RuntimeError, match="still in flight there"):
        passes.check_collectives(fw, {group})
    schedule_collectives(fw, prefetch=False, serial_groups={group})
    passes.check_collectives(fw, {group})
    assert _collective_order(fw).splitlines()[:3] == ["gather(blocks.0)", "  wait(blocks.0)", "gather(blocks.1)"]


def _all_reduces_waited_before_compute(gm) -> list[str]:
    """The gradient all-reduces waited for with no compute node (not a collective, a wait, a view or a node of a
    reduction) between issue and wait although compute follows their issue."""
    nodes = list(gm.graph.nodes)
    computes = [
        k
        for k, n in enumerate(nodes)
        if n.op == "call_function"
        and n.target not in COLLECTIVES
        and n.meta.get(META_ROLE) is None
        and not getattr(n.target, "is_view", False)
    ]
    exposed = []
    for k, issue in enumerate(nodes):
        if issue.target is not ALL_REDUCE:
            continue
        (wait,) = issue.users
        w = nodes.index(wait)
        if any(k < c for c in computes) and not any(k < c < w for c in computes):
            exposed.append(issue.name)
    return exposed


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("strategy", ["NO_SHARD", "HYBRID_SHARD"])
def test_gradient_all_reduces_overlap_compute(fake_pg, strategy, serial):
    """Issue 27 item 3: NO_SHARD's all-reduce and HYBRID's replica all-reduce were waited right after their issue.
    Each one with compute after it now has compute between issue and wait (the next unit's backward; HYBRID's
    last two follow all compute, the second last overlaps the last reduce-scatter), also when every group is
    serial (gloo): one collective in flight per group, which `check_collectives` verifies."""
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {}
    if strategy == "HYBRID_SHARD":
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _, bw = _lowered(fsdp_graph.ShardingStrategy[strategy], **kwargs)
    groups = {g for n in bw.graph.nodes if (g := passes.fx_nodes.collective_group(n)) is not None}
    serial_groups = groups if serial else set()
    if serial:
        reduce_scatter_as_all_to_all(bw, groups)
    assert _all_reduces_waited_before_compute(bw)  # the lowering waits each at once
    schedule_collectives(bw, serial_groups=serial_groups)
    passes.check_collectives(bw, serial_groups)
    bw.graph.lint()
    assert sum(n.target is ALL_REDUCE for n in bw.graph.nodes) == 3
    assert _all_reduces_waited_before_compute(bw) == []
