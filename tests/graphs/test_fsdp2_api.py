"""Issue 28: `fsdp_graph.fsdp2`'s API on a fake world: FSDP2's calling convention, torch's classes, every
`FSDPModule` method of torch's accounted for, and clear refusals of what the engine cannot do. Issue 32: what FSDP2
accepts and this front door refused (requires_grad changed after the calls, `load_state_dict(assign=True)` also into a
meta model, `output_dtype`, meta models with CPU offload, `reuse_blocks`) and FSDP2's error for tied weights in two
calls; their multi-rank numerics against torch's FSDP2: tests/numerics/test_fsdp2_semantics.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp_graph
from fsdp_graph import fsdp2
from fsdp_graph.fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy
from fsdp_graph.fsdp2.module import FSDP2Module
from fsdp_graph.runtime.unit import flat_params
from tests.workers.fsdp2_upstream import MLP, mlp_stack, row_block, shard_blocks


class TiedLM(nn.Module):
    """Embedding and head share a weight (TestFullyShardSharedParams's tied weights)."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = mlp_stack(dim, 2)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


@pytest.fixture(autouse=True)
def _no_leftover_calls():
    yield
    fsdp2.calls._PENDING.clear()


def test_every_torch_fsdp_module_method_is_ours():
    # Each method of torch's FSDPModule is overridden (working, a documented no-op, or NotImplementedError): none
    # falls through to FSDP2's own, which would look for FSDP2's runtime state.
    methods = [n for n, v in vars(TorchFSDPModule).items() if callable(v) and not n.startswith("__")]
    assert len(methods) >= 25, methods
    missing = [n for n in methods if n not in vars(FSDP2Module)]
    assert not missing, missing


def test_bottom_up_calls_then_root_make_one_engine_call(fake_pg):
    model = mlp_stack()
    for block in model:
        assert fsdp2.fully_shard(block, reshard_after_forward=False) is block
    fsdp2.fully_shard(model)
    assert isinstance(model[0], TorchFSDPModule) and isinstance(model, TorchFSDPModule)
    assert not flat_params(model)  # nothing sharded before the model is used
    torch.optim.SGD(model.parameters(), lr=0.1)  # the optimizer sees the sharded parameters
    states = {s.name: s for s in flat_params(model)}
    assert sorted(states) == ["0", "1", "2"]  # the root (a Sequential) owns no parameter
    assert [states[n].reshard_after_forward for n in ("0", "1", "2")] == [False, False, False]
    weight = model[0].in_proj.weight  # a DTensor, as FSDP2's: this rank holds the row block of a (32, 8) weight
    assert isinstance(weight, DTensor) and weight.shape == (32, 8) and weight.placements == (Shard(0),)
    assert weight.to_local().shape == (32 // 4, 8)


def test_list_call_is_one_unit_held_by_its_last_module(fake_pg):
    model = nn.Sequential(MLP(8), nn.LayerNorm(8), nn.Linear(8, 16))
    fsdp2.fully_shard([model[1], model[2]])
    fsdp2.fully_shard(model)
    list(model.parameters())
    owners = {s.name: [n for slot in s.layout.slots for n in slot.fqns] for s in flat_params(model)}
    assert owners["2"] == ["1.weight", "1.bias", "2.weight", "2.bias"], owners
    model(torch.randn(2, 8)).sum().backward()
    assert model[1].weight.grad is not None


def test_default_reshard_is_true_below_the_root_and_false_for_it(fake_pg):
    model = nn.Sequential(MLP(8), MLP(8), nn.Linear(8, 8))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model[1])
    fsdp2.fully_shard(model)
    list(model.parameters())
    assert {s.name: s.reshard_after_forward for s in flat_params(model)} == {"0": True, "1": True, "": False}


def test_controls_reach_the_units(fake_pg):
    model = nn.Sequential(MLP(8), MLP(8), nn.Linear(8, 8))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model[1])
    fsdp2.fully_shard(model)
    model.set_gradient_divide_factor(1.0)  # a use: shards the recorded calls
    model[1].set_gradient_divide_factor(2.0)
    factors = {s.name: s.divide_factor for s in flat_params(model)}
    assert factors == {"0": None, "1": 2.0, "": 1.0}  # not recursive, as FSDP2
    model.set_reshard_after_forward(False)
    assert not any(s.reshard_after_forward for s in flat_params(model))
    model.set_requires_gradient_sync(False)
    assert not model._fsdp_root.requires_gradient_sync
    with pytest.raises(NotImplementedError, match="set_requires_gradient_sync.*whole model"):
        model[0].set_requires_gradient_sync(True)
    for method, args in [("set_custom_all_gather", (None,)), ("set_all_reduce_hook", (print,))]:
        with pytest.raises(NotImplementedError, match=method):
            getattr(model, method)(*args)


