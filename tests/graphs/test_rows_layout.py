"""The rows layout (`fully_shard(layout="rows")`): its arithmetic, and its graphs on the fake process group."""

import pytest
import torch
from expecttest import assert_expected_inline

import fsdp_graph
from fsdp_graph.runtime.flat_param import RowShardLayout
from tests.graphs.capture import TwoBlock

SHAPES = [(("w",), torch.Size([5, 3])), (("b", "tied"), torch.Size([5])), (("g",), torch.Size([1, 2]))]


def test_row_blocks_follow_torch_chunk():
    values = [torch.arange(15.0).view(5, 3), torch.arange(5.0) + 100, torch.tensor([[7.0, 8.0]])]
    layouts = [RowShardLayout.build(SHAPES, world=4, rank=r) for r in range(4)]
    # ceil(5/4) = 2 rows per block: ranks hold 2, 2, 1, 0 rows of w and b; only rank 0 holds g's single row.
    assert [layout.shard_numel for layout in layouts] == [6 + 2 + 2] * 4
    assert [[tuple(layout.local_shape(s)) for s in layout.slots] for layout in layouts] == [
        [(2, 3), (2,), (1, 2)],
        [(2, 3), (2,), (0, 2)],
        [(1, 3), (1,), (0, 2)],
        [(0, 3), (0,), (0, 2)],
    ]
    for layout in layouts:
        for slot, value in zip(layout.slots, values):
            expected = value.chunk(4)[layout.rank] if layout.rank < len(value.chunk(4)) else value[:0]
            assert torch.equal(layout.local_view(layout.shard_of(values), slot), expected)
    gathered = torch.cat([layout.shard_of(values) for layout in layouts])  # what the all-gather returns
    assert torch.equal(gathered, layouts[0].flatten(values))
    assert all(torch.equal(a, b) for a, b in zip(layouts[1].unflatten(gathered), values))
    assert layouts[0].padded_numel == 40 and layouts[0].numel == 22


def test_zero_dim_parameter_is_refused():
    with pytest.raises(ValueError, match="'scale' is 0-dimensional.*ignored_params.*layout='flat'"):
        RowShardLayout.build([(("scale",), torch.Size([]))], world=2, rank=0)


def test_unknown_layout_is_refused(fake_pg):
    with pytest.raises(ValueError, match="layout must be one of"):
        fsdp_graph.fully_shard(TwoBlock(), layout="columns")


