"""Gradient accumulation without communication: `no_sync` / `set_requires_gradient_sync` (FSDP1/FSDP2 names).

While gradient sync is off, each backward adds every unit's UNREDUCED full-size gradient into an accumulator
(in the flat shard's dtype) and communicates nothing; the first backward with sync on takes the accumulated
gradient (`ops.take_accumulated`), adds it to its own and reduces the sum once. Costs one full unsharded gradient per unit in memory, as in FSDP.

Under torch.compile the sync flag and whether an accumulated gradient is pending are guarded values: a loop that
alternates `no_sync` microbatches with a synced one uses two graphs (three if it also runs plain steps), each
compiled once, never a recompile per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from fsdp_graph.ir.ops import REDUCE_SIGNATURE, UNSHARD_SIGNATURE, reduce_args, register_accumulator
from fsdp_graph.runtime import offload
from fsdp_graph.runtime.unit import FlatParamState


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off (accumulate unreduced gradients locally) or back on for the next backwards.

    `.grad` of the parameters is untouched while sync is off; the backward after turning it on hands out the
    reduced gradient of every microbatch since the last sync (added to `.grad` as usual)."""
    root = _root(model, "set_requires_gradient_sync")
    if not requires_gradient_sync:
        for state in root.flat_params:
            if state.flat_shard.requires_grad and state.unsynced is None:
                _add_accumulator(state)
            elif state.unsynced is not None:
                register_accumulator(state.unsynced)  # (again: a deep copy of the model has leaves of its own)
    root.requires_gradient_sync = bool(requires_gradient_sync)


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """`with no_sync(model):` backwards inside accumulate without communicating; the first backward after the
    block reduces everything accumulated (FSDP1's `FullyShardedDataParallel.no_sync`)."""
    previous = model.__dict__["_fsdp_root"].requires_gradient_sync if "_fsdp_root" in model.__dict__ else True
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, previous)


def reduce_accumulated(model: nn.Module) -> int:
    """Reduce, outside any backward, every gradient accumulated while sync was off, and hand it out as a synced
    backward would; returns how many flat parameters it reduced (one reduction each).

    For schedules that run a microbatch's forward before earlier microbatches' backwards (pipeline parallelism):
    a synced backward adds the accumulated gradient only if one was pending when its FORWARD ran (the graph is
    chosen then), which is too early there. Each gradient goes through `fsdp.reduce_grad` eagerly with the arguments the backward would
    use (`ops.reduce_args`), then through autograd into the flat shard, so its hook hands `.grad` out (added to an
    existing one) and runs the `after_grad` callbacks exactly as after a backward."""
    root = _root(model, "reduce_accumulated")
    shards, reduced, copied_from = [], [], set()
    for state in root.flat_params:
        leaf = state.unsynced
        if leaf is None or leaf.grad is None:
            continue
        if state.partial is not None:
            raise NotImplementedError(
                f"fsdp_graph: unit {state.name!r} has set_requires_all_reduce(False) state; reducing gradients "
                "accumulated without sync outside a backward does not combine with it (leave requires_all_reduce on)."
            )
        shard = state.flat_shard
        args = reduce_args(UNSHARD_SIGNATURE.bind((shard, *state.static_unshard_args), {}))
        grad, leaf.grad = leaf.grad, None
        reduced.append(torch.ops.fsdp.reduce_grad(*REDUCE_SIGNATURE.call_args({"full_grad": grad, **args})))
        shards.append(shard)
        copied_from.add(state.compute_device)
    # CPU offload: each reduced gradient is the target of an asynchronous device-to-host copy, and autograd cannot
    # take a gradient this list still holds, so it copies it on the host at once; wait for the copies first.
    for device in {device for device in copied_from if offload.is_accelerator(device)}:
        offload.recorded_event(device).synchronize()
    if shards:
        torch.autograd.backward(shards, reduced)
    return len(shards)


def _root(model: nn.Module, caller: str):
    root = model.__dict__.get("_fsdp_root")
    if root is None:
        raise ValueError(
            f"{caller}: {type(model).__name__} is not sharded; pass the model you called "
            "fsdp_graph.fully_shard on (not its torch.compile wrapper's inner modules)."
        )
    return root


def _add_accumulator(state: FlatParamState) -> None:
    shard = state.flat_shard
    # An expanded scalar: a leaf of the full padded size that owns one element; only its `.grad` is real memory.
    device = state.compute_device or shard.device  # where the unreduced gradients are computed
    leaf = torch.zeros((), dtype=shard.dtype, device=device).expand(state.layout.padded_numel)
    state.unsynced = leaf.requires_grad_()
    torch._dynamo.mark_static(leaf)  # fixed size, like the flat shards
    register_accumulator(leaf)
