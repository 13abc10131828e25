"""Snapshots of each pass on tiny graphs (fake process group, world 4). The snapshots are the spec. TwoBlock's two
blocks would share one body by default (`reuse_blocks`): the snapshots pin it off, being about the passes on a
block's own nodes (tests/graphs/test_block_reuse*.py cover the passes with bodies)."""

import copy

import torch
from expecttest import assert_expected_inline

import fsdp_graph
from fsdp_graph.ir import ALL_GATHER, REDUCE_GRAD_TARGETS, REDUCE_SCATTER, UNSHARD_TARGETS, WAIT
from passes import collective_summary, dedup_unshard, lower_fsdp_ops, tag_reshard
from tests.graphs.capture import ReadsTwice, TwoBlock, aot_stages, code, dynamo_graph, unshard_count


def _tags(gm) -> str:
    lines = []
    for n in gm.graph.nodes:
        if "recompute" in n.meta:
            lines.append(f"{n.name}: {n.meta['recompute'].name}")
    return "\n".join(lines)


def _count(gm, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def test_dedup_merges_repeated_reads(fake_pg):
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(ReadsTwice())
    gm = dynamo_graph(model, torch.randn(2, 3))
    assert unshard_count(gm) == 2
    dedup_unshard(gm)
    assert unshard_count(gm) == 1
    assert_expected_inline(
        code(gm),
        """\
def forward(self, L_self_fsdp_flat_shards_0_ : torch.Tensor, L_x_ : torch.Tensor):
    l_self_fsdp_flat_shards_0_ = L_self_fsdp_flat_shards_0_
    l_x_ = L_x_
    flat = torch.ops.fsdp.unshard(l_self_fsdp_flat_shards_0_, '', '0', 4);  l_self_fsdp_flat_shards_0_ = None
    view = flat.view(4, 3)
    blocks = view[(slice(None, None, None), slice(0, 3, None))];  view = None
    full = blocks.view(4, 3);  blocks = None
    getitem_1 = full[slice(None, 3, None)];  full = None
    matmul = l_x_ @ getitem_1;  getitem_1 = None
    view_2 = flat.view(4, 3);  flat = None
    blocks_1 = view_2[(slice(None, None, None), slice(0, 3, None))];  view_2 = None
    full_1 = blocks_1.view(4, 3);  blocks_1 = None
    getitem_3 = full_1[slice(None, 3, None)];  full_1 = None
    t = getitem_3.t();  getitem_3 = None
    matmul_1 = l_x_ @ t;  l_x_ = t = None
    add = matmul + matmul_1;  matmul = matmul_1 = None
    return (add,)""",
    )


def test_dedup_gives_one_reduce_per_unit(fake_pg):
    """Without dedup the backward reduces once per property read; with it, once per unit."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False)
    x = torch.randn(2, 4)
    without = aot_stages(copy.deepcopy(model), x, tag=tag_reshard, dedup=False)
    with_dedup = aot_stages(model, x, tag=tag_reshard)
    assert _count(without.backward, REDUCE_GRAD_TARGETS) == 5  # weight + bias per block, head weight
    assert _count(with_dedup.backward, REDUCE_GRAD_TARGETS) == 3


def test_dedup_folds_a_read_of_the_gather_this_step_keeps(fake_pg):
    """set_reshard_after_backward(False): the first read gathers and keeps the gather (a Dynamo side effect), the
    second read passes it back as `gathered`; dedup folds that call into the gather: one gather, one reduction."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(ReadsTwice())
    model.set_reshard_after_backward(False)
    gm = dynamo_graph(model, torch.randn(2, 3))
    assert unshard_count(gm) == 2
    dedup_unshard(gm)
    assert unshard_count(gm) == 1
    assert_expected_inline(
        code(gm),
        """\
def forward(self, L_self_fsdp_flat_shards_0_ : torch.Tensor, L_x_ : torch.Tensor):
    l_self_fsdp_flat_shards_0_ = L_self_fsdp_flat_shards_0_
    l_x_ = L_x_
    flat = torch.ops.fsdp.unshard(l_self_fsdp_flat_shards_0_, '', '0', 4);  l_self_fsdp_flat_shards_0_ = None
    detach = flat.detach()
    view = flat.view(4, 3)
    blocks = view[(slice(None, None, None), slice(0, 3, None))];  view = None
    full = blocks.view(4, 3);  blocks = None
    getitem_1 = full[slice(None, 3, None)];  full = None
    matmul = l_x_ @ getitem_1;  getitem_1 = None
    view_2 = flat.view(4, 3);  flat = None
    blocks_1 = view_2[(slice(None, None, None), slice(0, 3, None))];  view_2 = None
    full_1 = blocks_1.view(4, 3);  blocks_1 = None
    getitem_3 = full_1[slice(None, 3, None)];  full_1 = None
    t = getitem_3.t();  getitem_3 = None
    matmul_1 = l_x_ @ t;  l_x_ = t = None
    add = matmul + matmul_1;  matmul = matmul_1 = None
    return (detach, add)""",
    )


def test_lower_forwards_a_kept_gather_and_reshard_saves_it(fake_pg):
    """The step after one that kept its gathers: every unshard takes the kept tensor (`gathered`), the lowering
    forwards that input (no all-gather), and the backward still reduce-scatters; the keeping step's gathers are
    forward outputs, tagged MUST_SAVE even under FULL_SHARD (the backward re-gathers nothing)."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False)
    model.set_reshard_after_backward(False)
    keeping = aot_stages(model, torch.randn(2, 4), tag=tag_reshard)
    assert_expected_inline(
        _tags(keeping.joint),
        """\
unshard: MUST_SAVE
unshard_1: MUST_SAVE
unshard_2: MUST_SAVE""",
    )
    assert unshard_count(keeping.backward) == 0
    kept = aot_stages(model, torch.randn(2, 4), tag=tag_reshard)
    lower_fsdp_ops(kept.forward)
    lower_fsdp_ops(kept.backward)
    summary = collective_summary(kept.forward)
    assert summary.counts["all_gather"] == 0 and summary.fsdp_ops_left == 0
    assert collective_summary(kept.backward).counts["reduce_scatter"] == 3
    assert_expected_inline(
        code(kept.forward),
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4, primals_5, primals_6, primals_7):
    view = torch.ops.aten.view.default(primals_2, [4, 5]);  primals_2 = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 4, 5);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    addmm = torch.ops.aten.addmm.default(view_3, primals_1, t);  view_3 = t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    view_4 = torch.ops.aten.view.default(primals_4, [4, 5])
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 4)
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(view_4, 1, 4, 5);  view_4 = None
    view_7 = torch.ops.aten.view.default(slice_4, [4]);  slice_4 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    addmm_1 = torch.ops.aten.addmm.default(view_7, relu, t_1);  view_7 = t_1 = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    view_8 = torch.ops.aten.view.default(primals_6, [4, 4])
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    mm = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
    t_10 = torch.ops.aten.t.default(primals_1);  primals_1 = None
    return (mm, primals_4, primals_5, primals_6, primals_7, relu, relu_1, t_10)""",
    )


