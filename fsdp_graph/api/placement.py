"""Where `fully_shard` puts a model's parameters and buffers: the device it is given, else the mesh's (FSDP2).

A model built on the meta device is materialised there, and a model built on the CPU is moved there (each rank
moves only its shard), so that a meta model under `cpu:gloo,cuda:nccl` does not silently train on the CPU over gloo
and a pure NCCL group never receives CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_graph.runtime import devices
from fsdp_graph.runtime.offload import is_accelerator


def _available(device_type: str) -> bool:
    return torch.get_device_module(device_type).is_available()


def parameter_device(mesh: DeviceMesh | None, device: torch.device | str | None) -> torch.device:
    """`device` if given; else the mesh's device type, or for mesh=None the device the world group's collectives
    run on natively (`devices.choose_device`: the current CUDA device for `cuda:nccl` and `cpu:gloo,cuda:nccl`, the
    CPU for gloo and the fake group). An accelerator this process lacks is refused, naming the fix."""
    if device is not None:
        return torch.device(device)
    if mesh is not None:
        source = f"the mesh's device type {mesh.device_type!r}"
    else:
        source = f"the process group's backend {dist.get_backend_config()!r}"

    def current_index(device_type: str) -> int:
        if not _available(device_type):
            raise ValueError(
                f"fully_shard: {source} puts the parameters on {device_type}, but torch.{device_type} is not "
                f"available in this process. Pass device= (e.g. device='cpu', with a gloo group or a 'cpu' mesh), "
                f"or run where {device_type} is."
            )
        return devices._current_index(device_type)

    if mesh is None:
        return devices.choose_device(dist.get_backend_config(), None, current_index)
    chosen = torch.device(mesh.device_type)
    if chosen.type in ("cpu", "meta") or chosen.index is not None:
        return chosen
    return torch.device(chosen.type, current_index(chosen.type))


def moves_to(current: torch.device, target: torch.device) -> bool:
    """Whether a materialised tensor on `current` is moved to `target`: only from the CPU to an accelerator (a
    model the user put on a device stays there; gloo stages CUDA tensors itself)."""
    return current.type == "cpu" and is_accelerator(target)


def move_buffers(model: nn.Module, device: torch.device, skip: Iterable[nn.Module] = (), *, all_devices: bool) -> None:
    """Every buffer of `model` outside `skip`'s subtrees on `device`: all of them (`all_devices`, CPU offload's
    compute device), or only those `moves_to` moves. Meta buffers stay (a model sharded on meta: `to_empty()` and
    its init allocate them)."""
    skipped = {id(sub) for m in skip for sub in m.modules()}
    for module in model.modules():
        if id(module) in skipped:
            continue
        for name, buf in module._buffers.items():
            if buf is None or buf.device == device or buf.device.type == "meta":
                continue
            if all_devices or moves_to(buf.device, device):
                module._buffers[name] = buf.to(device)
