"""The whole pipeline's lowered forward and backward graphs for a 2-block model (fake PG, world 4)."""

import torch
from expecttest import assert_expected_inline

import fsdp_graph
from tests.graphs.capture import TwoBlock


def _compile(strategy: str, tmp_path=None, **shard_kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(
        TwoBlock(), reuse_blocks=False, strategy=fsdp_graph.ShardingStrategy[strategy], **shard_kwargs
    )
    backend = fsdp_graph.make_backend(inductor=False, dump_dir=str(tmp_path) if tmp_path else None)
    x = torch.randn(2, 4, requires_grad=True)
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    reports = {r.stage: r for r in backend.reports}
    assert set(reports) == {"fw", "bw"} and backend.dynamo_graphs == 1
    return reports


def test_full_shard_pipeline(fake_pg, tmp_path):
    reports = _compile("FULL_SHARD", tmp_path)
    assert reports["fw"].collectives.counts == {"all_gather": 3}
    assert reports["bw"].collectives.counts == {"all_gather": 3, "reduce_scatter": 3}
    assert reports["bw"].collectives.units == [  # issue order: blocks.1's re-gather is prefetched
        ("all_gather", ""),
        ("all_gather", "blocks.1"),
        ("all_gather", "blocks.0"),
        ("reduce_scatter", ""),
        ("reduce_scatter", "blocks.1"),
        ("reduce_scatter", "blocks.0"),
    ]
    assert_expected_inline(
        reports["fw"].code,
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 4, '0')
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_3, 4, '0')
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view = torch.ops.aten.view.default(wait_tensor_default, [4, 5]);  wait_tensor_default = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 4, 5);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    addmm = torch.ops.aten.addmm.default(view_3, primals_1, t);  view_3 = t = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_4, 4, '0')
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default_1, [4, 5]);  wait_tensor_default_1 = None
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 4)
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(view_4, 1, 4, 5);  view_4 = None
    view_7 = torch.ops.aten.view.default(slice_4, [4]);  slice_4 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    addmm_1 = torch.ops.aten.addmm.default(view_7, relu, t_1);  view_7 = t_1 = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view_8 = torch.ops.aten.view.default(wait_tensor_default_2, [4, 4]);  wait_tensor_default_2 = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    mm = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
    t_11 = torch.ops.aten.t.default(primals_1);  primals_1 = None
    return (mm, primals_2, primals_3, primals_4, relu, relu_1, t_11)""",
    )
    assert_expected_inline(
        reports["bw"].code,
        """\