def test_rows_pipeline_one_gather_per_unit_then_copy_out(fake_pg):
    """World 4, dim 8: each Linear is 2 rows per rank, the 2-row head is on ranks 0 and 1 only. One all-gather per
    unit in each direction; a unit's parameters are copied out of the rank-major gathered flat, one
    `fsdp.rows_copy_out` each, the single-parameter head unit's is a view; FULL_SHARD recomputes the copies in
    backward (the weights' only: the biases' gradients need none) instead of saving them, and each unit's gradient
    pieces are laid out by one `cat` (`passes.flat_grad`), not a sum of zero-padded slices."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(8), layout="rows", reuse_blocks=False)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {
        "blocks.0.weight": (2, 8),
        "blocks.0.bias": (2,),
        "blocks.1.weight": (2, 8),
        "blocks.1.bias": (2,),
        "head.weight": (1, 8),
    }
    backend = fsdp_graph.make_backend(inductor=False)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 8, requires_grad=True)).sum().backward()
    reports = {r.stage: r for r in backend.reports}
    assert reports["fw"].collectives.counts == {"all_gather": 3}
    assert reports["bw"].collectives.counts == {"all_gather": 3, "reduce_scatter": 3}
    assert_expected_inline(
        reports["fw"].code,
        """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 4, '0')
    all_gather_into_tensor_default_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_3, 4, '0')
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    rows_copy_out = torch.ops.fsdp.rows_copy_out.default(wait_tensor_default, 4, 18, 0, 16)
    view = torch.ops.aten.view.default(rows_copy_out, [8, 8]);  rows_copy_out = None
    rows_copy_out_1 = torch.ops.fsdp.rows_copy_out.default(wait_tensor_default, 4, 18, 16, 2);  wait_tensor_default = None
    all_gather_into_tensor_default_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_4, 4, '0')
    view_1 = torch.ops.aten.view.default(rows_copy_out_1, [8]);  rows_copy_out_1 = None
    t = torch.ops.aten.t.default(view);  view = None
    addmm = torch.ops.aten.addmm.default(view_1, primals_1, t);  view_1 = t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
    rows_copy_out_2 = torch.ops.fsdp.rows_copy_out.default(wait_tensor_default_1, 4, 18, 0, 16)
    view_2 = torch.ops.aten.view.default(rows_copy_out_2, [8, 8]);  rows_copy_out_2 = None
    rows_copy_out_3 = torch.ops.fsdp.rows_copy_out.default(wait_tensor_default_1, 4, 18, 16, 2);  wait_tensor_default_1 = None
    view_3 = torch.ops.aten.view.default(rows_copy_out_3, [8]);  rows_copy_out_3 = None
    t_1 = torch.ops.aten.t.default(view_2);  view_2 = None
    addmm_1 = torch.ops.aten.addmm.default(view_3, relu, t_1);  view_3 = t_1 = None
    relu_1 = torch.ops.aten.relu.default(addmm_1);  addmm_1 = None
    wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
    view_4 = torch.ops.aten.view.default(wait_tensor_default_2, [4, 8]);  wait_tensor_default_2 = None
    alias = torch.ops.aten.alias.default(view_4);  view_4 = None
    view_5 = torch.ops.aten.view.default(alias, [4, 8]);  alias = None
    slice_1 = torch.ops.aten.slice.Tensor(view_5, 0, 0, 2);  view_5 = None
    t_2 = torch.ops.aten.t.default(slice_1);  slice_1 = None
    mm = torch.ops.aten.mm.default(relu_1, t_2);  t_2 = None
    return (mm, primals_1, primals_2, primals_3, primals_4, relu, relu_1)""",
    )
    backward = reports["bw"].code
    assert backward.count("fsdp.rows_copy_out.default(") == 2 and "(wait_tensor_default_2, 4, 18, 0, 16)" in backward
    assert backward.count("aten.cat.default(") == 2 and "slice_scatter" not in backward


def test_eager_full_shard_frees_copied_out_parameters(fake_pg):
    """Eager FULL_SHARD: the copied-out parameters autograd saves become re-gather handles too (else every unit's
    parameters would stay unsharded until its backward); only activations (batch of 3) reach the user's hooks."""
    model = fsdp_graph.fully_shard(TwoBlock(8), layout="rows")
    packed, unpacked = [], []

    def pack(tensor):
        packed.append(tuple(tensor.shape))
        return tensor

    def unpack(tensor):
        unpacked.append(tuple(tensor.shape))
        return tensor

    x = torch.randn(3, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(x).sum().backward()
    assert packed and sorted(packed) == sorted(unpacked)
    assert all(shape[0] == 3 for shape in packed), packed
    assert [tuple(p.grad.shape) for p in model.parameters()] == [(2, 8), (2,), (2, 8), (2,), (1, 8)]


def test_cat_flat_grads_concatenates_row_pieces_along_columns():
    """The rows copy-in: each gradient is placed into one column range of the `(world, shard)` matrix (plain, or
    Inductor's decomposed form) and viewed 1-D; the pass makes it one `cat` along dim 1, the gap zero-filled."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from passes import cat_flat_grads

    aten = torch.ops.aten

    def flat_grad(w, b):
        full = aten.full.default([2, 9], 0, dtype=torch.float32, layout=torch.strided, device="cpu", pin_memory=False)
        placed_w = aten.view.default(aten.slice_backward.default(w, [2, 9], 1, 0, 6, 1), [18])
        placed_b = aten.view.default(aten.slice_scatter.default(full, b, 1, 7, 9), [18])
        return placed_w + placed_b

    inputs = (torch.randn(2, 6), torch.randn(2, 2))
    gm = make_fx(flat_grad, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    cat_flat_grads(gm)
    assert "slice" not in gm.code and gm.code.count("aten.cat.default") == 1
    assert "cat.default([w_1, full_default, b_1], 1)" in gm.code
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)