def test_native_error_gone_for_fsdp2_convention_and_type_error_gone_for_mp_policy(fake_pg):
    model = mlp_stack()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_blocks(model, mp_policy=policy)
    list(model.parameters())
    assert all(s.param_dtype == torch.bfloat16 and s.reduce_dtype == torch.float32 for s in flat_params(model))


def test_refusals_name_what_to_change(fake_pg):
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        fsdp2.fully_shard(mlp_stack(), mp_policy=fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16))

    class NoMesh:  # a ShardPlacementResult's shape, but its mesh_info has no mesh
        placement, mesh_info = None, object()

    with pytest.raises(TypeError, match="'in_proj.weight'.*mesh_info without a mesh"):
        fsdp2.fully_shard(MLP(8), shard_placement_fn=lambda p: NoMesh())


def test_group_as_outermost_call_is_refused(fake_pg):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fsdp2.fully_shard([model[0], model[1]])
    with pytest.raises(NotImplementedError, match="list of modules must be inside a later fully_shard"):
        list(model[0].parameters())


def test_call_after_first_use_is_refused(fake_pg):
    model = mlp_stack()
    fsdp2.fully_shard(model[0])
    list(model[0].parameters())
    with pytest.raises(RuntimeError, match="sharded when the model was first used"):
        fsdp2.fully_shard(model)


def test_pending_calls_under_compile_give_a_clear_error(fake_pg):
    model = fsdp2.fully_shard(mlp_stack())
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    with pytest.raises(Exception, match="before compiling the model"):
        compiled(torch.randn(2, 8))


def test_2d_mesh_is_hsdp(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = mlp_stack()
    shard_blocks(model, mesh=mesh)
    list(model.parameters())
    assert all(s.world == 2 and s.replicate_world == 2 for s in flat_params(model))


def test_native_unit_of_several_modules_refuses_a_module_inside_another(fake_pg):
    model = mlp_stack()
    with pytest.raises(ValueError, match="lists '0.in_proj' inside '0'"):
        fsdp_graph.fully_shard(model, wrap=[(model[0], model[0].in_proj)])


def test_optimizer_on_an_outer_module_never_called_gets_the_sharded_parameters(fake_pg):
    model = nn.Sequential(MLP(8), nn.Linear(8, 8))
    fsdp2.fully_shard(model[0])  # no call on the model itself
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = opt.param_groups[0]["params"]
    local = [tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape) for p in params]
    assert local == [(8, 8), (8,), (2, 32), (2,), (8, 8), (8,)]  # model[0]'s row blocks, model[1] whole
    assert params[0] is model[0].in_proj.weight and isinstance(model[0], TorchFSDPModule)
    model(torch.randn(2, 8)).sum().backward()
    assert model[0].in_proj.weight.grad.to_local().shape == (8, 8) and model[1].weight.grad.shape == (8, 8)


