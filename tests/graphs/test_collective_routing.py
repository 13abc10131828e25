"""Collectives issued outside the compiled graph run on `collective_device(group)` (issue 11).

CI has no GPU. Two stand-ins: the fake process group accepts meta tensors, so a model on the meta device plays an
accelerator-resident model; and forcing every collective device to "meta" plays an NCCL group receiving CPU
tensors (the wrapped collective records its tensors' devices and stops the call: a meta result has no data)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import fsdp_graph
from fsdp_graph.api import full_params
from fsdp_graph.runtime import devices
from fsdp_graph.state import checkpoint
from fsdp_graph.train.report import gather_per_rank
from tests.graphs.capture import TwoBlock

META = torch.device("meta")
_WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor")


class _ReachedError(Exception):
    pass


@pytest.fixture
def on_meta(monkeypatch, fake_pg):
    """Every collective device is meta; the first collective records (name, its tensors' devices) and raises."""
    monkeypatch.setattr(devices, "choose_device", lambda config, preferred=None, current_index=None: META)
    seen: list[tuple[str, list[torch.device]]] = []

    def wrap(name: str):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            seen.append((name, [t.device for t in tensors]))
            raise _ReachedError(name)

        return collective

    for name in _WRAPPED:
        monkeypatch.setattr(dist, name, wrap(name))
    return seen


def _trained(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(TwoBlock(), **kwargs)
    model(torch.randn(2, 4, device=kwargs.get("device"))).sum().backward()
    return model


def test_clip_grad_norm_of_an_accelerator_resident_model(fake_pg, monkeypatch):
    """The partial norm of 'no unsharded parameters' was a CPU zero, stacked with accelerator parts."""
    with torch.device("meta"):
        model = TwoBlock()
    fsdp_graph.fully_shard(model, device="meta")
    model(torch.randn(2, 4, device="meta")).sum().backward()
    seen = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device) or real(t, *a, **k))
    total = fsdp_graph.clip_grad_norm_(model, 1.0)
    assert total.device == META and seen == [META]
    total = fsdp_graph.clip_grad_norm_(model, 1.0, norm_type=float("inf"))
    assert total.device == META and seen == [META, META]


def test_clip_grad_norm_all_reduces_on_the_collective_device(on_meta):
    model = _trained()
    with pytest.raises(_ReachedError):
        fsdp_graph.clip_grad_norm_(model, 1.0)
    assert on_meta == [("all_reduce", [META])]


def test_save_checkpoint_hashes_and_broadcasts_on_the_collective_device(on_meta, monkeypatch, tmp_path):
    """First the non-finite check's all-reduce (a count), then the checksums' (the files DCP wrote), then the
    broadcast of rank 0's outcome."""
    monkeypatch.setattr(dcp, "save", lambda *args, **kwargs: Metadata(state_dict_metadata={}, storage_data={}))
    model = fsdp_graph.fully_shard(TwoBlock())
    monkeypatch.setattr(checkpoint, "_state", lambda model, optimizer: {})
    monkeypatch.setattr(checkpoint, "_publish", lambda staging, path: None)
    with pytest.raises(_ReachedError):
        fsdp_graph.save_checkpoint(str(tmp_path / "ckpt"), model)
    monkeypatch.setattr(checkpoint, "nonfinite_entries", lambda state: [])
    with pytest.raises(_ReachedError):
        fsdp_graph.save_checkpoint(str(tmp_path / "ckpt"), model)
    monkeypatch.setattr(checkpoint, "checksums", lambda directory, files: {})
    monkeypatch.setattr(checkpoint, "write_manifest", lambda directory, entries: None)
    with pytest.raises(_ReachedError):
        fsdp_graph.save_checkpoint(str(tmp_path / "ckpt"), model)
    assert on_meta == [("all_reduce", [META]), ("all_reduce", [META]), ("broadcast", [META])]