def test_dedup_noop_without_fsdp_ops():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = code(gm)
    assert code(dedup_unshard(gm)) == before


def _reshard_stages(strategy: str):
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False, strategy=fsdp_graph.ShardingStrategy[strategy])
    stages = aot_stages(model, torch.randn(2, 4), tag=tag_reshard)
    return stages, unshard_count(stages.backward), len(saved_gathers(stages.forward))


def saved_gathers(forward) -> set:
    """The gathers whose storage the forward hands to the backward (directly or through views)."""
    roots = set()
    for out in forward.graph.find_nodes(op="output")[0].args[0]:
        node = out
        while (
            isinstance(node, torch.fx.Node)
            and node.op == "call_function"
            and (getattr(node.target, "is_view", False) or node.target in UNSHARD_TARGETS)
        ):
            if node.target in UNSHARD_TARGETS:
                roots.add(node)
                break
            node = node.args[0]
    return roots


def test_reshard_full_shard_recomputes_gathers(fake_pg):
    stages, bw_unshards, n_saved = _reshard_stages("FULL_SHARD")
    assert_expected_inline(
        _tags(stages.joint),
        """\
unshard: MUST_RECOMPUTE
view: MUST_RECOMPUTE
slice_1: MUST_RECOMPUTE
view_1: MUST_RECOMPUTE
view_2: MUST_RECOMPUTE
slice_2: MUST_RECOMPUTE
view_3: MUST_RECOMPUTE
t: MUST_RECOMPUTE
unshard_1: MUST_RECOMPUTE
view_4: MUST_RECOMPUTE
slice_3: MUST_RECOMPUTE
view_5: MUST_RECOMPUTE
view_6: MUST_RECOMPUTE
slice_4: MUST_RECOMPUTE
view_7: MUST_RECOMPUTE
t_1: MUST_RECOMPUTE
unshard_2: MUST_RECOMPUTE
view_8: MUST_RECOMPUTE
alias: MUST_RECOMPUTE
view_9: MUST_RECOMPUTE
slice_5: MUST_RECOMPUTE
t_2: MUST_RECOMPUTE
t_5: MUST_RECOMPUTE
t_7: MUST_RECOMPUTE""",
    )
    # What the tags buy: the forward saves no gathered tensor and the backward re-gathers what it needs:
    # blocks.1 and the head, not blocks.0, whose weights only feed the gradient of x (no grad needed).
    assert (bw_unshards, n_saved) == (2, 0)