def forward(self, primals_2, primals_3, primals_4, relu, relu_1, t_11, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_4, 4, '0');  primals_4 = None
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_3, 4, '0');  primals_3 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view_8 = torch.ops.aten.view.default(wait_tensor_default, [4, 4]);  wait_tensor_default = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    t_5 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 4, '0');  primals_2 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_6, [4, 4], 0, 0, 2, 1);  t_6 = None
    view_10 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_11 = torch.ops.aten.view.default(view_10, [16]);  view_10 = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_11, 'sum', 4, '0');  view_11 = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  relu_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_2, detach_2, 0);  mm_2 = detach_2 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default_2, [4, 5]);  wait_tensor_default_2 = None
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
    view_15 = torch.ops.aten.view.default(t_9, [4, 4]);  t_9 = None
    cat_default_1 = torch.ops.aten.cat.default([view_15, view_13], 1);  view_15 = view_13 = None
    view_default_1 = torch.ops.aten.view.default(cat_default_1, [20]);  cat_default_1 = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default_1, 4);  wait_tensor_default_1 = None
    reduce_scatter_tensor_default_1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_1, 'sum', 4, '0');  view_default_1 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    wait_tensor_default_4 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view = torch.ops.aten.view.default(wait_tensor_default_4, [4, 5]);  wait_tensor_default_4 = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4);  view = None
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    t_10 = torch.ops.aten.t.default(t);  t = None
    mm_5 = torch.ops.aten.mm.default(threshold_backward_1, t_10);  t_10 = None
    mm_6 = torch.ops.aten.mm.default(t_11, threshold_backward_1);  t_11 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_17 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    t_12 = torch.ops.aten.t.default(mm_6);  mm_6 = None
    view_18 = torch.ops.aten.view.default(view_17, [4, 1]);  view_17 = None
    view_20 = torch.ops.aten.view.default(t_12, [4, 4]);  t_12 = None
    cat_default = torch.ops.aten.cat.default([view_20, view_18], 1);  view_20 = view_18 = None
    view_default = torch.ops.aten.view.default(cat_default, [20]);  cat_default = None
    wait_tensor_default_3 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1);  reduce_scatter_tensor_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(wait_tensor_default_3, 4);  wait_tensor_default_3 = None
    reduce_scatter_tensor_default_2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default, 'sum', 4, '0');  view_default = None
    wait_tensor_default_5 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_5, 4);  wait_tensor_default_5 = None
    return (mm_5, div_tensor_2, div_tensor_1, div_tensor)""",
    )
    dumped = sorted(p.name for p in (tmp_path / "graph_0").iterdir())
    assert dumped == [
        "00_dynamo.py",
        "01_dedup.py",
        "02_joint_tagged.py",
        "03_fw_lowered.py",
        "04_bw_lowered.py",
        "summary.txt",
    ]
    assert (tmp_path / "graph_0" / "summary.txt").read_text().splitlines() == [
        "fw: all_gather: 3 (0.000 MiB)",
        "bw: all_gather: 3 (0.000 MiB); reduce_scatter: 3 (0.000 MiB)",
    ]
    assert "fsdp.unshard" in (tmp_path / "graph_0" / "02_joint_tagged.py").read_text()


def test_shard_grad_op_pipeline(fake_pg):
    reports = _compile("SHARD_GRAD_OP")
    assert reports["fw"].collectives.counts == {"all_gather": 3}
    assert reports["bw"].collectives.counts == {"reduce_scatter": 3}
    assert_expected_inline(
        reports["bw"].code,
        """\
