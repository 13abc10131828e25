"""Gradient accumulation without communication: `no_sync` / `set_requires_gradient_sync` (FSDP1/FSDP2 names).

While gradient sync is off, each backward adds every unit's UNREDUCED full-size gradient into an accumulator
(in the flat shard's dtype) and communicates nothing; the first backward with sync on adds the accumulator to its
own gradient and reduces the sum once. Costs one full unsharded gradient per unit in memory, as in FSDP.

Under torch.compile the sync flag and whether an accumulated gradient is pending are guarded values: a loop that
alternates `no_sync` microbatches with a synced one uses two graphs (three if it also runs plain steps), each
compiled once, never a recompile per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from fsdp_graph.runtime.unit import FlatParamState


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off (accumulate unreduced gradients locally) or back on for the next backwards.

    `.grad` of the parameters is untouched while sync is off; the backward after turning it on hands out the
    reduced gradient of every microbatch since the last sync (added to `.grad` as usual)."""
    root = model.__dict__.get("_fsdp_root")
    if root is None:
        raise ValueError(
            f"set_requires_gradient_sync: {type(model).__name__} is not sharded; pass the model you called "
            "fsdp_graph.fully_shard on (not its torch.compile wrapper's inner modules)."
        )
    if not requires_gradient_sync:
        for state in root.flat_params:
            if state.flat_shard.requires_grad and state.unsynced is None:
                _add_accumulator(state)
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


def _add_accumulator(state: FlatParamState) -> None:
    shard = state.flat_shard
    # An expanded scalar: a leaf of the full padded size that owns one element; only its `.grad` is real memory.
    device = state.compute_device or shard.device  # where the unreduced gradients are computed
    leaf = torch.zeros((), dtype=shard.dtype, device=device).expand(state.layout.padded_numel)
    state.unsynced = leaf.requires_grad_()
    torch._dynamo.mark_static(leaf)  # fixed size, like the flat shards

    def drop_reduced() -> None:
        if state.root.requires_gradient_sync:
            leaf.grad = None

    state.after_grad.insert(0, drop_reduced)
