"""`passes.lift_region_mutations` (issue 32) on a tiny model: two blocks that count what they see in a buffer share
one body; the pass moves the buffer write out of it. The snapshots are the spec."""

import copy

import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import fsdp_graph
from passes import lift_region_mutations
from tests.graphs.capture import TwoBlock, code, dynamo_graph


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.detach().sum(0))
        return self.lin(x).relu()


class TwoCounting(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Counting() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_lift_region_mutations_clones_inside_and_copies_back_outside(fake_pg):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(copy.deepcopy(gm))
        lift_region_mutations(gm)  # the body cannot run as Dynamo traced it: the region refuses the write
        return gm.forward

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = fsdp_graph.fully_shard(TwoCounting())
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 4, requires_grad=True))
    (gm,) = graphs
    assert lift_region_mutations(gm) == {"subgraph_0": (1,)}
    assert_expected_inline(
        code(gm),
        """\
def forward(self, L_x_ : torch.Tensor, L_self_modules_blocks_modules_0_fsdp_flat_shards_0_ : torch.Tensor, L_self_modules_blocks_modules_0_dict_buffers_seen_ : torch.Tensor, L_self_modules_blocks_modules_1_fsdp_flat_shards_0_ : torch.Tensor, L_self_modules_blocks_modules_1_dict_buffers_seen_ : torch.Tensor):
    l_x_ = L_x_
    l_self_modules_blocks_modules_0_fsdp_flat_shards_0_ = L_self_modules_blocks_modules_0_fsdp_flat_shards_0_
    l_self_modules_blocks_modules_0_dict_buffers_seen_ = L_self_modules_blocks_modules_0_dict_buffers_seen_
    l_self_modules_blocks_modules_1_fsdp_flat_shards_0_ = L_self_modules_blocks_modules_1_fsdp_flat_shards_0_
    l_self_modules_blocks_modules_1_dict_buffers_seen_ = L_self_modules_blocks_modules_1_dict_buffers_seen_
    flat = torch.ops.fsdp.unshard(l_self_modules_blocks_modules_0_fsdp_flat_shards_0_, 'blocks.0', '0', 4);  l_self_modules_blocks_modules_0_fsdp_flat_shards_0_ = None
    subgraph_0 = self.subgraph_0
    clone = torch.clone(l_self_modules_blocks_modules_0_dict_buffers_seen_)
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', l_x_, clone, flat);  subgraph_0 = l_x_ = clone = flat = None
    getitem_1 = invoke_subgraph[1]
    copy_ = l_self_modules_blocks_modules_0_dict_buffers_seen_.copy_(getitem_1);  l_self_modules_blocks_modules_0_dict_buffers_seen_ = getitem_1 = copy_ = None
    getitem = invoke_subgraph[0];  invoke_subgraph = None
    flat_1 = torch.ops.fsdp.unshard(l_self_modules_blocks_modules_1_fsdp_flat_shards_0_, 'blocks.1', '0', 4);  l_self_modules_blocks_modules_1_fsdp_flat_shards_0_ = None
    subgraph_1 = self.subgraph_0
    clone_1 = torch.clone(l_self_modules_blocks_modules_1_dict_buffers_seen_)
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', getitem, clone_1, flat_1);  subgraph_1 = getitem = clone_1 = flat_1 = None
    getitem_2 = invoke_subgraph_1[1]
    copy__1 = l_self_modules_blocks_modules_1_dict_buffers_seen_.copy_(getitem_2);  l_self_modules_blocks_modules_1_dict_buffers_seen_ = getitem_2 = copy__1 = None
    out = invoke_subgraph_1[0];  invoke_subgraph_1 = None
    return (out,)""",
    )
    assert_expected_inline(
        code(gm.subgraph_0),
        """\
def forward(self, l_x_ : torch._subclasses.fake_tensor.FakeTensor, l_self_modules_blocks_modules_0_dict_buffers_seen_ : torch._subclasses.fake_tensor.FakeTensor, flat : torch._subclasses.fake_tensor.FakeTensor):
    clone = torch.clone(l_self_modules_blocks_modules_0_dict_buffers_seen_);  l_self_modules_blocks_modules_0_dict_buffers_seen_ = None
    detach = l_x_.detach()
    sum_1 = detach.sum(0);  detach = None
    add_ = clone.add_(sum_1);  sum_1 = add_ = None
    view = flat.view(4, 5)
    blocks = view[(slice(None, None, None), slice(0, 4, None))];  view = None
    full = blocks.view(4, 4);  blocks = None
    view_2 = flat.view(4, 5);  flat = None
    blocks_1 = view_2[(slice(None, None, None), slice(4, 5, None))];  view_2 = None
    full_1 = blocks_1.view(4);  blocks_1 = None
    linear = torch._C._nn.linear(l_x_, full, full_1);  l_x_ = full = full_1 = None
    out = linear.relu();  linear = None
    return (out, clone)""",
    )


def test_lift_region_mutations_noop_without_writes(fake_pg):
    """Bodies that write nothing, and graphs without bodies, are left as they are."""
    torch.manual_seed(0)
    gm = dynamo_graph(fsdp_graph.fully_shard(TwoBlock()), torch.randn(2, 4, requires_grad=True))
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    before = code(gm), code(gm.subgraph_0)
    assert lift_region_mutations(gm) == {}
    assert (code(gm), code(gm.subgraph_0)) == before
    plain = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = code(plain)
    assert lift_region_mutations(plain) == {} and code(plain) == before