def test_load_checkpoint_verifies_on_the_collective_device(on_meta, monkeypatch, tmp_path):
    """The manifest goes out from rank 0 with the collective device, the verdicts are all-reduced on it."""
    (tmp_path / ".metadata").write_bytes(b"")
    devices_used = []

    def broadcast_object_list(objects, src, device=None):
        devices_used.append(device)
        objects[0] = ({".metadata": (0, None)}, False)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    with pytest.raises(_ReachedError):
        fsdp_graph.load_checkpoint(str(tmp_path), fsdp_graph.fully_shard(TwoBlock()))
    assert devices_used == [META] and on_meta == [("all_reduce", [META])]


def test_summon_full_params_gathers_on_the_collective_device(on_meta):
    model = _trained()
    with pytest.raises(_ReachedError), fsdp_graph.summon_full_params(model, with_grads=True):
        pass
    assert on_meta == [("all_gather_single", [META, META])]


def test_summon_full_params_agrees_on_gradients_on_the_collective_device(on_meta, monkeypatch):
    model = _trained()
    monkeypatch.setattr(full_params, "gather_flat", lambda state, local: local.new_zeros(state.layout.padded_numel))
    with pytest.raises(_ReachedError), fsdp_graph.summon_full_params(model, with_grads=True):
        pass
    assert on_meta == [("all_reduce", [META])]


def test_sync_module_states_of_a_cpu_model_broadcasts_on_the_collective_device(on_meta):
    with pytest.raises(_ReachedError):
        fsdp_graph.fully_shard(TwoBlock(), sync_module_states=True)
    assert on_meta == [("broadcast", [META])]


def test_train_report_gathers_on_the_collective_device(on_meta):
    with pytest.raises(_ReachedError):
        gather_per_rank(5, torch.device("cpu"))
    assert on_meta[0][0] == "all_gather" and set(on_meta[0][1]) == {META}


def test_state_dict_mesh_is_chosen_when_the_state_dict_is_made(fake_pg, monkeypatch):
    """A model built on the CPU and moved by `.cuda()` after fully_shard must not describe its state dict on a CPU
    mesh over NCCL: the mesh's device type is the collective device of the shards' device at state-dict time.
    (Moving to meta cannot stand in for `.cuda()`: meta tensors cannot be `.data` of CPU parameters.)"""
    model = fsdp_graph.fully_shard(TwoBlock())
    state = model.__dict__["_fsdp_root"].flat_params[0]
    assert fsdp_graph.state.sharded.to_dtensor(torch.zeros(8), state).device_mesh.device_type == "cpu"
    monkeypatch.setattr(devices, "choose_device", lambda config, preferred=None, current_index=None: META)
    assert fsdp_graph.state.sharded.to_dtensor(torch.zeros(8), state).device_mesh.device_type == "meta"


def test_state_dict_mesh_of_an_accelerator_resident_model(fake_pg):
    with torch.device("meta"):
        model = TwoBlock()
    fsdp_graph.fully_shard(model, device="meta")
    weight = model.state_dict()["head.weight"]
    assert weight.device_mesh.device_type == "meta" and weight.to_local().device == META


def test_sync_module_states_broadcasts_one_bucket_per_dtype(fake_pg, monkeypatch):
    """Issue 27 (minor): one broadcast per tensor became one per bucket of a dtype and device; each tensor gets its
    own slice of rank 0's bucket back (the fake broadcast plays rank 0 by adding 1), and buckets are cut at the
    byte limit."""
    from fsdp_graph.runtime import init

    model = TwoBlock()
    model.blocks[0].register_buffer("steps", torch.arange(3))
    before = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    sent = []

    def broadcast(tensor, src, **kwargs):
        sent.append((tensor.dtype, tensor.numel()))
        tensor.add_(1)

    monkeypatch.setattr(dist, "broadcast", broadcast)
    init.sync_module_states_from_rank0(model, set())
    numel = sum(p.numel() for p in model.parameters())
    assert sent == [(torch.float32, numel), (torch.int64, 3)]
    assert all(torch.equal(t, old + 1) for t, old in zip([*model.parameters(), *model.buffers()], before))
    monkeypatch.setattr(init, "SYNC_BUCKET_BYTES", 4 * 20)  # 20 floats: the 16-element weight, then the rest
    sent.clear()
    init.sync_module_states_from_rank0(model, set())
    assert sent == [(torch.float32, 20), (torch.float32, 20), (torch.float32, numel - 40), (torch.int64, 3)]