def test_int_reshard_after_forward_keeps_a_piece(fake_pg):
    model = mlp_stack()
    shard_blocks(model, reshard_after_forward=2)  # of the fake world's 4 ranks
    list(model.parameters())
    assert {s.post_forward_world for s in flat_params(model)} == {2}


def test_torchtitan_apply_fsdp_units_and_reshard_flags(fake_pg):
    from tests.workers import titan

    if (why := titan.available()) is not None:
        pytest.skip(why)

    model = titan.build()
    titan.apply_fsdp(model, init_device_mesh("cpu", (4,)), fsdp2.fully_shard)
    reshard = {s.name: s.reshard_after_forward for s in flat_params(model)}
    layers = {f"layers.{name}": True for name in model.layers}
    # the embedding and each layer reshard; [norm, lm_head] is one unit that does not (torchtitan's choice); the
    # root owns nothing
    assert reshard == {"tok_embeddings": True, **layers, "lm_head": False}, reshard
    assert all(s.divide_factor == 1.0 for s in flat_params(model))  # disable_fsdp_gradient_division reached them


def test_using_one_model_leaves_another_models_calls_recorded(fake_pg):
    first, second = mlp_stack(), mlp_stack()
    for block in second:
        fsdp2.fully_shard(block)
    shard_blocks(first)
    list(first.parameters())
    assert flat_params(first) and not any("_fsdp_states" in b.__dict__ for b in second)
    fsdp2.fully_shard(second)  # its root call still comes after the first model's use
    list(second.parameters())
    assert sorted(s.name for s in flat_params(second)) == ["0", "1", "2"]


def test_torchtitan_meta_device_flow(fake_pg):
    # torchtitan's trainer: build on meta, apply FSDP, then to_empty() and the model's own init on the shards
    # (its fused-QKV init builds the full weight and copy_()s it into the DTensor parameter).
    import importlib

    from tests.workers import titan

    if (why := titan.available()) is not None:
        pytest.skip(why)

    titan._import_models()
    with torch.device("meta"):
        model = importlib.import_module("torchtitan.models.llama3").llama3_configs["debugmodel"]("flex").build()
    titan.apply_fsdp(model, init_device_mesh("cpu", (4,)), fsdp2.fully_shard)
    model.to_empty(device="cpu")
    model.init_states()
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params.values())
    wqkv = params["layers.0.attention.qkv_linear.wqkv.weight"]
    assert wqkv.shape == (768, 256) and wqkv.to_local().shape == (192, 256)
    assert 0.01 < wqkv.to_local().std().item() < 0.05  # initialised, through the flat shard
    flat_shard = model.layers["0"]._fsdp_flat_shards[0]  # what the forward gathers: the init wrote into it
    assert wqkv.to_local().untyped_storage().data_ptr() == flat_shard.untyped_storage().data_ptr()


def test_unshard_exposes_full_tensors_until_reshard(fake_pg):
    model = mlp_stack()
    shard_blocks(model)
    block = model[1]
    assert block.unshard() is None  # a use: shards the recorded calls, then gathers this unit
    assert not isinstance(block.in_proj.weight, DTensor) and block.in_proj.weight.shape == (32, 8)
    assert isinstance(model[0].in_proj.weight, DTensor)  # not recursive into other units
    block.reshard()
    assert isinstance(block.in_proj.weight, DTensor) and block.in_proj.weight.to_local().shape == (8, 8)


# ---- issue 32: supported instead of refused


