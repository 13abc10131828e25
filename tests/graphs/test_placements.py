"""Issue 35: per-parameter placements (`Shard(d)`) and meshes, on the fake process group (world 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.tensor import DTensor, Shard

import fsdp_graph
from fsdp_graph import fsdp2
from fsdp_graph.runtime.flat_param import RowShardLayout
from fsdp_graph.runtime.unit import flat_params
from tests.graphs.capture import TwoBlock
from tests.workers.fsdp2_upstream import mlp_stack
from tests.workers.placements import MoEModel, shard_moe_fsdp2, titan_meshes


@pytest.fixture(autouse=True)
def _no_leftover_calls():
    yield
    fsdp2.calls._PENDING.clear()


SHAPES = [(("w",), torch.Size([3, 5, 2]), 1), (("b",), torch.Size([5]), 0), (("e",), torch.Size([2, 6]), 1)]


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_shard_d_blocks_follow_torch_chunk_and_round_trip(world):
    """Each rank's piece of a `Shard(d)` parameter is torch.chunk's on dim d (uneven or empty), contiguous in its
    block; the copy-out joins every rank's block back, and its backward (the copy-in) puts each gradient exactly in
    its parameter's blocks, zeros in the padding."""
    values = [torch.randn(shape) for _, shape, _ in SHAPES]
    layouts = [RowShardLayout.build(SHAPES, world, r) for r in range(world)]
    for layout in layouts:
        shard = layout.shard_of(values)
        for slot, value in zip(layout.slots, values):
            chunks = value.chunk(world, slot.dim)
            expected = chunks[layout.rank] if layout.rank < len(chunks) else value.narrow(slot.dim, 0, 0)
            local = layout.local_view(shard, slot)
            assert local.is_contiguous() and torch.equal(local, expected), (world, layout.rank, slot)
    gathered = torch.cat([layout.shard_of(values) for layout in layouts]).requires_grad_()
    params = layouts[0].unflatten(gathered)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    sum((p * (i + 1)).sum() for i, p in enumerate(params)).backward()
    assert torch.equal(gathered.grad, layouts[0].flatten([torch.full_like(v, i + 1.0) for i, v in enumerate(values)]))


def test_shard_dim_must_exist_and_flat_layout_has_none():
    with pytest.raises(ValueError, match="'e' of shape \\(2, 6\\) cannot be sharded on dim 2"):
        RowShardLayout.build([(("e",), torch.Size([2, 6]), 2)], world=2, rank=0)
    with pytest.raises(ValueError, match="Shard\\(1\\).*layout='rows'"):
        fsdp_graph.runtime.flat_param.FlatParamLayout.build([(("e",), torch.Size([2, 6]), 1)], world=2, rank=0)


def test_unit_with_a_shard_1_parameter(fake_pg):
    """A Linear(8, 4) whose weight is sharded on dim 1 (each rank a (4, 2) column block), its bias on dim 0: one
    all-gather of the unit's 9-element shards; the weight is the (4, 4, 2) blocks moved to dim 1 (a copy), the
    bias a column range; the backward reduces one flat gradient."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    weight = model[0].weight
    fsdp_graph.fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p is weight else None)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {"0.weight": (4, 2), "0.bias": (1,)}
    backend = fsdp_graph.make_backend(inductor=False)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 8)).sum().backward()
    reports = {r.stage: r for r in backend.reports}
    assert reports["bw"].collectives.counts == {"reduce_scatter": 1}
    assert_expected_inline(
        reports["fw"].code,
        """\