def forward(self, relu, relu_1, t_5, t_7, t_10, t_11, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_6, [4, 4], 0, 0, 2, 1);  t_6 = None
    view_10 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_11 = torch.ops.aten.view.default(view_10, [16]);  view_10 = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_11, 'sum', 4, '0');  view_11 = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  relu_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_2, detach_2, 0);  mm_2 = detach_2 = None
    mm_3 = torch.ops.aten.mm.default(threshold_backward, t_7);  t_7 = None
    t_8 = torch.ops.aten.t.default(relu)
    mm_4 = torch.ops.aten.mm.default(t_8, threshold_backward);  t_8 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_12 = torch.ops.aten.view.default(sum_1, [4]);  sum_1 = None
    t_9 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    view_13 = torch.ops.aten.view.default(view_12, [4, 1]);  view_12 = None
    view_15 = torch.ops.aten.view.default(t_9, [4, 4]);  t_9 = None
    cat_default_1 = torch.ops.aten.cat.default([view_15, view_13], 1);  view_15 = view_13 = None
    view_default_1 = torch.ops.aten.view.default(cat_default_1, [20]);  cat_default_1 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default, 4);  wait_tensor_default = None
    reduce_scatter_tensor_default_1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_1, 'sum', 4, '0');  view_default_1 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    mm_5 = torch.ops.aten.mm.default(threshold_backward_1, t_10);  t_10 = None
    mm_6 = torch.ops.aten.mm.default(t_11, threshold_backward_1);  t_11 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_17 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    t_12 = torch.ops.aten.t.default(mm_6);  mm_6 = None
    view_18 = torch.ops.aten.view.default(view_17, [4, 1]);  view_17 = None
    view_20 = torch.ops.aten.view.default(t_12, [4, 4]);  t_12 = None
    cat_default = torch.ops.aten.cat.default([view_20, view_18], 1);  view_20 = view_18 = None
    view_default = torch.ops.aten.view.default(cat_default, [20]);  cat_default = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1);  reduce_scatter_tensor_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(wait_tensor_default_1, 4);  wait_tensor_default_1 = None
    reduce_scatter_tensor_default_2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default, 'sum', 4, '0');  view_default = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_2, 4);  wait_tensor_default_2 = None
    return (mm_5, div_tensor_2, div_tensor_1, div_tensor)""",
    )


def test_dump_dir_from_environment(fake_pg, tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_GRAPH_DUMP", str(tmp_path))
    _compile("SHARD_GRAD_OP")
    summary = (tmp_path / "graph_0" / "summary.txt").read_text().splitlines()
    assert summary == ["fw: all_gather: 3 (0.000 MiB)", "bw: reduce_scatter: 3 (0.000 MiB)"]


def test_no_shard_pipeline(fake_pg):
    reports = _compile("NO_SHARD")
    assert reports["fw"].collectives.counts == {}
    assert reports["bw"].collectives.counts == {"all_reduce": 3}
    assert_expected_inline(
        reports["bw"].code,
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4, relu, relu_1, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    view_8 = torch.ops.aten.view.default(primals_4, [1, 8]);  primals_4 = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [2, 4]);  alias = None
    t_2 = torch.ops.aten.t.default(view_9);  view_9 = None
    t_5 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    view_10 = torch.ops.aten.view.default(t_6, [1, 8]);  t_6 = None
    view_11 = torch.ops.aten.view.default(view_10, [8]);  view_10 = None
    all_reduce_default = torch.ops._c10d_functional.all_reduce.default(view_11, 'sum', '0');  view_11 = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  relu_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_2, detach_2, 0);  mm_2 = detach_2 = None
    view_4 = torch.ops.aten.view.default(primals_3, [1, 20]);  primals_3 = None
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 16);  view_4 = None
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    t_7 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_3 = torch.ops.aten.mm.default(threshold_backward, t_7);  t_7 = None
    t_8 = torch.ops.aten.t.default(threshold_backward)
    mm_4 = torch.ops.aten.mm.default(t_8, relu);  t_8 = None
    t_9 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_12 = torch.ops.aten.view.default(sum_1, [4]);  sum_1 = None
    t_10 = torch.ops.aten.t.default(t_9);  t_9 = None
    view_13 = torch.ops.aten.view.default(view_12, [1, 4]);  view_12 = None
    view_15 = torch.ops.aten.view.default(t_10, [1, 16]);  t_10 = None
    cat_default_1 = torch.ops.aten.cat.default([view_15, view_13], 1);  view_15 = view_13 = None
    view_default_1 = torch.ops.aten.view.default(cat_default_1, [20]);  cat_default_1 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default);  all_reduce_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default, 4);  wait_tensor_default = None
    all_reduce_default_1 = torch.ops._c10d_functional.all_reduce.default(view_default_1, 'sum', '0');  view_default_1 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    view = torch.ops.aten.view.default(primals_2, [1, 20]);  primals_2 = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 16);  view = None
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    t_11 = torch.ops.aten.t.default(t);  t = None
    mm_5 = torch.ops.aten.mm.default(threshold_backward_1, t_11);  t_11 = None
    t_12 = torch.ops.aten.t.default(threshold_backward_1)
    mm_6 = torch.ops.aten.mm.default(t_12, primals_1);  t_12 = primals_1 = None
    t_13 = torch.ops.aten.t.default(mm_6);  mm_6 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_17 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    t_14 = torch.ops.aten.t.default(t_13);  t_13 = None
    view_18 = torch.ops.aten.view.default(view_17, [1, 4]);  view_17 = None
    view_20 = torch.ops.aten.view.default(t_14, [1, 16]);  t_14 = None
    cat_default = torch.ops.aten.cat.default([view_20, view_18], 1);  view_20 = view_18 = None
    view_default = torch.ops.aten.view.default(cat_default, [20]);  cat_default = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default_1);  all_reduce_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(wait_tensor_default_1, 4);  wait_tensor_default_1 = None
    all_reduce_default_2 = torch.ops._c10d_functional.all_reduce.default(view_default, 'sum', '0');  view_default = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default_2);  all_reduce_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_2, 4);  wait_tensor_default_2 = None
    return (mm_5, div_tensor_2, div_tensor_1, div_tensor)""",
    )


