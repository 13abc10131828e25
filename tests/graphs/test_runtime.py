"""fully_shard's layout, unit choice, parameter exposure, eager gathers and errors (fake PG, world 4)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from fsdp_graph.runtime.flat_param import FlatParamLayout
from fsdp_graph.runtime.unit import flat_params, sharded_units
from tests.graphs.capture import TwoBlock
from tests.workers.models import GPT, BNNet, ConvNet, GPTConfig, OddMLP


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c.startswith(name))


def test_layout_padding_and_ranges():
    layout = FlatParamLayout.build([(("a",), torch.Size([3, 2])), (("b", "c"), torch.Size([5]))], world=4, rank=1)
    assert (layout.numel, layout.padded_numel, layout.shard_numel, layout.shard_start) == (11, 12, 3, 3)
    assert [layout.local_range(s) for s in layout.slots] == [(0, 3), (3, 3)]  # rank 1 holds a[3:6], nothing of b
    last = FlatParamLayout.build([(("a",), torch.Size([3, 2])), (("b",), torch.Size([5]))], world=4, rank=3)
    assert [last.local_range(s) for s in last.slots] == [(0, 0), (0, 2)]  # b[3:5], then one padding element
    flat = last.flatten([torch.arange(6.0).view(3, 2), torch.arange(5.0)])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0]
    assert [t.shape for t in last.unflatten(flat)] == [torch.Size([3, 2]), torch.Size([5])]
    assert last.shard_of([torch.arange(6.0).view(3, 2), torch.arange(5.0)]).tolist() == [3, 4, 0]


@pytest.mark.parametrize("layout", ["flat", "rows"])
def test_shards_cover_every_parameter_once(fake_pg, layout):
    """Rank views tile each parameter exactly: concatenating all ranks' pieces rebuilds it (flat: 1-D slices of the
    flattened parameter; rows: dim-0 blocks, the parameter itself)."""
    torch.manual_seed(0)
    ref = OddMLP()
    pieces = [dict(_shard_as_rank(copy.deepcopy(ref), rank, layout=layout).named_parameters()) for rank in range(4)]
    for name, p in ref.named_parameters():
        rebuilt = torch.cat([pieces[r][name].detach() for r in range(4)])
        assert torch.equal(rebuilt, p.detach() if layout == "rows" else p.detach().reshape(-1)), name


def _shard_as_rank(model: nn.Module, rank: int, **kwargs) -> nn.Module:
    dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    return fsdp_graph.fully_shard(model, **kwargs)


def test_auto_policy_picks_blocks_and_root_last(fake_pg):
    model = fsdp_graph.fully_shard(GPT(GPTConfig(layers=3)))
    assert [s.name for s in flat_params(model)] == ["blocks.0", "blocks.1", "blocks.2", ""]


def test_module_and_size_policies(fake_pg):
    model = fsdp_graph.fully_shard(ConvNet(), wrap=fsdp_graph.ModuleWrapPolicy({nn.Conv2d}))
    assert [s.name for s in flat_params(model)] == ["features.0.0", "features.1.0", ""]
    mlp = fsdp_graph.fully_shard(OddMLP(), wrap=fsdp_graph.size_based_wrap_policy(min_num_params=100))
    assert [s.name for s in flat_params(mlp)] == ["layers.0", "layers.1", ""]  # layers.2 has 60


def test_tied_parameter_stored_once_in_common_ancestor(fake_pg):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    names_before = [n for n, _ in model.named_parameters()]
    fsdp_graph.fully_shard(model)
    root = flat_params(model)[-1]
    tied = [s for s in root.layout.slots if len(s.fqns) > 1]
    assert [s.fqns for s in tied] == [("tok.weight", "head.weight")]
    assert model.tok.weight is model.head.weight  # one Parameter object: the optimizer steps it once
    assert [n for n, _ in model.named_parameters()] == names_before


class CrossUnitTied(nn.Module):
    """A weight shared by two blocks (two units): it must move to their common ancestor, the root."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_cross_unit_tied_weight_goes_to_lowest_common_ancestor(fake_pg):
    model = fsdp_graph.fully_shard(CrossUnitTied())
    units = {s.name: s for s in flat_params(model)}
    assert [s.fqns for s in units[""].layout.slots] == [("blocks.0.weight", "blocks.1.weight")]
    assert [s.fqns for s in units["blocks.0"].layout.slots] == [("blocks.0.bias",)]
    assert model.blocks[0].weight is model.blocks[1].weight


