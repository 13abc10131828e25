"""`passes.bucket` on TwoBlock's lowered graphs (fake process group, world 4). The snapshots are the spec.

TwoBlock at world 4 in fp32 with the default rows layout: blocks.0 and blocks.1 gather 80 bytes each (20 elements:
one row of the 4x4 weight and one bias element per rank), the root 64 (16: its 2x4 head padded to one row per rank).
Buckets are greedy in graph order, so one cap of 160 bytes shows a bucket and its boundary in both graphs:
the forward gathers blocks.0, blocks.1, root -> [blocks.0+blocks.1] [root]; the backward gathers root, blocks.1
-> [root+blocks.1] and reduces root, blocks.1, blocks.0 -> [root+blocks.1] [blocks.0] (224 bytes would not fit).
"""

import copy

import pytest
import torch
from expecttest import assert_expected_inline
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import fsdp_graph
from fsdp_graph.ir import ALL_GATHER, COLLECTIVES, META_BUCKET, META_ROLE, META_UNIT, REDUCE_SCATTER, WAIT
from passes import bucket_collectives, collective_summary, lower_fsdp_ops, tag_reshard
from tests.graphs.capture import TwoBlock, aot_stages, code

CAP = 160


def _lowered(strategy: str = "FULL_SHARD", mesh=None):
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(), mesh, reuse_blocks=False, strategy=fsdp_graph.ShardingStrategy[strategy])
    stages = aot_stages(model, torch.randn(2, 4), tag=tag_reshard)
    return lower_fsdp_ops(stages.forward), lower_fsdp_ops(stages.backward)


def _collectives(gm) -> str:
    """One line per collective in graph order: kind, unit(s), unsharded bytes."""
    summary = collective_summary(gm)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]
    return "\n".join(
        f"{kind} {unit!r} {_nbytes(n if kind == 'all_gather' else n.args[0])}"
        for (kind, unit), n in zip(summary.units, nodes)
    )


def _nbytes(node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _check_meta(before, after) -> None:
    """New nodes carry a fake value and the bucket's meta; totals per kind are unchanged."""
    new = [n for n in after.graph.nodes if META_BUCKET in n.meta]
    assert new
    for n in new:
        assert isinstance(n.meta["val"], torch.Tensor), n
        assert n.meta[META_UNIT] == "+".join(n.meta[META_BUCKET]) and n.meta[META_ROLE] in ("unshard", "reduce_grad")
    assert collective_summary(after).bytes == collective_summary(before).bytes


def test_bucket_forward(fake_pg):
    fw, _ = _lowered()
    before = copy.deepcopy(fw)
    assert_expected_inline(
        _collectives(fw),
        """\
all_gather 'blocks.0' 80
all_gather 'blocks.1' 80
all_gather '' 64""",
    )
    bucket_collectives(fw, CAP)
    _check_meta(before, fw)
    assert_expected_inline(
        _collectives(fw),
        """\
all_gather 'blocks.0+blocks.1' 160
all_gather '' 64""",
    )
    # blocks.1's shard (primals_3) joins blocks.0's at blocks.0's gather; each unit's full flat parameter is
    # its column block of the (world, 5 + 5) gather, copied out contiguous.
    assert_expected_inline(
        code(fw),
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    cat_default = torch.ops.aten.cat.default([primals_2, primals_3]);  primals_2 = None
    all_gather_into_tensor_default_3 = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default, 4, '0');  cat_default = None
    wait_tensor_default_3 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_3);  all_gather_into_tensor_default_3 = None
    view_default = torch.ops.aten.view.default(wait_tensor_default_3, [4, 10]);  wait_tensor_default_3 = None
    slice_tensor = torch.ops.aten.slice.Tensor(view_default, 1, 0, 5)
    clone_default = torch.ops.aten.clone.default(slice_tensor, memory_format = torch.contiguous_format);  slice_tensor = None
    view_default_1 = torch.ops.aten.view.default(clone_default, [20]);  clone_default = None
    slice_tensor_1 = torch.ops.aten.slice.Tensor(view_default, 1, 5, 10);  view_default = None
    clone_default_1 = torch.ops.aten.clone.default(slice_tensor_1, memory_format = torch.contiguous_format);  slice_tensor_1 = None
    view_default_2 = torch.ops.aten.view.default(clone_default_1, [20]);  clone_default_1 = None
    view = torch.ops.aten.view.default(view_default_1, [4, 5]);  view_default_1 = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 4, 5);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    addmm = torch.ops.aten.addmm.default(view_3, primals_1, t);  view_3 = t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    view_4 = torch.ops.aten.view.default(view_default_2, [4, 5]);  view_default_2 = None
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 4)
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(view_4, 1, 4, 5);  view_4 = None
    view_7 = torch.ops.aten.view.default(slice_4, [4]);  slice_4 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    addmm_1 = torch.ops.aten.addmm.default(view_7, relu, t_1);  view_7 = t_1 = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_4, 4, '0')
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view_8 = torch.ops.aten.view.default(wait_tensor_default_2, [4, 4]);  wait_tensor_default_2 = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    mm = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
    t_10 = torch.ops.aten.t.default(primals_1);  primals_1 = None
    return (mm, primals_3, primals_4, relu, relu_1, t_10)""",
    )


def test_bucket_backward(fake_pg):
    _, bw = _lowered()
    before = copy.deepcopy(bw)
    assert_expected_inline(
        _collectives(bw),
        """\
