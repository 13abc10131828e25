"""Save and load training checkpoints with torch.distributed.checkpoint (DCP), atomically."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.state.optim import load_optim_state_dict, optim_state_dict

_DONE = ".metadata"  # DCP's coordinator writes it last: a directory without it is not a checkpoint


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optim_state_dict(model, optimizer)
    return state


def _publish(staging: str, path: str) -> None:
    """Rank 0 swaps the finished staging directory in: renames only, so `path` is always absent, the old
    checkpoint, or the new one, never half of one."""
    old = f"{path}.old"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(staging, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write the sharded model (and optimizer) state to the directory `path` (FSDP2's DCP layout: readable at
    any world size, and by torch's FSDP2). Collective. Written to `<path>.tmp` first, then renamed into
    place, so an interrupted save never leaves a `path` that loads as if complete."""
    staging = f"{path}.tmp"
    if dist.get_rank() == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    dist.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=staging)
    dist.barrier()
    error = None
    if dist.get_rank() == 0:
        try:
            _publish(staging, path)
        except Exception as e:  # every rank must learn it, or the others would wait in the next collective
            error = e
    failed = torch.tensor([int(error is not None)], device=collective_device(None, torch.device("cpu")))
    dist.broadcast(failed, src=0)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"save_checkpoint: rank 0 failed to publish '{path}'; the previous checkpoint is kept.")


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by `save_checkpoint` (or by torch's FSDP2 with DCP, same keys) into `model`
    (and `optimizer`), at any world size. Collective."""
    if not os.path.exists(os.path.join(path, _DONE)):
        raise FileNotFoundError(f"load_checkpoint: no complete checkpoint at '{path}' (missing {_DONE}).")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        load_optim_state_dict(model, optimizer, state["optim"])