def test_reshard_shard_grad_op_saves_gathers(fake_pg):
    stages, bw_unshards, n_saved = _reshard_stages("SHARD_GRAD_OP")
    assert_expected_inline(
        _tags(stages.joint),
        """\
unshard: MUST_SAVE
unshard_1: MUST_SAVE
unshard_2: MUST_SAVE""",
    )
    # The backward gathers nothing: the forward hands it the gathers it needs (blocks.1 and the head;
    # blocks.0's weights only feed the gradient of x, which needs none).
    assert (bw_unshards, n_saved) == (0, 2)


def test_reshard_noop_without_fsdp_ops():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    tag_reshard(gm.graph)
    assert _tags(gm) == ""


def test_lower_forward(fake_pg):
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False)
    fw = aot_stages(model, torch.randn(2, 4), tag=tag_reshard).forward
    assert_expected_inline(
        code(fw),
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    unshard = torch.ops.fsdp.unshard.default(primals_2, 'blocks.0', '0', 4);  primals_2 = None
    view = torch.ops.aten.view.default(unshard, [4, 5]);  unshard = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 4, 5);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    addmm = torch.ops.aten.addmm.default(view_3, primals_1, t);  view_3 = t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    unshard_1 = torch.ops.fsdp.unshard.default(primals_3, 'blocks.1', '0', 4)
    view_4 = torch.ops.aten.view.default(unshard_1, [4, 5]);  unshard_1 = None
    slice_3 = torch.ops.aten.slice.Tensor(view_4, 1, 0, 4)
    view_5 = torch.ops.aten.view.default(slice_3, [4, 4]);  slice_3 = None
    slice_4 = torch.ops.aten.slice.Tensor(view_4, 1, 4, 5);  view_4 = None
    view_7 = torch.ops.aten.view.default(slice_4, [4]);  slice_4 = None
    t_1 = torch.ops.aten.t.default(view_5);  view_5 = None
    addmm_1 = torch.ops.aten.addmm.default(view_7, relu, t_1);  view_7 = t_1 = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    unshard_2 = torch.ops.fsdp.unshard.default(primals_4, '', '0', 4)
    view_8 = torch.ops.aten.view.default(unshard_2, [4, 4]);  unshard_2 = None
    alias = torch.ops.aten.alias.default(view_8);  view_8 = None
    view_9 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_5 = torch.ops.aten.slice.Tensor(view_9, 0, 0, 2);  view_9 = None
    t_2 = torch.ops.aten.t.default(slice_5);  slice_5 = None
    mm = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
    t_10 = torch.ops.aten.t.default(primals_1);  primals_1 = None
    return (mm, primals_3, primals_4, relu, relu_1, t_10)""",
    )
    lower_fsdp_ops(fw)
    assert_expected_inline(
        code(fw),
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 4, '0');  primals_2 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view = torch.ops.aten.view.default(wait_tensor_default, [4, 5]);  wait_tensor_default = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 4)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4]);  slice_1 = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 4, 5);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(view_1);  view_1 = None
    addmm = torch.ops.aten.addmm.default(view_3, primals_1, t);  view_3 = t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_3, 4, '0')
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default_1, [4, 5]);  wait_tensor_default_1 = None
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
    assert _count(fw, UNSHARD_TARGETS) == 0 and _count(fw, (ALL_GATHER,)) == 3 and _count(fw, (WAIT,)) == 3
    assert {n.meta.get("fsdp_unit") for n in fw.graph.nodes if n.target is ALL_GATHER} == {"", "blocks.0", "blocks.1"}


def test_lower_backward(fake_pg):
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False, strategy=fsdp_graph.ShardingStrategy.SHARD_GRAD_OP)
    bw = aot_stages(model, torch.randn(2, 4), tag=tag_reshard).backward
    lower_fsdp_ops(bw)
    assert_expected_inline(
        code(bw),
        """\