def test_requires_grad_change_after_the_calls_recompiles_only_what_changed(fake_pg):
    # Frozen views are read detached and their flat shard requires grad only while one view does; the compiled
    # graph is specialised on both, for every unit, also those running another unit's reused block body.
    model = mlp_stack()
    shard_blocks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def step() -> list[bool]:
        compiled(torch.randn(2, 8)).sum().backward()
        has_grad = [p.grad is not None for p in model.parameters()]
        opt.zero_grad()
        return has_grad

    assert all(step())
    for block in model:  # frozen in every block: one new graph
        block.in_proj.weight.requires_grad_(False)
    assert step() == [False, True, True, True] * 3 and backend.dynamo_graphs == 2
    model[1].in_proj.weight.requires_grad_(True)  # block 1 ran block 0's body: its change must be seen too
    assert step() == [False, True, True, True, True, True, True, True, False, True, True, True]
    assert backend.dynamo_graphs == 3
    model[2].requires_grad_(False)  # a whole unit: its flat shard no longer requires grad
    assert not model[2]._fsdp_states[0].flat_shard.requires_grad
    assert step()[8:] == [False] * 4 and backend.dynamo_graphs == 4


def _torchtune_style_load(model: nn.Module, full: dict[str, torch.Tensor]):
    """torchtune 0.6.1's `load_from_full_model_state_dict` on FSDP2 (its code path without `set_model_state_dict`):
    each full tensor distributed as the model's sharded (meta) state dict says, loaded with assign=True."""
    meta_sd = model.state_dict()
    sharded = {
        name: nn.Parameter(distribute_tensor(value.to(meta_sd[name].dtype), meta_sd[name].device_mesh, meta_sd[name].placements))
        for name, value in full.items()
    }
    return model.load_state_dict(sharded, strict=True, assign=True)


@pytest.mark.parametrize("offload", [False, True])
def test_assign_load_into_a_meta_model_lands_in_the_flat_shards(fake_pg, offload):
    torch.manual_seed(0)
    full = mlp_stack().state_dict()
    with torch.device("meta"):
        model = mlp_stack()
    shard_blocks(model, **({"offload_policy": CPUOffloadPolicy()} if offload else {}))
    objects = {n: id(p) for n, p in model.named_parameters()}
    assert str(_torchtune_style_load(model, full)) == "<All keys matched successfully>"
    for name, p in model.named_parameters():  # exactly the given values (the fake world's rank 0 block)
        assert id(p) == objects[name] and p.device.type == "cpu"
        assert torch.equal(p.to_local(), row_block(full[name], 0, 4)), name
        shard = flat_params(model)[int(name[0])].flat_shard  # ... as the gather will read them
        assert p.to_local().untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    assert all(torch.equal(v.to_local(), row_block(full[k], 0, 4)) for k, v in model.state_dict().items())
    model(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_assign_load_piece_by_piece_keeps_a_flat_shard_on_meta_until_it_is_whole(fake_pg):
    # FSDP2's test_dp_state_dict_cpu_offload loads a meta model one parameter at a time (strict=False): the
    # parameters not loaded yet stay on meta, as FSDP2's do, and nothing is allocated with garbage in it.
    torch.manual_seed(0)
    full = MLP(8).state_dict()
    with torch.device("meta"):
        model = MLP(8)
    fsdp2.fully_shard(model, offload_policy=CPUOffloadPolicy())
    meta_sd = model.state_dict()
    for name in ("in_proj.weight", "in_proj.bias", "out_proj.weight"):
        spec = meta_sd[name]
        model.load_state_dict({name: distribute_tensor(full[name], spec.device_mesh, spec.placements)}, strict=False, assign=True)
        assert all(p.device.type == "meta" for p in model.parameters())
    spec = meta_sd["out_proj.bias"]
    model.load_state_dict({"out_proj.bias": distribute_tensor(full["out_proj.bias"], spec.device_mesh, spec.placements)}, strict=False, assign=True)
    assert all(torch.equal(p.to_local(), row_block(full[n], 0, 4)) for n, p in model.named_parameters())
    assert all(v.device.type == "cpu" for v in model.state_dict().values())


def test_assign_load_refuses_another_dtype_naming_the_parameter(fake_pg):
    model = mlp_stack()
    shard_blocks(model)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"'0.in_proj.weight' is torch.bfloat16 in the state dict but torch.float32"):
        model.load_state_dict(sd, assign=True)


