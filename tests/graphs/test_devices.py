"""`fsdp_graph.runtime.devices`: which device a collective outside the compiled graph runs on, per process-group backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp_graph
from fsdp_graph.api import placement
from fsdp_graph.runtime import devices
from fsdp_graph.runtime.devices import backend_for, choose_device, collective_device
from fsdp_graph.runtime.unit import flat_params
from tests.graphs.capture import TwoBlock

CPU, META = torch.device("cpu"), torch.device("meta")


def _index(device_type: str) -> int:
    return 3  # the "current" accelerator, so a test can tell it from an explicit index


@pytest.mark.parametrize(
    "config, preferred, expected",
    [
        # gloo (as dist.get_backend_config reports a plain "gloo" group): always the CPU, even for CUDA tensors
        ("cpu:gloo,cuda:gloo", None, CPU),
        ("cpu:gloo,cuda:gloo", torch.device("cuda", 1), CPU),
        # NCCL: the current CUDA device, also for CPU tensors; tensors already on a CUDA device stay there
        ("cuda:nccl", None, torch.device("cuda", 3)),
        ("cuda:nccl", CPU, torch.device("cuda", 3)),
        ("cuda:nccl", torch.device("cuda"), torch.device("cuda", 3)),
        ("cuda:nccl", torch.device("cuda", 1), torch.device("cuda", 1)),
        # mixed: where the tensors are; without any, the accelerator
        ("cpu:gloo,cuda:nccl", CPU, CPU),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 0), torch.device("cuda", 0)),
        ("cpu:gloo,cuda:nccl", None, torch.device("cuda", 3)),
        ("cpu:gloo,cuda:nccl", META, torch.device("cuda", 3)),
        # fake: anything (it moves no data), the CPU by default
        ("cpu:fake,cuda:fake,hpu:fake,xpu:fake", None, CPU),
        ("cpu:fake,cuda:fake,hpu:fake,xpu:fake", META, META),
        ("cpu:fake,cuda:fake,hpu:fake,xpu:fake", torch.device("cuda"), torch.device("cuda", 3)),
        # bare names and other backends
        ("gloo", torch.device("cuda"), CPU),
        ("nccl", None, torch.device("cuda", 3)),
        ("cpu:ucc,cuda:ucc", torch.device("cuda", 2), torch.device("cuda", 2)),
        ("xpu:xccl", CPU, torch.device("xpu", 3)),
    ],
)
def test_choose_device(config, preferred, expected):
    assert choose_device(config, preferred, _index) == expected


def test_choose_device_rejects_a_group_without_a_native_device():
    with pytest.raises(ValueError, match="cuda:gloo"):
        choose_device("cuda:gloo")


def test_collective_device_of_a_fake_group(fake_pg):
    assert collective_device(fake_pg) == CPU
    assert collective_device(fake_pg, META) == META
    assert collective_device(None, META) == META  # None: the default group


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:gloo"])
def test_collective_device_of_a_gloo_group(backend):
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert collective_device(group) == CPU
        assert collective_device(group, torch.device("cuda", 0)) == CPU  # gloo's CUDA support is host staging
        assert backend_for(group, "cpu") == "gloo"
        sub = dist.new_group([0])
        assert collective_device(sub, META) == CPU
    finally:
        dist.destroy_process_group()


def test_collective_device_of_a_mixed_nccl_group(monkeypatch, fake_pg):
    """A CPU-only torch cannot create a `cpu:gloo,cuda:nccl` group; the group's config is what decides."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(devices, "_current_index", lambda device_type: 5)
    assert collective_device(fake_pg) == torch.device("cuda", 5)
    assert collective_device(fake_pg, CPU) == CPU
    assert backend_for(fake_pg, "cuda:1") == "nccl" and backend_for(fake_pg, "cpu") == "gloo"
    assert backend_for(fake_pg, "meta") == ""