def forward(self, relu, relu_1, t_5, t_7, t_10, tangents_1):
    t_3 = torch.ops.aten.t.default(tangents_1)
    mm_1 = torch.ops.aten.mm.default(t_3, relu_1);  t_3 = None
    t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    mm_2 = torch.ops.aten.mm.default(tangents_1, t_5);  tangents_1 = t_5 = None
    t_6 = torch.ops.aten.t.default(t_4);  t_4 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_6, [4, 4], 0, 0, 2, 1);  t_6 = None
    view_10 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_11 = torch.ops.aten.view.default(view_10, [16]);  view_10 = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_11, 'sum', 4, '0');  view_11 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default, 4);  wait_tensor_default = None
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
    slice_backward_1 = torch.ops.aten.slice_backward.default(view_13, [4, 5], 1, 4, 5, 1);  view_13 = None
    view_14 = torch.ops.aten.view.default(slice_backward_1, [20]);  slice_backward_1 = None
    view_15 = torch.ops.aten.view.default(t_9, [4, 4]);  t_9 = None
    slice_backward_2 = torch.ops.aten.slice_backward.default(view_15, [4, 5], 1, 0, 4, 1);  view_15 = None
    view_16 = torch.ops.aten.view.default(slice_backward_2, [20]);  slice_backward_2 = None
    add = torch.ops.aten.add.Tensor(view_14, view_16);  view_14 = view_16 = None
    reduce_scatter_tensor_default_1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(add, 'sum', 4, '0');  add = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1);  reduce_scatter_tensor_default_1 = None
    div_tensor_1 = torch.ops.aten.div.Tensor(wait_tensor_default_1, 4);  wait_tensor_default_1 = None
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
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
    div_tensor_2 = torch.ops.aten.div.Tensor(wait_tensor_default_2, 4);  wait_tensor_default_2 = None
    return (None, div_tensor_2, div_tensor_1, div_tensor)""",
    )
    summary = collective_summary(bw)
    assert summary.counts == {"reduce_scatter": 3} and summary.fsdp_ops_left == 0
    assert _count(bw, (REDUCE_SCATTER,)) == 3


def test_lower_noop_without_fsdp_ops():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = code(gm)
    assert code(lower_fsdp_ops(gm)) == before


def test_lower_cpu_offload_copies_around_collectives(fake_pg):
    model = fsdp_graph.fully_shard(
        torch.nn.Linear(4, 2, bias=False), cpu_offload=fsdp_graph.CPUOffload(offload_params=True)
    )
    stages = aot_stages(model, torch.randn(3, 4), tag=tag_reshard)
    fw, bw = lower_fsdp_ops(stages.forward), lower_fsdp_ops(stages.backward)
    assert_expected_inline(
        code(fw),
        """\