def test_assign_load_of_a_real_model_keeps_the_parameter_objects_and_ties(fake_pg):
    torch.manual_seed(0)
    model, other = TiedLM(), TiedLM()
    full = other.state_dict()
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    params = list(model.parameters())
    _torchtune_style_load(model, full)
    assert list(model.parameters()) == params and model.head.weight is model.embed.weight
    assert all(torch.equal(v.to_local(), row_block(full[k], 0, 4)) for k, v in model.state_dict().items())


def test_output_dtype_casts_the_outputs_of_every_called_module_as_fsdp2(fake_pg):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float16)
    seen: dict[str, list[torch.dtype]] = {}
    for name, shard in (("ours", fsdp2.fully_shard), ("fsdp2", torch.distributed.fsdp.fully_shard)):
        model = nn.Sequential(MLP(8), nn.LayerNorm(8), nn.Linear(8, 8))
        shard(model[0], mp_policy=policy)
        shard([model[1], model[2]], mp_policy=policy)
        shard(model, mp_policy=policy)
        dtypes = seen[name] = []
        for m in (model[0], model[0].out_proj, model[1], model[2], model):
            m.register_forward_hook(lambda m, args, out, dtypes=dtypes: dtypes.append(out.dtype))
        model(torch.randn(2, 8))
    # FSDP2 casts the output of each module a call names (each of a list), not of the modules inside them
    assert seen["ours"] == seen["fsdp2"], seen
    assert seen["ours"] == [torch.bfloat16, torch.float16, torch.float16, torch.float16, torch.float16]


def test_meta_model_with_cpu_offload_materialises_on_the_cpu(fake_pg):
    with torch.device("meta"):
        model = mlp_stack()
    shard_blocks(model, offload_policy=CPUOffloadPolicy())
    assert all(p.device.type == "meta" for p in model.parameters())  # sharded on meta, as FSDP2
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    assert all(s.flat_shard.device.type == "cpu" and s.compute_device.type == "cpu" for s in flat_params(model))
    model(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())


def test_tied_weights_in_two_calls_raise_fsdp2s_value_error(fake_pg):
    for called in (("embed", "head"), ("embed",)):
        theirs, ours = TiedLM(), TiedLM()
        for name in called:
            torch.distributed.fsdp.fully_shard(getattr(theirs, name))
            fsdp2.fully_shard(getattr(ours, name))
        torch.distributed.fsdp.fully_shard(theirs)
        fsdp2.fully_shard(ours)
        with pytest.raises(ValueError, match="shared with a parameter already managed by another FSDP group"):
            theirs(torch.randint(0, 16, (2, 5)))
        with pytest.raises(ValueError, match=r"'(head|embed)\.weight' is the same tensor as .*fully_shard\(\['embedding', 'output_head'\]\)|one call"):
            list(ours.parameters())
        fsdp2.calls._PENDING.clear()
    ours = TiedLM()  # the same modules in one list call: accepted, one flat parameter holds the weight once
    fsdp2.fully_shard([ours.embed, ours.head])
    fsdp2.fully_shard(ours)
    assert ours.embed.weight is ours.head.weight


def test_reuse_blocks_is_a_keyword_and_a_unit_with_nothing_to_share_does_not_warn(fake_pg, recwarn):
    from fsdp_graph.runtime.block_region import BLOCK_KEY

    def accelerate_style(model: nn.Sequential, **options) -> None:  # blocks, then [norm, head] as one unit, root
        for block in model[:3]:
            fsdp2.fully_shard(block, **options)
        fsdp2.fully_shard([model[3], model[4]], reshard_after_forward=False, **options)
        fsdp2.fully_shard(model, **options)

    model = nn.Sequential(MLP(8), MLP(8), MLP(8), nn.LayerNorm(8), nn.Linear(8, 16))
    accelerate_style(model)
    list(model.parameters())
    assert not [w for w in recwarn if "reuse_blocks" in str(w.message)]  # the [norm, head] unit lost nothing
    assert all(BLOCK_KEY in block.__dict__ for block in model[:3])
    model = nn.Sequential(MLP(8), MLP(8), MLP(8), nn.LayerNorm(8), nn.Linear(8, 16))
    accelerate_style(model, reuse_blocks=False)
    list(model.parameters())
    assert not any(BLOCK_KEY in block.__dict__ for block in model[:3])
    model = mlp_stack()
    fsdp2.fully_shard(model[0], reuse_blocks=True)
    fsdp2.fully_shard(model, reuse_blocks=False)
    with pytest.raises(ValueError, match="reuse_blocks=True but.*reuse_blocks=False"):
        list(model.parameters())