def test_hybrid_shard_pipeline(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reports = _compile("HYBRID_SHARD", mesh=mesh)
    assert reports["fw"].collectives.counts == {"all_gather": 3}
    assert reports["bw"].collectives.counts == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 3}
    assert_expected_inline(
        reports["bw"].code,
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4, relu, relu_1, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_4, 2, 'fsdp_graph:shard:e022f294125b');  primals_4 = None
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_3, 2, 'fsdp_graph:shard:e022f294125b');  primals_3 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default, [2, 4]);  wait_tensor_default = None
    alias = torch.ops.aten.alias.default(view_4);  view_4 = None
    view_5 = torch.ops.aten.view.default(alias, [2, 4]);  alias = None
    t_2 = torch.ops.aten.t.default(view_5);  view_5 = None
    t_5 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 2, 'fsdp_graph:shard:e022f294125b');  primals_2 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    view_6 = torch.ops.aten.view.default(t_6, [2, 4]);  t_6 = None
    view_7 = torch.ops.aten.view.default(view_6, [8]);  view_6 = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_7, 'sum', 2, 'fsdp_graph:shard:e022f294125b');  view_7 = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  relu_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_2, detach_2, 0);  mm_2 = detach_2 = None
    wait_tensor_default_3 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    rows_copy_out_2 = torch.ops.fsdp.rows_copy_out.default(wait_tensor_default_3, 2, 10, 0, 8);  wait_tensor_default_3 = None
    view_2 = torch.ops.aten.view.default(rows_copy_out_2, [4, 4]);  rows_copy_out_2 = None
    t_1 = torch.ops.aten.t.default(view_2);  view_2 = None
    t_7 = torch.ops.aten.t.default(t_1);  t_1 = None
    mm_3 = torch.ops.aten.mm.default(threshold_backward, t_7);  t_7 = None
    t_8 = torch.ops.aten.t.default(threshold_backward)
    mm_4 = torch.ops.aten.mm.default(t_8, relu);  t_8 = None
    t_9 = torch.ops.aten.t.default(mm_4);  mm_4 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view_8 = torch.ops.aten.view.default(sum_1, [4]);  sum_1 = None
    t_10 = torch.ops.aten.t.default(t_9);  t_9 = None
    view_9 = torch.ops.aten.view.default(view_8, [2, 2]);  view_8 = None
    view_11 = torch.ops.aten.view.default(t_10, [2, 8]);  t_10 = None
    cat_default_1 = torch.ops.aten.cat.default([view_11, view_9], 1);  view_11 = view_9 = None
    view_default_1 = torch.ops.aten.view.default(cat_default_1, [20]);  cat_default_1 = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    all_reduce_default = torch.ops._c10d_functional.all_reduce.default(wait_tensor_default_1, 'sum', 'fsdp_graph:replicate:333da4cd2324');  wait_tensor_default_1 = None
    reduce_scatter_tensor_default_1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_1, 'sum', 2, 'fsdp_graph:shard:e022f294125b');  view_default_1 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    wait_tensor_default_6 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    rows_copy_out = torch.ops.fsdp.rows_copy_out.default(wait_tensor_default_6, 2, 10, 0, 8);  wait_tensor_default_6 = None
    view = torch.ops.aten.view.default(rows_copy_out, [4, 4]);  rows_copy_out = None
    t = torch.ops.aten.t.default(view);  view = None
    t_11 = torch.ops.aten.t.default(t);  t = None
    mm_5 = torch.ops.aten.mm.default(threshold_backward_1, t_11);  t_11 = None
    t_12 = torch.ops.aten.t.default(threshold_backward_1)
    mm_6 = torch.ops.aten.mm.default(t_12, primals_1);  t_12 = primals_1 = None
    t_13 = torch.ops.aten.t.default(mm_6);  mm_6 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_13 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    t_14 = torch.ops.aten.t.default(t_13);  t_13 = None
    view_14 = torch.ops.aten.view.default(view_13, [2, 2]);  view_13 = None
    view_16 = torch.ops.aten.view.default(t_14, [2, 8]);  t_14 = None
    cat_default = torch.ops.aten.cat.default([view_16, view_14], 1);  view_16 = view_14 = None
    view_default = torch.ops.aten.view.default(cat_default, [20]);  cat_default = None
    wait_tensor_default_4 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1);  reduce_scatter_tensor_default_1 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default);  all_reduce_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default_2, 4);  wait_tensor_default_2 = None
    all_reduce_default_1 = torch.ops._c10d_functional.all_reduce.default(wait_tensor_default_4, 'sum', 'fsdp_graph:replicate:333da4cd2324');  wait_tensor_default_4 = None
    reduce_scatter_tensor_default_2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default, 'sum', 2, 'fsdp_graph:shard:e022f294125b');  view_default = None
    wait_tensor_default_7 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
    wait_tensor_default_5 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default_1);  all_reduce_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(wait_tensor_default_5, 4);  wait_tensor_default_5 = None
    all_reduce_default_2 = torch.ops._c10d_functional.all_reduce.default(wait_tensor_default_7, 'sum', 'fsdp_graph:replicate:333da4cd2324');  wait_tensor_default_7 = None
    wait_tensor_default_8 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default_2);  all_reduce_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_8, 4);  wait_tensor_default_8 = None
    return (mm_5, div_tensor_2, div_tensor_1, div_tensor)""",
    )


def test_bf16_mixed_precision_pipeline(fake_pg):
    mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reports = _compile("FULL_SHARD", mixed_precision=mp)
    fw = reports["fw"].collectives
    # bf16: 2 bytes per gathered element; rows layout: the 2x4 head pads to one row per rank (4 rows of 4)
    assert fw.bytes["all_gather"] == 2 * (20 + 20 + 16)
    assert_expected_inline(
        reports["fw"].code,
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    _to_copy = torch.ops.aten._to_copy.default(primals_1, dtype = torch.bfloat16);  primals_1 = None
    convert_element_type_default = torch.ops.prims.convert_element_type.default(primals_2, torch.bfloat16)
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(convert_element_type_default, 4, '0');  convert_element_type_default = None
    convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(primals_3, torch.bfloat16)
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(convert_element_type_default_1, 4, '0');  convert_element_type_default_1 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view = torch.ops.aten.view.default(wait_tensor_default, [4, 5]);  wait_tensor_default = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 4, 5);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    addmm = torch.ops.aten.addmm.default(view_3, _to_copy, t);  view_3 = t = None
    convert_element_type_default_2 = torch.ops.prims.convert_element_type.default(primals_4, torch.bfloat16)
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(convert_element_type_default_2, 4, '0');  convert_element_type_default_2 = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default_1, [4, 5]);  wait_tensor_default_1 = None
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 4)
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(view_4, 1, 4, 5);  view_4 = None
    view_7 = torch.ops.aten.view.default(slice_4, [4]);  slice_4 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    addmm_1 = torch.ops.aten.addmm.default(view_7, relu, t_1);  view_7 = t_1 = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view_8 = torch.ops.aten.view.default(wait_tensor_default_2, [4, 4]);  wait_tensor_default_2 = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    mm = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
    t_11 = torch.ops.aten.t.default(_to_copy);  _to_copy = None
    return (mm, primals_2, primals_3, primals_4, relu, relu_1, t_11)""",
    )
    assert_expected_inline(
        reports["bw"].code,
        """\
def forward(self, primals_2, primals_3, primals_4, relu, relu_1, t_11, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    convert_element_type_default = torch.ops.prims.convert_element_type.default(primals_4, torch.bfloat16);  primals_4 = None
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(convert_element_type_default, 4, '0');  convert_element_type_default = None
    convert_element_type_default_2 = torch.ops.prims.convert_element_type.default(primals_3, torch.bfloat16);  primals_3 = None
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(convert_element_type_default_2, 4, '0');  convert_element_type_default_2 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view_8 = torch.ops.aten.view.default(wait_tensor_default, [4, 4]);  wait_tensor_default = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    t_5 = torch.ops.aten.t.default(t_2);  t_2 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    convert_element_type_default_4 = torch.ops.prims.convert_element_type.default(primals_2, torch.bfloat16);  primals_2 = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(convert_element_type_default_4, 4, '0');  convert_element_type_default_4 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_6, [4, 4], 0, 0, 2, 1);  t_6 = None
    view_10 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_11 = torch.ops.aten.view.default(view_10, [16]);  view_10 = None
    convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(view_11, torch.float32);  view_11 = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(convert_element_type_default_1, 'sum', 4, '0');  convert_element_type_default_1 = None
    detach_1 = torch.ops.aten.detach.default(relu_1);  relu_1 = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_2, detach_2, 0);  mm_2 = detach_2 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default_2, [4, 5]);  wait_tensor_default_2 = None
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
    view_15 = torch.ops.aten.view.default(t_9, [4, 4]);  t_9 = None
    cat_default_1 = torch.ops.aten.cat.default([view_15, view_13], 1);  view_15 = view_13 = None
    view_default_1 = torch.ops.aten.view.default(cat_default_1, [20]);  cat_default_1 = None
    convert_element_type_default_3 = torch.ops.prims.convert_element_type.default(view_default_1, torch.float32);  view_default_1 = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default_1, 4);  wait_tensor_default_1 = None
    reduce_scatter_tensor_default_1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(convert_element_type_default_3, 'sum', 4, '0');  convert_element_type_default_3 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward_1 = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    wait_tensor_default_4 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view = torch.ops.aten.view.default(wait_tensor_default_4, [4, 5]);  wait_tensor_default_4 = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4);  view = None
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    t_10 = torch.ops.aten.t.default(t);  t = None
    mm_5 = torch.ops.aten.mm.default(threshold_backward_1, t_10);  t_10 = None
    mm_6 = torch.ops.aten.mm.default(t_11, threshold_backward_1);  t_11 = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward_1, [0], True);  threshold_backward_1 = None
    view_17 = torch.ops.aten.view.default(sum_2, [4]);  sum_2 = None
    t_12 = torch.ops.aten.t.default(mm_6);  mm_6 = None
    view_18 = torch.ops.aten.view.default(view_17, [4, 1]);  view_17 = None
    view_20 = torch.ops.aten.view.default(t_12, [4, 4]);  t_12 = None
    cat_default = torch.ops.aten.cat.default([view_20, view_18], 1);  view_20 = view_18 = None
    view_default = torch.ops.aten.view.default(cat_default, [20]);  cat_default = None
    convert_element_type_default_5 = torch.ops.prims.convert_element_type.default(view_default, torch.float32);  view_default = None
    wait_tensor_default_3 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1);  reduce_scatter_tensor_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(wait_tensor_default_3, 4);  wait_tensor_default_3 = None
    reduce_scatter_tensor_default_2 = torch.ops._c10d_functional.reduce_scatter_tensor.default(convert_element_type_default_5, 'sum', 4, '0');  convert_element_type_default_5 = None
    _to_copy_1 = torch.ops.aten._to_copy.default(mm_5, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'));  mm_5 = None
    wait_tensor_default_5 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_5, 4);  wait_tensor_default_5 = None
    return (_to_copy_1, div_tensor_2, div_tensor_1, div_tensor)""",
    )
