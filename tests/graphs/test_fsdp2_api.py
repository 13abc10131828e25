"""Issue 28: `fsdp_graph.fsdp2`'s API on a fake world: FSDP2's calling convention, torch's classes, every
`FSDPModule` method of torch's accounted for, and clear refusals of what the engine cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

import fsdp_graph
from fsdp_graph import fsdp2
from fsdp_graph.fsdp2 import MixedPrecisionPolicy
from fsdp_graph.fsdp2.module import FSDP2Module
from fsdp_graph.runtime.unit import flat_params
from tests.workers.fsdp2_upstream import MLP, mlp_stack, shard_blocks


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
    with pytest.raises(NotImplementedError, match="output_dtype"):
        fsdp2.fully_shard(mlp_stack(), mp_policy=MixedPrecisionPolicy(output_dtype=torch.bfloat16))

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