def forward(self, primals_1, primals_2):
    all_gather_into_tensor_default = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 4, '0');  primals_2 = None
    wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
    view = torch.ops.aten.view.default(wait_tensor_default, [4, 9]);  wait_tensor_default = None
    slice_1 = torch.ops.aten.slice.Tensor(view, 1, 0, 8)
    view_1 = torch.ops.aten.view.default(slice_1, [4, 4, 2]);  slice_1 = None
    permute = torch.ops.aten.permute.default(view_1, [1, 0, 2]);  view_1 = None
    clone = torch.ops.aten.clone.default(permute, memory_format = torch.contiguous_format);  permute = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(clone, [4, 8]);  clone = None
    slice_2 = torch.ops.aten.slice.Tensor(view, 1, 8, 9);  view = None
    view_3 = torch.ops.aten.view.default(slice_2, [4]);  slice_2 = None
    t = torch.ops.aten.t.default(_unsafe_view);  _unsafe_view = None
    addmm = torch.ops.aten.addmm.default(view_3, primals_1, t);  view_3 = t = None
    return (addmm, primals_1)""",
    )
    sd = model.state_dict()
    assert sd["0.weight"].placements == (Shard(1),) and sd["0.weight"].to_local().shape == (4, 2)
    assert sd["0.bias"].placements == (Shard(0),)


def test_unit_on_two_meshes(fake_pg):
    """torchtitan's MoE recipe through `fsdp2.fully_shard`: each block's 4 experts on the `efsdp` mesh (2 ranks,
    `Shard(0)`), everything else on `fsdp` (4 ranks); both `_unflatten`ed views of one world mesh. Each block holds
    two flat parameters, each gathered and reduced over its own mesh's group (group 1: efsdp); `explain()` counts
    the bytes per mesh dimension; state-dict entries live on their parameter's mesh."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    fsdp_mesh, efsdp_mesh = titan_meshes(4, ep=2)
    model = shard_moe_fsdp2(MoEModel(depth=2), fsdp2.fully_shard, fsdp_mesh, efsdp_mesh)
    assert not flat_params(model)  # the calls asked shard_placement_fn without sharding anything yet
    list(model.parameters())
    states = {s.name: (s.world, s.mesh.mesh_dim_names) for s in flat_params(model)}
    assert states == {
        "layers.0": (4, ("fsdp",)),
        "layers.0[efsdp]": (2, ("efsdp",)),
        "layers.1": (4, ("fsdp",)),
        "layers.1[efsdp]": (2, ("efsdp",)),
        "": (4, ("fsdp",)),
    }
    w1 = model.layers[0].experts.w1
    assert isinstance(w1, DTensor) and w1.device_mesh == efsdp_mesh and w1.placements == (Shard(0),)
    assert w1.to_local().shape == (2, 8, 16)
    backend = fsdp_graph.make_backend(inductor=False)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 8)).sum().backward()
    assert backend.dynamo_graphs == 1
    assert_expected_inline(
        "\n".join(f"{r.stage}: {line}" for r in backend.reports for line in r.fingerprint),
        """\
fw: all_gather_into_tensor(group=0, group_size=4, 26 x float32 -> 104 x float32)
fw: all_gather_into_tensor(group=0, group_size=4, 12 x float32 -> 48 x float32)
fw: all_gather_into_tensor(group=fsdp_graph:shard:da29a4245a5f, group_size=2, 512 x float32 -> 1024 x float32)
fw: all_gather_into_tensor(group=0, group_size=4, 12 x float32 -> 48 x float32)
fw: all_gather_into_tensor(group=fsdp_graph:shard:da29a4245a5f, group_size=2, 512 x float32 -> 1024 x float32)
bw: all_gather_into_tensor(group=0, group_size=4, 12 x float32 -> 48 x float32)
bw: all_gather_into_tensor(group=fsdp_graph:shard:da29a4245a5f, group_size=2, 512 x float32 -> 1024 x float32)
bw: all_gather_into_tensor(group=0, group_size=4, 12 x float32 -> 48 x float32)
bw: all_gather_into_tensor(group=fsdp_graph:shard:da29a4245a5f, group_size=2, 512 x float32 -> 1024 x float32)
bw: reduce_scatter_tensor(group=fsdp_graph:shard:da29a4245a5f, reduce_op=sum, group_size=2, 1024 x float32 -> 512 x float32)
bw: reduce_scatter_tensor(group=0, reduce_op=sum, group_size=4, 48 x float32 -> 12 x float32)
bw: reduce_scatter_tensor(group=fsdp_graph:shard:da29a4245a5f, reduce_op=sum, group_size=2, 1024 x float32 -> 512 x float32)
bw: reduce_scatter_tensor(group=0, reduce_op=sum, group_size=4, 48 x float32 -> 12 x float32)
bw: reduce_scatter_tensor(group=0, reduce_op=sum, group_size=4, 104 x float32 -> 26 x float32)""",
    )
    report = fsdp_graph.explain(model, torch.randn(2, 8), hardware="nvlink")
    assert set(report.sent_bytes_by_group) == {"fsdp", "efsdp"}, report.sent_bytes_by_group
    sd = model.state_dict()
    assert sd["layers.1.experts.w2"].device_mesh == efsdp_mesh and sd["layers.1.norm.weight"].device_mesh == fsdp_mesh