def forward(self, primals_1, primals_2):
    device_put_default = torch.ops.prims.device_put.default(primals_2, device(type='cpu'), True);  primals_2 = None
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(device_put_default, 4, '0');  device_put_default = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view = torch.ops.aten.view.default(wait_tensor_default, [4, 4]);  wait_tensor_default = None
    alias = torch.ops.aten.alias.default(view);  view = None
    view_1 = torch.ops.aten.view.default(alias, [4, 4]);  alias = None
    slice_1 = torch.ops.aten.slice.Tensor(view_1, 0, 0, 2);  view_1 = None
    t = torch.ops.aten.t.default(slice_1);  slice_1 = None
    mm = torch.ops.aten.mm.default(primals_1, t);  t = None
    return (mm, primals_1)""",
    )
    assert_expected_inline(
        code(bw),
        """\
def forward(self, primals_1, tangents_1):
    t_1 = torch.ops.aten.t.default(tangents_1);  tangents_1 = None
    mm_1 = torch.ops.aten.mm.default(t_1, primals_1);  t_1 = primals_1 = None
    t_2 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_3, [4, 4], 0, 0, 2, 1);  t_3 = None
    view_2 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_3 = torch.ops.aten.view.default(view_2, [16]);  view_2 = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_3, 'sum', 4, '0');  view_3 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default, 4);  wait_tensor_default = None
    device_put_default = torch.ops.prims.device_put.default(div_tensor, device(type='cpu'), True);  div_tensor = None
    return (None, device_put_default)""",
    )


def test_no_sync_graphs_accumulate_then_reduce_once(fake_pg):
    model = fsdp_graph.fully_shard(torch.nn.Linear(4, 2, bias=False))
    fsdp_graph.set_requires_gradient_sync(model, False)
    accumulating = aot_stages(model, torch.randn(3, 4), tag=tag_reshard).backward
    assert_expected_inline(
        code(lower_fsdp_ops(accumulating)),
        """\
def forward(self, primals_1, tangents_1):
    t_1 = torch.ops.aten.t.default(tangents_1);  tangents_1 = None
    mm_1 = torch.ops.aten.mm.default(t_1, primals_1);  t_1 = primals_1 = None
    t_2 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_3, [4, 4], 0, 0, 2, 1);  t_3 = None
    view_2 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_3 = torch.ops.aten.view.default(view_2, [16]);  view_2 = None
    return (None, view_3, None)""",
    )
    fsdp_graph.set_requires_gradient_sync(model, True)
    reducing = aot_stages(model, torch.randn(3, 4), tag=tag_reshard).backward
    assert_expected_inline(
        code(lower_fsdp_ops(reducing)),
        """\
def forward(self, primals_1, primals_2, tangents_1):
    t_1 = torch.ops.aten.t.default(tangents_1);  tangents_1 = None
    mm_1 = torch.ops.aten.mm.default(t_1, primals_1);  t_1 = primals_1 = None
    t_2 = torch.ops.aten.t.default(mm_1);  mm_1 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    slice_backward = torch.ops.aten.slice_backward.default(t_3, [4, 4], 0, 0, 2, 1);  t_3 = None
    view_2 = torch.ops.aten.view.default(slice_backward, [4, 4]);  slice_backward = None
    view_3 = torch.ops.aten.view.default(view_2, [16]);  view_2 = None
    take_accumulated = torch.ops.fsdp.take_accumulated.default(primals_2);  primals_2 = None
    add = torch.ops.aten.add.Tensor(view_3, take_accumulated);  view_3 = take_accumulated = None
    reduce_scatter_tensor_default = torch.ops._c10d_functional.reduce_scatter_tensor.default(add, 'sum', 4, '0');  add = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
    div_tensor = torch.ops.aten.div.Tensor(wait_tensor_default, 4);  wait_tensor_default = None
    return (None, None, div_tensor)""",
    )


def test_cat_flat_grads_replaces_padded_sums():
    from torch.fx.experimental.proxy_tensor import make_fx

    from passes import cat_flat_grads

    aten = torch.ops.aten

    def flat_grad(w, b, w_again):  # slot [0, 4) read twice, slot [5, 8) in Inductor's decomposed form, padding
        full = aten.full.default([10], 0, dtype=torch.float32, layout=torch.strided, device="cpu", pin_memory=False)
        return (
            aten.slice_backward.default(w, [10], 0, 0, 4, 1)
            + aten.slice_scatter.default(full, b, 0, 5, 8)
            + aten.slice_backward.default(w_again, [10], 0, 0, 4, 1)
        )

    inputs = (torch.randn(4), torch.randn(3), torch.randn(4))
    gm = make_fx(flat_grad, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    cat_flat_grads(gm)
    assert_expected_inline(
        code(gm),
        """\