all_gather '' 64
reduce_scatter '' 64
all_gather 'blocks.1' 80
reduce_scatter 'blocks.1' 80
reduce_scatter 'blocks.0' 80""",
    )
    bucket_collectives(bw, CAP)
    _check_meta(before, bw)
    assert_expected_inline(
        _collectives(bw),
        """\
all_gather '+blocks.1' 144
reduce_scatter '+blocks.1' 144
reduce_scatter 'blocks.0' 80""",
    )
    # The root's and blocks.1's gradients are viewed as (world, s_i), concatenated per rank row and scattered at
    # blocks.1's reduce-scatter; the root's division moved after the merged wait.
    assert_expected_inline(
        code(bw),
        """\
def forward(self, primals_3, primals_4, relu, relu_1, t_10, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    cat_default = torch.ops.aten.cat.default([primals_4, primals_3]);  primals_4 = primals_3 = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default, 4, '0');  cat_default = None
    wait_tensor_default_5 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view_default = torch.ops.aten.view.default(wait_tensor_default_5, [4, 9]);  wait_tensor_default_5 = None
    slice_tensor = torch.ops.aten.slice.Tensor(view_default, 1, 0, 4)
    clone_default = torch.ops.aten.clone.default(slice_tensor, memory_format = torch.contiguous_format);  slice_tensor = None
    view_default_1 = torch.ops.aten.view.default(clone_default, [16]);  clone_default = None
    slice_tensor_1 = torch.ops.aten.slice.Tensor(view_default, 1, 4, 9);  view_default = None
    clone_default_1 = torch.ops.aten.clone.default(slice_tensor_1, memory_format = torch.contiguous_format);  slice_tensor_1 = None
    view_default_2 = torch.ops.aten.view.default(clone_default_1, [20]);  clone_default_1 = None
    view_8 = torch.ops.aten.view.default(view_default_1, [4, 4]);  view_default_1 = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    t_5 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_6, [4, 4], 0, 0, 2, 1);  t_6 = None
    view_10 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_11 = torch.ops.aten.view.default(view_10, [16]);  view_10 = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  relu_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_2, detach_2, 0);  mm_2 = detach_2 = None
    view_4 = torch.ops.aten.view.default(view_default_2, [4, 5]);  view_default_2 = None
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 4);  view_4 = None
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    t_7 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_3 = torch.ops.aten.mm.default(threshold_backward, t_7);  t_7 = None
    t_8 = torch.ops.aten.t.default(relu)
    mm_4 = torch.ops.aten.mm.default(t_8, threshold_backward);  t_8 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_12 = torch.ops.aten.view.default(sum_1, [4]);  sum_1 = None
    t_9 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    view_13 = torch.ops.aten.view.default(view_12, [4, 1]);  view_12 = None
    slice_backward_1 = torch.ops.aten.slice_backward.default(view_13, [4, 5], 1, 4, 5, 1);  view_13 = None
    view_14 = torch.ops.aten.view.default(slice_backward_1, [20]);  slice_backward_1 = None
    view_15 = torch.ops.aten.view.default(t_9, [4, 4]);  t_9 = None
    slice_backward_2 = torch.ops.aten.slice_backward.default(view_15, [4, 5], 1, 0, 4, 1);  view_15 = None
    view_16 = torch.ops.aten.view.default(slice_backward_2, [20]);  slice_backward_2 = None
    add = torch.ops.aten.add.Tensor(view_14, view_16);  view_14 = view_16 = None
    view_default_3 = torch.ops.aten.view.default(view_11, [4, 4]);  view_11 = None
    view_default_4 = torch.ops.aten.view.default(add, [4, 5]);  add = None
    cat_default_1 = torch.ops.aten.cat.default([view_default_3, view_default_4], 1);  view_default_3 = view_default_4 = None
    view_default_5 = torch.ops.aten.view.default(cat_default_1, [36]);  cat_default_1 = None
    reduce_scatter_tensor_default_3 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_5, 'sum', 4, '0');  view_default_5 = None
    wait_tensor_default_6 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_3);  reduce_scatter_tensor_default_3 = None
    slice_tensor_2 = torch.ops.aten.slice.Tensor(wait_tensor_default_6, 0, 0, 4)
    slice_tensor_3 = torch.ops.aten.slice.Tensor(wait_tensor_default_6, 0, 4, 9);  wait_tensor_default_6 = None
    div_tensor = torch.ops.aten.div.Tensor(slice_tensor_2, 4);  slice_tensor_2 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(slice_tensor_3, 4);  slice_tensor_3 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    mm_5 = torch.ops.aten.mm.default(t_10, threshold_backward_1);  t_10 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_17 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    t_11 = torch.ops.aten.t.default(mm_5);  mm_5 = None
    view_18 = torch.ops.aten.view.default(view_17, [4, 1]);  view_17 = None
    slice_backward_3 = torch.ops.aten.slice_backward.default(view_18, [4, 5], 1, 4, 5, 1);  view_18 = None
    view_19 = torch.ops.aten.view.default(slice_backward_3, [20]);  slice_backward_3 = None
    view_20 = torch.ops.aten.view.default(t_11, [4, 4]);  t_11 = None
    slice_backward_4 = torch.ops.aten.slice_backward.default(view_20, [4, 5], 1, 0, 4, 1);  view_20 = None
    view_21 = torch.ops.aten.view.default(slice_backward_4, [20]);  slice_backward_4 = None
    add_1 = torch.ops.aten.add.Tensor(view_19, view_21);  view_19 = view_21 = None
    reduce_scatter_tensor_default_2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(add_1, 'sum', 4, '0');  add_1 = None
    wait_tensor_default_4 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_4, 4);  wait_tensor_default_4 = None
    return (None, div_tensor_2, div_tensor_1, div_tensor)""",
    )


def test_bucket_hybrid_merges_replica_all_reduce(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    _, bw = _lowered("HYBRID_SHARD", init_device_mesh("cpu", (2, 2)))
    bucket_collectives(bw, 10**6)
    assert_expected_inline(
        _collectives(bw),
        """\
