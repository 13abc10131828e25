"""The device of a collective issued outside the compiled graph, chosen from its process group.

A process group serves each device type with one backend: "gloo" (`cpu:gloo,cuda:gloo`), "nccl"
(`cuda:nccl`), a mixed `cpu:gloo,cuda:nccl`, or the fake group of graph-level tests. A tensor handed to a
collective must be on a device the group's backend for it really supports: NCCL cannot send a CPU tensor, and
gloo sends CUDA tensors through host copies (and the schedule treats only gloo groups as serial).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# The device type each backend's collectives run on natively. gloo lists cuda too (it stages CUDA tensors through
# host memory), so a gloo group counts as a CPU group. Backends not named here serve what their group lists.
_NATIVE = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "xccl": "xpu"}
_ANY_DEVICE = "fake"  # moves no data, so any device works (graph-level tests run it on meta tensors)


def backends_of(config: str) -> dict[str, str]:
    """`dist.get_backend_config` text -> {device type: backend}; a bare backend name maps every device to it."""
    out = {}
    for item in config.split(","):
        device_type, sep, backend = item.strip().partition(":")
        if not sep:
            return {"": device_type.lower()}
        out[device_type.strip()] = backend.strip().lower()
    return out


def _current_index(device_type: str) -> int:
    return torch.get_device_module(device_type).current_device()


def choose_device(
    config: str,
    preferred: torch.device | None = None,
    current_index: Callable[[str], int] | None = None,
) -> torch.device:
    """The collective device for a group whose backend config is `config` (pure: no process group needed).

    - `preferred` (where the tensors at hand live) when the group serves its type natively, or the group is fake;
    - otherwise the group's accelerator (NCCL: the current CUDA device), else the CPU.
    `current_index(device_type)` gives the current accelerator index (default: torch's current device)."""
    backends = backends_of(config)
    if "" in backends:  # a bare name: the backend's own device
        backends = {_NATIVE.get(backends[""], "cpu"): backends[""]}
    native = [t for t, b in backends.items() if b == _ANY_DEVICE or _NATIVE.get(b, t) == t]
    if not native:
        raise ValueError(
            f"fsdp_graph.runtime.devices: process-group backend '{config}' natively serves no device type."
        )
    any_device = all(b == _ANY_DEVICE for b in backends.values())
    if preferred is not None and (any_device or preferred.type in native):
        chosen = preferred
    else:
        accelerators = [t for t in native if t != "cpu" and backends[t] != _ANY_DEVICE]
        chosen = torch.device(accelerators[0] if accelerators else ("cpu" if "cpu" in native else native[0]))
    if chosen.index is None and chosen.type not in ("cpu", "meta"):
        chosen = torch.device(chosen.type, (current_index or _current_index)(chosen.type))
    return chosen


def collective_device(group: dist.ProcessGroup | None = None, preferred: torch.device | None = None) -> torch.device:
    """The device a collective over `group` (None: the default group) should run on, for tensors that live on
    `preferred`. Every rank must pass the same `preferred` type, or ranks would pick different backends."""
    return choose_device(dist.get_backend_config(group), preferred)


def backend_for(group: dist.ProcessGroup | None, device: torch.device | str) -> str:
    """The backend name that runs `group`'s collectives on tensors of `device` ("" if none does)."""
    backends = backends_of(dist.get_backend_config(group))
    if "" in backends:
        return backends[""]
    return backends.get(torch.device(device).type, "")