def forward(self, w_1, b_1, w_again_1):
    add_tensor = torch.ops.aten.add.Tensor(w_again_1, w_1);  w_again_1 = w_1 = None
    full_default = torch.ops.aten.full.default([1], 0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    full_default_1 = torch.ops.aten.full.default([2], 0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    cat_default = torch.ops.aten.cat.default([add_tensor, full_default, b_1, full_default_1]);  add_tensor = full_default = b_1 = full_default_1 = None
    return cat_default""",
    )
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)
    overlapping = make_fx(
        lambda a, b: aten.slice_backward.default(a, [6], 0, 0, 4, 1) + aten.slice_backward.default(b, [6], 0, 2, 6, 1),
        tracing_mode="fake",
    )(torch.randn(4), torch.randn(4))
    before = code(overlapping)
    assert code(cat_flat_grads(overlapping)) == before  # slots overlap: left alone


def test_cat_flat_grads_with_zeros_shared_by_units():
    """Inductor's CSE makes one `full(0)` for every same-sized flat gradient (every transformer block): the pass must
    still rewrite each unit's sum (it used to require a base of its own, so it never fired under Inductor)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from passes import cat_flat_grads

    aten = torch.ops.aten

    def two_units(w0, b0, w1, b1):
        full = aten.full.default([8], 0, dtype=torch.float32, layout=torch.strided, device="cpu", pin_memory=False)
        unit0 = aten.slice_scatter.default(full, w0, 0, 0, 6) + aten.slice_scatter.default(full, b0, 0, 6, 8)
        unit1 = aten.slice_scatter.default(full, w1, 0, 0, 6) + aten.slice_scatter.default(full, b1, 0, 6, 8)
        return unit0, unit1

    inputs = (torch.randn(6), torch.randn(2), torch.randn(6), torch.randn(2))
    gm = make_fx(two_units, tracing_mode="fake")(*inputs)
    assert code(gm).count("aten.full.default") == 1
    expected = gm(*inputs)
    cat_flat_grads(gm)
    assert "slice_scatter" not in code(gm) and "aten.full" not in code(gm) and code(gm).count("aten.cat") == 2
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _two_collectives(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    group = torch.distributed.group.WORLD
    gathered = funcol.all_gather_tensor(x, 0, group)
    return funcol.all_reduce(gathered, "sum", group=group) + 1


def test_rename_groups_names_the_alias_in_every_collective(fake_pg):
    from torch.fx.experimental.proxy_tensor import make_fx

    from passes import rename_groups

    gm = make_fx(_two_collectives)(torch.randn(2, 3))
    world = torch.distributed.group.WORLD.group_name
    unchanged = code(gm)
    assert code(rename_groups(gm, {world: world, "another": "fsdp_graph:x"})) == unchanged  # nothing to rename
    assert_expected_inline(
        code(rename_groups(gm, {world: "fsdp_graph:dtensor:tp"})),
        """\
def forward(self, x_1) -> torch.Tensor:
    all_gather_into_tensor = torch.ops._c10d_functional.all_gather_into_tensor.default(x_1, 4, 'fsdp_graph:dtensor:tp');  x_1 = None
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
    all_reduce = torch.ops._c10d_functional.all_reduce.default(wait_tensor, 'sum', 'fsdp_graph:dtensor:tp');  wait_tensor = None
    wait_tensor_1 = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
    add = torch.ops.aten.add.Tensor(wait_tensor_1, 1);  wait_tensor_1 = None
    return add""",
    )