def _mixed_nccl(monkeypatch) -> None:
    """What dist reports for a `cpu:gloo,cuda:nccl` group (its name is the config)."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")


def test_mixed_group_runs_cpu_tensors_on_gloo(monkeypatch, fake_pg):
    """gloo's rules (all-to-all reductions, one collective in flight) hold for a mixed group's CPU collectives."""
    from fsdp_graph.compiler.graph_facts import gloo_groups as _gloo_groups
    from fsdp_graph.ir import ops
    from tests.graphs.capture import dynamo_graph

    _mixed_nccl(monkeypatch)
    assert ops.is_gloo_group(fake_pg.group_name, "cpu")
    assert not ops.is_gloo_group(fake_pg.group_name, torch.device("cuda", 0))
    model = fsdp_graph.fully_shard(TwoBlock(), separate_reduce_group=False, device="cpu")
    assert _gloo_groups(dynamo_graph(model, torch.randn(2, 4))) == {fake_pg.group_name}
    with torch.device("meta"):  # shards off the CPU: not gloo's
        model = TwoBlock()
    fsdp_graph.fully_shard(model, device="meta", separate_reduce_group=False)
    assert _gloo_groups(dynamo_graph(model, torch.randn(2, 4, device="meta"))) == frozenset()


def test_mixed_nccl_group_reduces_on_its_shard_group_by_default(monkeypatch, fake_pg):
    """separate_reduce_group is off by default, NCCL included (issue 11: unmeasured, and a second communicator costs
    memory). Opting in is tested on gloo ranks (tests/numerics/test_reduce_group.py)."""
    _mixed_nccl(monkeypatch)
    assert all(state.reduce_group == "" for state in flat_params(fsdp_graph.fully_shard(TwoBlock(), device="cpu")))


def _meta_two_block() -> TwoBlock:
    with torch.device("meta"):
        return TwoBlock()


@pytest.mark.parametrize("config", ["cuda:nccl", "cpu:gloo,cuda:nccl"])
def test_a_meta_model_is_materialised_on_the_groups_accelerator_not_the_cpu(monkeypatch, fake_pg, config):
    """Issue 27 item 6: the default was the CPU, so a pure NCCL group failed at its first gather and a mixed one
    trained on the CPU over gloo. This machine has no CUDA, so the choice shows as the error naming the fix."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    with pytest.raises(ValueError, match=rf"backend '{config}' puts the parameters on cuda.*Pass device="):
        fsdp_graph.fully_shard(_meta_two_block())
    with pytest.raises(ValueError, match=r"mesh's device type 'cuda'.*Pass device="):
        fsdp_graph.fully_shard(_meta_two_block(), DeviceMesh("cuda", torch.arange(4)))
    model = fsdp_graph.fully_shard(_meta_two_block(), device="cpu")  # explicit: still honoured
    assert all(state.flat_shard.device == CPU for state in flat_params(model))


def test_the_default_parameter_device_is_the_mesh_or_group_device(monkeypatch, fake_pg):
    monkeypatch.setattr(placement, "_available", lambda device_type: True)
    monkeypatch.setattr(devices, "_current_index", lambda device_type: 5)
    assert placement.parameter_device(None, None) == CPU  # the fake group: the CPU
    assert placement.parameter_device(DeviceMesh("cuda", torch.arange(4)), None) == torch.device("cuda", 5)
    assert placement.parameter_device(DeviceMesh("cpu", torch.arange(4)), None) == CPU
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert placement.parameter_device(None, None) == torch.device("cuda", 5)
    assert placement.parameter_device(None, "cuda:1") == torch.device("cuda", 1)


def test_a_cpu_built_model_moves_its_shards_and_buffers_to_the_device(monkeypatch, fake_pg):
    """Meta plays the accelerator (no copy can run here): only the CPU moves, and ignored modules stay."""
    monkeypatch.setattr(placement, "is_accelerator", lambda device: device.type == "meta")
    model = TwoBlock()
    model.blocks[0].register_buffer("scale", torch.ones(4))
    model.head.register_buffer("kept", torch.ones(2))
    fsdp_graph.fully_shard(model, device="meta", ignored_modules=[model.head])
    assert all(state.flat_shard.device == META for state in flat_params(model))
    assert model.blocks[0].scale.device == META and model.head.kept.device == CPU
    assert model.head.weight.device == CPU


def test_the_models_own_gloo_collectives_are_serial():
    """A model's own functional collectives (torchtitan's expert-parallel all-to-alls, with data-dependent split
    sizes) on a gloo group: that group is serial in the schedule and `check_collectives` too (issue 35)."""
    from torch.distributed._functional_collectives import all_to_all_single

    from fsdp_graph.compiler.graph_facts import user_gloo_groups as _user_gloo_groups
    from tests.graphs.capture import dynamo_graph

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])

        class Dispatch(torch.nn.Module):
            def forward(self, x, counts):
                splits = counts.tolist()
                return all_to_all_single(x, splits, splits, group) * 2

        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            graph = dynamo_graph(Dispatch(), torch.randn(3, 2), torch.tensor([3]))
        assert _user_gloo_groups(graph) == {group.group_name}
    finally:
        dist.destroy_process_group()
