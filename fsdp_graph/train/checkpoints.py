"""The main job's checkpoints: where they go, which one `--resume` loads, and its failure-injection test hook."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_graph
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.train.report import save_history

FAIL_ENV = "FSDP_GRAPH_FAIL_AT_STEP"


def failure_asked(rank: int, step: int) -> list[str] | None:
    """The test hook's mode for this rank and step ([] to raise), or None (see fsdp_graph.train.job's docstring)."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return None
    target_rank, target_step, *how = spec.split(":")
    return how if (int(target_rank), int(target_step)) == (rank, step) else None


class _KilledWhileSaving(dcp.FileSystemWriter):
    """The test hook's ":save" point: DCP has written this rank's shard files; the coordinator has not yet
    written .metadata (it waits for this rank's write results), so the checkpoint is half written."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)


def fail_if_asked(rank: int, step: int) -> None:
    """The test hook before a step (see fsdp_graph.train.job's docstring)."""
    how = failure_asked(rank, step)
    if how is None or how == ["save"]:
        return
    spec = os.environ[FAIL_ENV]
    if how == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == ["hang"]:
        while True:
            time.sleep(60)
    raise RuntimeError(f"injected failure on rank {rank} before step {step} ({FAIL_ENV}={spec})")


def step_of(path: str) -> int | None:
    """The step of a complete checkpoint directory `.../step_NNNNNN`, else None."""
    m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m and os.path.exists(os.path.join(path, ".metadata")) else None


def complete_checkpoints(directory: str) -> list[str]:
    """The complete `step_NNNNNN` checkpoint directories in `directory` (not `.tmp` stagings)."""
    return [p for p in glob.glob(os.path.join(directory, "step_*")) if step_of(p) is not None]


def _resume_candidates(args: argparse.Namespace) -> list[str]:
    """The checkpoints --resume may load, the preferred first: PATH alone, or the directory's newest to oldest.
    Rank 0's listing, so that every rank tries the same ones in the same order."""
    if args.resume is None:
        return []
    if args.resume != "latest":
        return [args.resume]
    listing = [
        sorted(complete_checkpoints(args.checkpoint_dir), key=step_of, reverse=True) if dist.get_rank() == 0 else None
    ]
    dist.broadcast_object_list(listing, src=0, device=collective_device(None, torch.device("cpu")))
    return listing[0]


def resume(args: argparse.Namespace, model, opt, rank: int) -> tuple[str, int] | None:
    """Load the newest checkpoint that is intact; returns (its path, its step), or None when there is none yet.
    A damaged one (`DamagedCheckpointError`, raised on every rank alike) is reported and the next older one tried;
    an explicit --resume PATH is not replaced by another."""
    candidates = _resume_candidates(args)
    damaged = []
    for path in candidates:
        try:
            fsdp_graph.load_checkpoint(path, model, opt)
        except fsdp_graph.DamagedCheckpointError as e:
            if args.resume != "latest":
                raise
            damaged.append(str(e))
            if rank == 0:
                print(f"--resume: {e}; skipping back to the next older checkpoint", flush=True)
            continue
        if damaged and rank == 0:
            print(f"--resume: resuming from {path}, the newest intact checkpoint", flush=True)
        return path, step_of(path)
    if damaged:
        raise RuntimeError(f"--resume: every checkpoint in {args.checkpoint_dir} is damaged:\n" + "\n".join(damaged))
    if args.resume and rank == 0:
        print(f"--resume: no checkpoint in {args.checkpoint_dir} yet, starting from step 0", flush=True)
    return None


def checkpoint_path(args: argparse.Namespace, step: int) -> str:
    return os.path.join(args.checkpoint_dir, f"step_{step:06d}")


def save(args: argparse.Namespace, model, opt, step: int, history, rank: int) -> str:
    """Save the checkpoint of `step` (collective), then on rank 0 the loss history, and keep the newest --keep."""
    path = checkpoint_path(args, step)
    killed = failure_asked(rank, step) == ["save"]
    fsdp_graph.save_checkpoint(path, model, opt, writer=_KilledWhileSaving if killed else dcp.FileSystemWriter)
    if rank == 0:
        save_history(os.path.join(args.checkpoint_dir, "history.json"), history)
        # The newest by write time, not by step number: a run resumed from an older step must keep its own.
        by_age = sorted(
            complete_checkpoints(args.checkpoint_dir), key=lambda p: os.path.getmtime(os.path.join(p, ".metadata"))
        )
        for old in by_age[: max(0, len(by_age) - max(args.keep, 1))]:
            if os.path.abspath(old) != os.path.abspath(path):
                shutil.rmtree(old, ignore_errors=True)
    return path