all_gather '+blocks.1' 112
reduce_scatter '+blocks.1+blocks.0' 192
all_reduce '+blocks.1+blocks.0' 96""",
    )


def test_bucket_noop(fake_pg):
    fw, bw = _lowered()
    for gm in (fw, bw):
        before = code(gm)
        assert code(bucket_collectives(gm, 0)) == before
        assert code(bucket_collectives(gm, 79)) == before  # no two collectives fit
    linear = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = code(linear)
    assert code(bucket_collectives(linear, 1 << 20)) == before


def _reduction(graph, grad, unit: str):
    """What the lowering emits for one unit: reduce-scatter(sum, world 4) + wait + div, with fsdp meta."""
    shard = grad.meta["val"].new_empty(grad.meta["val"].numel() // 4)
    node = grad
    for target, rest in ((REDUCE_SCATTER, ("sum", 4, "0")), (WAIT, ()), (torch.ops.aten.div.Tensor, (4,))):
        node = graph.call_function(target, (node, *rest))
        node.meta.update({"val": shard, META_UNIT: unit, META_ROLE: "reduce_grad"})
    return node


def _hand_built(sizes) -> torch.fx.GraphModule:
    """One reduction per placeholder gradient, of the given (possibly symbolic) sizes."""
    graph = torch.fx.Graph()
    outs = []
    for i, size in enumerate(sizes):
        grad = graph.placeholder(f"grad_{i}")
        grad.meta["val"] = torch.empty(size)
        outs.append(_reduction(graph, grad, f"u{i}"))
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_bucket_skips_symbolic_sizes():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    u = mode.shape_env.create_unbacked_symint()
    with mode:
        torch._check(u >= 0)
        static, dynamic = _hand_built([8, 8]), _hand_built([8, u * 4])
    assert sum(n.target is REDUCE_SCATTER for n in bucket_collectives(static, 1 << 20).graph.nodes) == 1
    before = code(dynamic)
    assert code(bucket_collectives(dynamic, 1 << 20)) == before


def test_bucket_keeps_dependent_reductions_apart():
    """A gradient computed from an earlier unit's reduced shard cannot join that unit's bucket (it would wait for
    itself)."""
    with FakeTensorMode():
        gm = _hand_built([8])
        graph = gm.graph
        first = next(n for n in graph.nodes if n.target is torch.ops.aten.div.Tensor)
        with graph.inserting_before(graph.output_node()):
            grad = graph.call_function(torch.ops.aten.repeat.default, (first, [4]))
            grad.meta["val"] = first.meta["val"].repeat(4)
            second = _reduction(graph, grad, "u1")
        graph.output_node().args = ((first, second),)
    gm.recompile()
    before = code(gm)
    assert code(bucket_collectives(gm, 1 << 20)) == before


@pytest.mark.parametrize(
    "cap, fw_counts, bw_counts",
    [
        (143, [1, 1, 1], [(1, 1), (1, 1, 1)]),  # one byte short of blocks.1 + root (80 + 64)
        (144, [1, 2], [(2,), (2, 1)]),
        (160, [2, 1], [(2,), (2, 1)]),
        (224, [3], [(2,), (3,)]),  # all three units: 80 + 80 + 64
    ],
)
def test_bucket_respects_cap(fake_pg, cap, fw_counts, bw_counts):
    """Units per merged collective, in graph order (forward gathers; backward gathers, reduce-scatters)."""
    fw, bw = _lowered()
    for gm in (fw, bw):
        bucket_collectives(gm, cap)
        sizes = [_nbytes(n if n.target is ALL_GATHER else n.args[0]) for n in _starts(gm)]
        assert all(s <= cap for s in sizes), sizes
    assert [len(_units(n)) for n in _starts(fw)] == fw_counts
    gathers = tuple(len(_units(n)) for n in _starts(bw) if n.target is ALL_GATHER)
    scatters = tuple(len(_units(n)) for n in _starts(bw) if n.target is REDUCE_SCATTER)
    assert [gathers, scatters] == list(bw_counts)


def _starts(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES]


def _units(node) -> tuple:
    return node.meta.get(META_BUCKET, (node.meta[META_UNIT],))
