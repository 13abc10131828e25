"""Save and load training checkpoints with torch.distributed.checkpoint (DCP), atomically, with per-file checksums.

What a caller can rely on (docs/checkpoints.md lists the test of each):
- a checkpoint `save_checkpoint` publishes always carries `checksums.json` (size and SHA-256 of every file, extra
  files included), and holds only finite values (unless `allow_nonfinite=True`);
- a failed save raises `CheckpointSaveError` on every rank with the reason in one line (no space, read-only,
  missing), after removing its `<path>.tmp`; the checkpoint previously at `path` is untouched;
- `load_checkpoint` refuses a checkpoint without `checksums.json` unless told it is foreign (written by torch's
  DCP), and then warns that only its file sizes could be checked.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.state.checksums import MANIFEST, checksums, files_written, verify, write_manifest
from fsdp_graph.state.compiled import SUBDIR, checkpoint_files, install_from_checkpoint
from fsdp_graph.state.optim import load_optim_state_dict, optim_state_dict
from fsdp_graph.state.save_failure import CheckpointSaveError, diagnose

if TYPE_CHECKING:
    from fsdp_graph.compiler.backend import FSDPBackend

_DONE = ".metadata"  # DCP's coordinator writes it last: a directory without it is not a checkpoint
_NAMED = 5  # non-finite entries named in the error


class DamagedCheckpointError(RuntimeError):
    """A checkpoint whose files do not match what was saved (truncated, changed, missing), or that lacks the
    manifest every checkpoint `save_checkpoint` writes carries. Raised on every rank alike, so callers may catch it
    and agree on trying another checkpoint."""

    def __init__(self, path: str, problems: list[str]):
        self.path, self.problems = path, problems
        super().__init__(f"load_checkpoint: '{path}' is damaged: " + "; ".join(problems))


class NonFiniteCheckpointError(RuntimeError):
    """`save_checkpoint` found NaN or Inf in the state it was asked to write, and wrote nothing. Raised on every
    rank alike; `entries` names every non-finite tensor ("model/<fqn>", "optim/<fqn>/<state key>")."""

    fsdp_graph_brief = True

    def __init__(self, path: str, entries: list[str]):
        self.path, self.entries = path, entries
        named = ", ".join(entries[:_NAMED]) + (f" and {len(entries) - _NAMED} more" if len(entries) > _NAMED else "")
        super().__init__(
            f"save_checkpoint: refusing to write '{path}': {len(entries)} tensors hold NaN or Inf ({named}). "
            "A checkpoint with non-finite values would poison every resume; the previous checkpoint is untouched "
            "(allow_nonfinite=True writes it anyway)."
        )


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optim_state_dict(model, optimizer)
    return state


def _tensors(state: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's local tensor) of every floating-point tensor of `_state`'s result. Ranks may list
    different names (pipeline stages hold different parameters)."""
    entries = [(f"model/{k}", v) for k, v in state.get("model", {}).items()]
    for fqn, per_param in state.get("optim", {}).get("state", {}).items():
        entries += [(f"optim/{fqn}/{k}", v) for k, v in per_param.items()]
    for name, value in entries:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield name, value.to_local() if isinstance(value, DTensor) else value


def nonfinite_entries(state: dict) -> list[str]:
    """The entries of `state` (`_state`'s layout) holding NaN or Inf on any rank, sorted. Collective: one
    all-reduce of a count, and only when it is not 0 an all-gather of the names."""
    names, by_device = [], defaultdict(list)  # flags stay where the tensors are until one copy per device
    for name, local in _tensors(state):
        by_device[local.device].append((~torch.isfinite(local)).any())
        names.append(name)
    home = collective_device(None, torch.device("cpu"))
    flags = [torch.stack(f).to(home) for f in by_device.values()]
    flags = torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool, device=home)
    count = flags.sum(dtype=torch.int64).reshape(1)
    dist.all_reduce(count)
    if not count.item():
        return []
    mine = [name for name, bad in zip(names, flags.tolist()) if bad]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted({name for names_of_rank in everyone for name in names_of_rank})


def _local_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for _, t in _tensors(state))