def test_outside_forward_parameters_are_shards_and_free(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    with CountOps() as ops:
        w = model.blocks[0].weight
        params = list(model.parameters())
    assert ops.calls == []
    assert w.shape == (1, 4) and isinstance(w, nn.Parameter) and w is params[0]  # its Shard(0) block: 1 of 4 rows
    flat = model.blocks[0]._fsdp_flat_shards[0]
    assert w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view: optimizer updates land


def test_eager_forward_gathers_each_unit_once(fake_pg):
    model = fsdp_graph.fully_shard(GPT(GPTConfig()))  # the root unit's tok/head weights are read 2x per forward
    with CountOps() as ops:
        model(torch.randint(0, 96, (2, 16)))
    assert ops.count("fsdp.unshard") == len(sharded_units(model)) == 3
    with CountOps() as ops:
        model(torch.randint(0, 96, (2, 16)))
    # the cache is per forward; from the second one on the gathers are prefetched (runtime/eager_prefetch.py),
    # issued as the collective itself rather than through the op
    assert ops.count("_c10d_functional.all_gather_into_tensor") == 3 and ops.count("fsdp.unshard") == 0


def test_deepcopy_of_sharded_model_is_independent(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    clone = copy.deepcopy(model)
    assert clone.blocks[0]._fsdp_views["weight"].unit is clone.blocks[0]
    clone.blocks[0]._fsdp_flat_shards[0].data.fill_(7.0)
    assert not torch.equal(model.blocks[0]._fsdp_flat_shards[0], clone.blocks[0]._fsdp_flat_shards[0])


# ---- errors users can hit: raised early, naming the module/parameter and the fix


def test_error_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsdp_graph.fully_shard(TwoBlock())


def test_error_when_sharded_twice(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    with pytest.raises(RuntimeError, match="module 'TwoBlock' is already sharded.*ModuleWrapPolicy"):
        fsdp_graph.fully_shard(model)
    with pytest.raises(RuntimeError, match="already sharded"):
        fsdp_graph.fully_shard(model.blocks[1])


def test_error_non_floating_parameter(fake_pg):
    model = TwoBlock()
    model.blocks[1].steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match="'blocks.1.steps' has dtype torch.int64.*register_buffer"):
        fsdp_graph.fully_shard(model)


def test_error_mixed_dtypes_in_unit(fake_pg):
    model = TwoBlock()
    model.blocks[0].bias.data = model.blocks[0].bias.data.double()
    with pytest.raises(TypeError, match="unit 'blocks.0' mixes torch.float32.*'blocks.0.bias'"):
        fsdp_graph.fully_shard(model)


def test_error_mesh_size_mismatch(fake_pg):
    mesh = DeviceMesh("cpu", torch.arange(2), _init_backend=False)
    with pytest.raises(ValueError, match="mesh has 2 ranks but the process group has 4"):
        fsdp_graph.fully_shard(TwoBlock(), mesh)


def test_error_two_dimensional_mesh(fake_pg):
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), _init_backend=False)
    with pytest.raises(ValueError, match="2-D mesh needs strategy=ShardingStrategy.HYBRID_SHARD"):
        fsdp_graph.fully_shard(TwoBlock(), mesh)


def test_error_backend_on_unsharded_model(fake_pg):
    torch._dynamo.reset()
    compiled = torch.compile(TwoBlock(), backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    with pytest.raises(Exception, match="fully_shard never sharded.*Call fsdp_graph.fully_shard"):
        compiled(torch.randn(2, 4))


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def test_error_meta_module_without_initialiser(fake_pg):
    with torch.device("meta"):
        model = NoReset()
    with pytest.raises(ValueError, match="'<root>' \\(NoReset\\) has meta-device parameters \\['w'\\].*param_init_fn"):
        fsdp_graph.fully_shard(model)


def _deterministic_init(module: nn.Module) -> None:
    """A param_init_fn initialises the module's own parameters and buffers (FSDP1's contract)."""
    for p in module.parameters(recurse=False):
        p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) / 64 + p.numel())
    if isinstance(module, nn.BatchNorm1d):
        module.reset_running_stats()


def test_meta_device_materialises_only_this_ranks_shard(fake_pg):
    ref = BNNet()
    with torch.no_grad():
        for m in ref.modules():
            _deterministic_init(m)
    pieces = []
    for rank in range(4):
        with torch.device("meta"):
            model = BNNet()
        sharded = _shard_as_rank(model, rank, param_init_fn=_deterministic_init)
        assert all(p.device.type == "cpu" for p in sharded.parameters())
        assert sharded.bn.running_var.device.type == "cpu" and torch.equal(sharded.bn.running_var, torch.ones(12))
        assert (
            sum(s.flat_shard.numel() for s in flat_params(sharded))
            == sum(s.layout.padded_numel for s in flat_params(sharded)) // 4
        )  # each rank keeps a quarter
        pieces.append(dict(sharded.named_parameters()))
    for name, p in ref.named_parameters():
        assert torch.equal(torch.cat([pieces[r][name].detach() for r in range(4)]), p.detach()), name  # rows


def test_meta_buffers_without_param_init_fn_use_reset_parameters(fake_pg):
    """A parameter-free module with meta buffers (Llama's rotary tables) is materialised by its own
    `reset_parameters()`; it used to be called with the module as an extra argument (TypeError)."""
    from fsdp_graph.train.llama import Llama, preset

    cfg = preset("tiny", seq=16)
    with torch.device("meta"):
        model = Llama(cfg)
    fsdp_graph.fully_shard(model)
    reference = Llama(cfg).rope
    assert model.rope.cos.device.type == "cpu" and torch.equal(model.rope.cos, reference.cos)
    assert torch.equal(model.rope.sin, reference.sin)