def test_fsdp2_calls_may_differ_in_mesh_and_policies(fake_pg):
    """FSDP2's per-call settings: a block in bf16 with its own mesh, another offloaded to the CPU and casting its
    inputs to fp32, the root as given."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    fsdp_mesh, efsdp_mesh = titan_meshes(4, ep=2)
    model = TwoBlock(8)
    fsdp2.fully_shard(model.blocks[0], mesh=efsdp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fsdp2.fully_shard(  # its inputs cast back to fp32, as FSDP2 casts them
        model.blocks[1],
        mesh=fsdp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=False),
    )
    fsdp2.fully_shard(model, mesh=fsdp_mesh)
    list(model.parameters())
    states = {s.name: s for s in flat_params(model)}
    assert (states["blocks.0"].world, states["blocks.0"].param_dtype) == (2, torch.bfloat16)
    assert states["blocks.1"].compute_device is not None and states["blocks.1"].param_dtype is None
    assert states[""].world == 4 and states[""].compute_device is None
    model(torch.randn(2, 8)).sum().backward()
    assert model.blocks[0].weight.grad.dtype == torch.float32


def test_native_placements_are_checked(fake_pg):
    with pytest.raises(TypeError, match="'0.weight' got the placement Replicate"):
        replicated = fsdp_graph.ParamPlacement(torch.distributed.tensor.Replicate())
        fsdp_graph.fully_shard(nn.Sequential(nn.Linear(4, 4)), shard_placement_fn=lambda p: replicated)
    with pytest.raises(ValueError, match="'0.bias' of shape \\(4,\\).*Shard\\(dim=1\\), which names no dim"):
        fsdp_graph.fully_shard(nn.Sequential(nn.Linear(4, 4)), shard_placement_fn=lambda p: Shard(1))
    # test_fully_shard_init.py::test_invalid_shard_dim: FSDP2 raises an AssertionError, at the call
    with pytest.raises(AssertionError, match="'bias' of 'Linear' of shape \\(4,\\).*no dim"):
        fsdp2.fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(ValueError, match="unit_options names 'nope'"):
        fsdp_graph.fully_shard(TwoBlock(), unit_options={"nope": fsdp_graph.UnitOptions()})


def test_shard_placement_fn_leaves_recorded_calls_unsharded(fake_pg):
    """Asking `shard_placement_fn` lists the call's parameters without `parameters()`, which would shard the calls
    recorded before it (here the first block, alone) and then refuse the root at first use."""
    model = mlp_stack()
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    assert not flat_params(model) and not flat_params(model[0])
    list(model.parameters())
    assert [s.name for s in flat_params(model)] == ["0", ""]
    assert model[1].in_proj.weight.placements == (Shard(1),) and model[0].in_proj.weight.placements == (Shard(0),)
