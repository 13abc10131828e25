"""Save and load training checkpoints with torch.distributed.checkpoint (DCP), atomically, with per-file checksums."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.state.checksums import checksums, files_written, verify, write_manifest
from fsdp_graph.state.optim import load_optim_state_dict, optim_state_dict

_DONE = ".metadata"  # DCP's coordinator writes it last: a directory without it is not a checkpoint


class DamagedCheckpointError(RuntimeError):
    """A checkpoint whose files do not match what was saved (truncated, changed, missing). Raised on every rank
    alike, so callers may catch it and agree on trying another checkpoint."""

    def __init__(self, path: str, problems: list[str]):
        self.path, self.problems = path, problems
        super().__init__(f"load_checkpoint: '{path}' is damaged: " + "; ".join(problems))


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


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    writer: type[dcp.FileSystemWriter] = dcp.FileSystemWriter,
) -> None:
    """Write the sharded model (and optimizer) state to the directory `path` (FSDP2's DCP layout: readable at
    any world size, and by torch's FSDP2), with the size and SHA-256 of every file in `checksums.json`.
    Collective. Written to `<path>.tmp` first, then renamed into place, so an interrupted save never leaves a
    `path` that loads as if complete. `writer`: the DCP writer class (a FileSystemWriter, e.g. a subclass that
    changes how files are written)."""
    staging = f"{path}.tmp"
    if dist.get_rank() == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    dist.barrier()
    metadata = dcp.save(_state(model, optimizer), storage_writer=writer(staging))
    dist.barrier()
    entries = checksums(staging, files_written(metadata, staging))
    error = None
    if dist.get_rank() == 0:
        try:
            write_manifest(staging, entries)
            _publish(staging, path)
        except Exception as e:  # every rank must learn it, or the others would wait in the next collective
            error = e
    failed = torch.tensor([int(error is not None)], device=collective_device(None, torch.device("cpu")))
    dist.broadcast(failed, src=0)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"save_checkpoint: rank 0 failed to publish '{path}'; the previous checkpoint is kept.")


def load_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, verify_files: bool = True
) -> None:
    """Load a checkpoint written by `save_checkpoint` (or by torch's FSDP2 with DCP, same keys) into `model`
    (and `optimizer`), at any world size. Collective.

    First (`verify_files`) every file is checked against `checksums.json` (sizes and SHA-256; a checkpoint
    without one, e.g. torch's, only against the sizes `.metadata` implies); a mismatch raises
    `DamagedCheckpointError` naming the files, on every rank, before anything is loaded."""
    if not os.path.exists(os.path.join(path, _DONE)):
        raise FileNotFoundError(f"load_checkpoint: no complete checkpoint at '{path}' (missing {_DONE}).")
    if verify_files and (problems := verify(path)):
        raise DamagedCheckpointError(path, problems)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        load_optim_state_dict(model, optimizer, state["optim"])