def test_moving_a_sharded_model_keeps_views_linked(fake_pg):
    """`.double()` after fully_shard converts each flat shard once and re-points the same Parameter objects."""
    model = fsdp_graph.fully_shard(CrossUnitTied())
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    model.double()
    assert list(model.parameters()) == params  # same objects: the optimizer still holds them
    for state in flat_params(model):
        flat = state.flat_shard
        assert flat.dtype == torch.float64 and flat.requires_grad
        for view in state.views:
            assert view.dtype == torch.float64
            assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in params)  # hook moved with the shard
    opt.step()


def test_explicit_one_dimensional_mesh(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    model = fsdp_graph.fully_shard(TwoBlock(), mesh)
    state = flat_params(model)[0]
    assert (state.world, state.group_name) == (4, mesh.get_group().group_name)
    assert state.layout.shard_numel == 5  # blocks.0: 16 + 4 = 20 elements over 4 ranks


def test_meta_init_never_holds_the_full_model(fake_pg):
    """World 4: materialising shard by shard peaks at this rank's quarter plus one unit, not the full model."""
    from fsdp_graph.planning.measure import peak_allocated_bytes

    cfg = GPTConfig(dim=64, layers=6)
    full_bytes = sum(p.numel() * 4 for p in GPT(cfg).parameters())
    with torch.device("meta"):
        model = GPT(cfg)
    peak, _ = peak_allocated_bytes(lambda: fsdp_graph.fully_shard(model))
    largest_unit = max(s.layout.padded_numel * 4 for s in flat_params(model))
    assert peak < full_bytes / 4 + 2 * largest_unit < 0.6 * full_bytes, (peak, full_bytes, largest_unit)


def test_error_hybrid_without_two_dimensional_mesh(fake_pg):
    with pytest.raises(ValueError, match="HYBRID_SHARD needs a 2-D mesh \\(replicate, shard\\).*got no mesh"):
        fsdp_graph.fully_shard(TwoBlock(), strategy=fsdp_graph.ShardingStrategy.HYBRID_SHARD)


def test_error_keep_low_precision_grads_without_param_dtype():
    with pytest.raises(ValueError, match="keep_low_precision_grads=True\\) needs a param_dtype"):
        fsdp_graph.MixedPrecision(keep_low_precision_grads=True)


def test_error_bad_mixed_precision_dtype():
    with pytest.raises(TypeError, match="param_dtype must be a floating-point torch.dtype"):
        fsdp_graph.MixedPrecision(param_dtype=torch.int8)


def test_error_reshard_after_forward_names_unknown_unit(fake_pg):
    with pytest.raises(ValueError, match="reshard_after_forward names 'blocks.7', which is not a unit"):
        model = TwoBlock()
        fsdp_graph.fully_shard(model, wrap=list(model.blocks), reshard_after_forward={"blocks.7": False})


def test_error_no_shard_with_reshard_after_forward(fake_pg):
    with pytest.raises(ValueError, match="NO_SHARD has nothing to reshard"):
        fsdp_graph.fully_shard(TwoBlock(), strategy=fsdp_graph.ShardingStrategy.NO_SHARD, reshard_after_forward=False)


def test_reshard_after_forward_per_unit(fake_pg):
    model = TwoBlock()
    fsdp_graph.fully_shard(model, reshard_after_forward={model.blocks[1]: False, "": False})
    assert {s.name: s.reshard_after_forward for s in flat_params(model)} == {
        "blocks.0": True,
        "blocks.1": False,
        "": False,
    }


def test_frozen_parameters_get_their_own_flat_param(fake_pg):
    model = TwoBlock()
    model.blocks[0].bias.requires_grad_(False)
    fsdp_graph.fully_shard(model)
    states = {s.name: s for s in flat_params(model)}
    assert list(states) == ["blocks.0", "blocks.0[frozen]", "blocks.1", ""]
    assert not states["blocks.0[frozen]"].flat_shard.requires_grad and states["blocks.0"].flat_shard.requires_grad
    assert not model.blocks[0].bias.requires_grad and model.blocks[0].weight.requires_grad


class RecordsInputDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.register_buffer("scale", torch.ones(4))
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(x.dtype)
        for block in self.blocks:
            x = block(x * self.scale)
        return x


def test_mixed_precision_casts_inputs_and_buffers(fake_pg):
    mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, cast_forward_inputs=True)
    model = fsdp_graph.fully_shard(RecordsInputDtype(), mixed_precision=mp)
    seen_by_blocks = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: seen_by_blocks.append(args[0].dtype))
    out = model(torch.randn(2, 4))
    assert model.seen == [torch.bfloat16] and out.dtype == torch.bfloat16  # root cast (cast_root_forward_inputs)
    assert model.scale.dtype == torch.bfloat16  # buffer_dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master shards
    assert seen_by_blocks == [torch.bfloat16, torch.bfloat16]


def test_error_meta_module_partly_materialised(fake_pg):
    with torch.device("meta"):
        model = TwoBlock()
    model.blocks[0].bias = nn.Parameter(torch.zeros(4))
    with pytest.raises(NotImplementedError, match="'blocks.0' mixes meta and materialised parameters"):
        fsdp_graph.fully_shard(model)