def _check_extra_names(extra_files: Mapping[str, bytes] | None) -> dict[str, bytes]:
    extras = dict(extra_files or {})
    for name, content in extras.items():
        if (
            not isinstance(name, str)
            or os.path.isabs(name)
            or os.path.normpath(name) != name
            or name.split(os.sep)[0] in ("", ".", "..")
            or name in (_DONE, MANIFEST)
            or name.endswith(".distcp")
            or not isinstance(content, bytes)
        ):
            raise ValueError(
                f"save_checkpoint: extra file {name!r}: give a relative path inside the checkpoint (e.g. "
                f"'history.json' or 'compiled/graph_0.bin'; not {_DONE}, {MANIFEST} or *.distcp) mapped to bytes"
            )
    return extras


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
    extra_files: Mapping[str, bytes] | None = None,
    allow_nonfinite: bool = False,
    compiled: FSDPBackend | None = None,
) -> None:
    """Write the sharded model (and optimizer) state to the directory `path` (FSDP2's DCP layout: readable at
    any world size, and by torch's FSDP2), with the size and SHA-256 of every file in `checksums.json`.
    Collective. Written to `<path>.tmp` first, then renamed into place, so an interrupted save never leaves a
    `path` that loads as if complete.

    - `extra_files`: {relative path: bytes} written by rank 0 into the checkpoint beside DCP's files (a loss
      history, compiled artifacts in a subdirectory) and covered by the manifest like them.
    - A state holding NaN or Inf raises `NonFiniteCheckpointError` on every rank before anything is written
      (`allow_nonfinite=True` writes it anyway).
    - A failed write raises `CheckpointSaveError` on every rank, its message saying why in one line (DCP's own
      `CheckpointException` is a BaseException and names no cause when the disk is full), after `<path>.tmp` was
      removed; the checkpoint previously at `path` is untouched.
    - `writer`: the DCP writer class (a FileSystemWriter, e.g. a subclass that changes how files are written).
    - `compiled`: the Inductor backend the model was compiled with; what its compiles left in torch's caches goes
      into `compiled/` in the checkpoint (`fsdp_graph.state.compiled`), for `load_checkpoint(compiled=...)`."""
    extras = _check_extra_names(extra_files)
    if compiled is not None:
        if any(name.split(os.sep)[0] == SUBDIR for name in extras):
            raise ValueError(f"save_checkpoint: extra_files under '{SUBDIR}/' collide with compiled=; rename them")
        extras.update(checkpoint_files(compiled, model))
    state = _state(model, optimizer)
    if not allow_nonfinite and (bad := nonfinite_entries(state)):
        raise NonFiniteCheckpointError(path, bad)
    rank = dist.get_rank()
    staging = f"{path}.tmp"
    if rank == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    dist.barrier()
    error: BaseException | None = None
    try:
        metadata = dcp.save(state, storage_writer=writer(staging))
    except (Exception, CheckpointException) as e:  # DCP raises it on every rank alike: all skip to the verdict
        error = e
    if error is None:
        if rank == 0:
            try:
                for name, content in extras.items():
                    os.makedirs(os.path.dirname(os.path.join(staging, name)), exist_ok=True)
                    with open(os.path.join(staging, name), "wb") as f:
                        f.write(content)
            except Exception as e:  # every rank must learn it, or the others would wait in the next collective
                error = e
        dist.barrier()
        entries = checksums(staging, files_written(metadata, staging) + sorted(extras))
        if rank == 0 and error is None:
            try:
                write_manifest(staging, entries)
                _publish(staging, path)
            except Exception as e:
                error = e
    _raise_if_failed(path, staging, error, _local_bytes(state) * dist.get_world_size())


def _raise_if_failed(path: str, staging: str, error: BaseException | None, need_bytes: int) -> None:
    """Every rank learns rank 0's outcome (a failure on any rank is one on rank 0 too: DCP's is collective, the
    rest happens on rank 0), and on a failure rank 0 removes the staging directory before anyone raises."""
    device = collective_device(None, torch.device("cpu"))
    failed = torch.tensor([int(error is not None)], device=device)
    dist.broadcast(failed, src=0)  # the one collective of a save that went well
    if not failed.item():
        return
    verdict: list = [None]
    if dist.get_rank() == 0:
        verdict = [(diagnose(os.path.dirname(os.path.abspath(path)) or ".", error, need_bytes), str(error))]
        shutil.rmtree(staging, ignore_errors=True)
    dist.broadcast_object_list(verdict, src=0, device=device)
    reason, details = verdict[0]
    raise CheckpointSaveError(path, reason, details) from None


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify_files: bool = True,
    foreign: bool = False,
    compiled: FSDPBackend | None = None,
) -> None:
    """Load a checkpoint written by `save_checkpoint` (or, with `foreign=True`, by torch's FSDP2 with DCP, same
    keys) into `model` (and `optimizer`), at any world size. Collective.

    First (`verify_files`) every file is checked against `checksums.json` (sizes and SHA-256); a mismatch, or a
    missing `checksums.json`, raises `DamagedCheckpointError` naming the files, on every rank, before anything is
    loaded. `foreign=True`: a checkpoint without one (torch's DCP writes none) is checked against the sizes its
    `.metadata` implies, with a warning that its content cannot be.

    `compiled`: the backend the model is (or will be) compiled with. The compiled artifacts `save_checkpoint(
    compiled=...)` stored are installed into this process's torch caches, so the first compile loads them instead
    of compiling, if they were compiled for this torch, world size, model and backend options; else they are
    ignored with one warning saying why (`fsdp_graph.state.compiled`). Call it before the first compiled step."""
    if not os.path.exists(os.path.join(path, _DONE)):
        raise FileNotFoundError(f"load_checkpoint: no complete checkpoint at '{path}' (missing {_DONE}).")
    if verify_files:
        problems, unverified = verify(path, foreign=foreign)
        if problems:
            raise DamagedCheckpointError(path, problems)
        if unverified and dist.get_rank() == 0:
            warnings.warn(
                f"load_checkpoint: '{path}' has no {MANIFEST} (foreign=True): its files have the sizes its "
                f"{_DONE} implies, but their content cannot be verified.",
                stacklevel=2,
            )
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        load_optim_state_dict(model, optimizer, state["optim"])
    if compiled is not None:
        install_from_checkpoint(path, compiled, model)
