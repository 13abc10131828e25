"""Initialisation helpers for fully_shard: meta-device materialisation and rank-0 state sync."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.runtime.tensor_parallel import TPSpec, tp_local_of


def _is_meta(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "meta"


def materialize_module(
    module: nn.Module,
    fqn: str,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    tp: dict[int, TPSpec] | None = None,
) -> dict[int, torch.Tensor]:
    """Allocate `module`'s own meta parameters and buffers on `device` and initialise them with
    `param_init_fn(module)` or `module.reset_parameters()` (as FSDP1: the function initialises the module's own
    parameters AND buffers). Returns {id(old meta param): new tensor}; for a tensor-parallel parameter (its spec
    in `tp`, by id) the new tensor is this rank's tp piece of the value initialised whole."""
    own = {name: p for name, p in module._parameters.items() if p is not None}
    if any(not _is_meta(p) for p in own.values()):
        names = [n for n, p in own.items() if not _is_meta(p)]
        raise NotImplementedError(
            f"fully_shard: module '{fqn}' mixes meta and materialised parameters ({names}); build it entirely on "
            "the meta device or entirely on a real one."
        )
    init = param_init_fn or getattr(module, "reset_parameters", None)
    if init is None:
        raise ValueError(
            f"fully_shard: module '{fqn}' ({type(module).__name__}) has meta-device parameters "
            f"{sorted(own)} but no reset_parameters(); pass param_init_fn=... to fully_shard."
        )
    specs = {name: tp[id(p)] for name, p in own.items() if tp and id(p) in tp}
    # Initialised as plain tensors of the global shape, as the model without tensor parallelism would be: every
    # rank draws the same numbers in the same order (DTensor's own init would draw per piece), then keeps its piece.
    for name, spec in specs.items():
        old = own[name]
        module._parameters[name] = nn.Parameter(
            torch.empty(spec.shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad
        )
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        param_init_fn(module) if param_init_fn is not None else module.reset_parameters()
    values = {name: module._parameters[name] for name in own}
    for name, spec in specs.items():
        values[name] = tp_local_of(values[name].detach(), spec).contiguous()
        module._parameters[name] = own[name]  # fully_shard replaces the DTensor by its view
    return {id(old): values[name] for name, old in own.items()}


def materialize_buffers(
    model: nn.Module, device: torch.device, param_init_fn: Callable[[nn.Module], None] | None
) -> None:
    """Modules that own no parameters but meta buffers (e.g. rotary caches) are materialised in place with
    `param_init_fn(module)` or `module.reset_parameters()`: buffers are replicated, every rank holds them whole."""
    for fqn, module in model.named_modules():
        if not any(_is_meta(b) for b in module._buffers.values()):
            continue
        reset = getattr(module, "reset_parameters", None)
        if (param_init_fn is None and reset is None) or any(p is not None for p in module._parameters.values()):
            raise ValueError(
                f"fully_shard: module '{fqn or '<root>'}' ({type(module).__name__}) has meta-device buffers "
                f"{[n for n, b in module._buffers.items() if _is_meta(b)]} that cannot be initialised here; "
                "give it a reset_parameters() or pass param_init_fn=... to fully_shard."
            )
        for name, buf in module._buffers.items():
            if _is_meta(buf):
                module._buffers[name] = torch.empty_like(buf, device=device)
        with torch.no_grad():
            if param_init_fn is not None:
                param_init_fn(module)
            else:  # a bound method: the module is already its argument
                reset()


SYNC_BUCKET_BYTES = 250 * 2**20  # one broadcast carries up to this much (as FSDP1's parameter broadcasts)


@torch.no_grad()
def sync_module_states_from_rank0(model: nn.Module, ignored: set[int]) -> None:
    """Broadcast rank 0's parameters and buffers to every rank (before sharding), as FSDP1's sync_module_states:
    one broadcast per bucket of tensors of one dtype and device (up to SYNC_BUCKET_BYTES each), not one per
    tensor, each on the group's collective device (e.g. a model built on the CPU, synced over NCCL)."""
    tensors = [p for p in model.parameters() if id(p) not in ignored] + [b for b in model.buffers()]
    if any(_is_meta(t) for t in tensors):
        raise ValueError("fully_shard: sync_module_states=True needs materialised parameters, not meta ones.")
    for bucket in _buckets(tensors, SYNC_BUCKET_BYTES):
        flat = torch.cat([t.data.reshape(-1) for t in bucket]).to(collective_device(None, bucket[0].device))
        dist.broadcast(flat, src=0)
        for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.data.copy_(piece.view(t.shape))


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` by (dtype, device), in first-seen order (the same on every rank), cut at `max_bytes`."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}  # bytes in each kind's last bucket
    for t in tensors:
        kind, size = (t.dtype, t.device), t.numel() * t.element_size()
        buckets = by_kind.setdefault(kind, [[]])
        if buckets[-1] and filled[kind] + size > max_bytes:
            buckets.append([])
            filled[kind] = 0
        buckets[-1].append(t)
        filled[kind] = filled.get(kind, 0) + size
    return [bucket for buckets in by_kind.values() for bucket in buckets]