def test_a_unit_losing_a_shared_body_still_warns_naming_the_reachable_fix(fake_pg):
    class Outer(nn.Module):  # a block holding a unit of its own: blocks alike that cannot share a body
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.norm = MLP(8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.inner(x))

    model = nn.Sequential(Outer(), Outer())
    for block in model:
        fsdp2.fully_shard(block.inner)
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    with pytest.warns(UserWarning, match=r"reuse_blocks: unit '0' contains another unit.*fsdp_graph.fsdp2.fully_shard"):
        list(model.parameters())


def test_blocks_called_with_inputs_of_another_dtype_do_not_share_a_body(fake_pg):
    # A block body is traced for its arguments' dtypes: the first block gets float32 (a bf16 embedding plus a
    # float32 table), the next its bf16 output. Sharing one body made the backward fail on mixed dtypes.
    from tests.workers.fsdp2_semantics import RopeLM

    model = RopeLM()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    for block in model.blocks:
        fsdp2.fully_shard(block, mp_policy=policy)
    fsdp2.fully_shard(model, mp_policy=policy)
    fsdp2.shard_pending()
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(torch.randint(0, 16, (2, 6))).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters()) and backend.dynamo_graphs == 1


def test_to_empty_on_a_module_inside_a_unit_keeps_its_parameters_in_the_flat_shard(fake_pg):
    # torchtune's LoRA recipe: the base frozen and the adapters trainable before the calls, the model sharded on
    # meta, each adapter module `to_empty()`d and initialised on its own, then the base loaded with assign. The
    # adapters' parameters must stay views of their unit's flat shard (nn.Module's own `_apply` unlinked them: the
    # init wrote tensors the gather never read).
    torch.manual_seed(0)
    full = mlp_stack().state_dict()
    with torch.device("meta"):
        model = mlp_stack()
    for block in model:
        block.in_proj.requires_grad_(False)  # the base; out_proj plays the adapter
    shard_blocks(model)
    for block in model:
        block.out_proj.to_empty(device="cpu")
        with torch.no_grad():
            block.out_proj.weight.fill_(0.5)
            block.out_proj.bias.zero_()
    base = {k: v for k, v in full.items() if "in_proj" in k}
    meta_sd = model.state_dict()
    sharded = {k: distribute_tensor(v, meta_sd[k].device_mesh, meta_sd[k].placements) for k, v in base.items()}
    model.load_state_dict(sharded, strict=False, assign=True)
    for index, block in enumerate(model):
        for name, p in block.named_parameters():
            state = next(s for s in flat_params(model) if any(v is p for v in s.views))
            assert p.device.type == "cpu" and p.to_local().untyped_storage().data_ptr() == state.flat_shard.untyped_storage().data_ptr()
            expected = row_block(full[f"{index}.{name}"], 0, 4) if "in_proj" in name else None
            assert expected is None or torch.equal(p.to_local(), expected), name
        assert (block.out_proj.weight.to_local() == 0.5).all()
    model(torch.randn(2, 8)).sum().backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    with pytest.raises(NotImplementedError, match=r"called on it alone.*unit '0'.*model.to\(\.\.\.\)"):
        model[0].out_proj.to(torch.float64)
