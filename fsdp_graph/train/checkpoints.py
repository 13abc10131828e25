"""The main job's checkpoints: the directory checked and locked before training, where they go, which one
`--resume` loads (naming every one it skips, and why), and the failure-injection test hooks."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_graph
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.runtime.dtensor_views import local_of
from fsdp_graph.state.checksums import MANIFEST
from fsdp_graph.state.directory import CheckpointDirError, CheckpointDirLock, check_checkpoint_dir
from fsdp_graph.train.llama import PRESETS, preset
from fsdp_graph.train.report import history_bytes, parse_history, save_history

FAIL_ENV = "FSDP_GRAPH_FAIL_AT_STEP"
HISTORY = "history.json"  # in each checkpoint (covered by its manifest), and the run's log in the directory
_MIB = 2**20


# ---- test hooks (FSDP_GRAPH_FAIL_AT_STEP=RANK:STEP[:MODE], see fsdp_graph.train.job's docstring) ----


def failure_asked(rank: int, step: int) -> list[str] | None:
    """The test hook's mode for this rank and step ([] to raise), or None."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return None
    target_rank, target_step, *how = spec.split(":")
    return how if (int(target_rank), int(target_step)) == (rank, step) else None


def _signal_and_wait(signum: int, to_launcher: bool, stop) -> None:
    """Send `signum` to the launcher (which passes it on to every rank) or to this rank only, then wait until this
    rank's handler has seen it, so the step it was sent in is the one that carries it (deterministic tests)."""
    from fsdp_graph.train.launch import LAUNCHER_PID_ENV

    os.kill(int(os.environ[LAUNCHER_PID_ENV]) if to_launcher else os.getpid(), signum)
    deadline = time.monotonic() + 30
    while stop is not None and not stop.requested and time.monotonic() < deadline:
        time.sleep(0.005)


class _KilledWhileSaving(dcp.FileSystemWriter):
    """The test hook's ":save" point: DCP has written this rank's shard files; the coordinator has not yet
    written .metadata (it waits for this rank's write results), so the checkpoint is half written."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)


def _terminated_while_saving(stop):
    class TerminatedWhileSaving(dcp.FileSystemWriter):
        """The ":termsave" point: SIGTERM reaches the launcher after this rank wrote its shard files."""

        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            written.wait()
            _signal_and_wait(signal.SIGTERM, True, stop)
            return written

    return TerminatedWhileSaving


def fail_if_asked(rank: int, step: int) -> None:
    """The test hook before a step: raise, SIGKILL, hang (a Python loop) or SIGSTOP this rank."""
    how = failure_asked(rank, step)
    if how is None or how not in ([], ["kill"], ["hang"], ["stop"]):
        return
    spec = os.environ[FAIL_ENV]
    if how == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == ["hang"]:
        while True:
            time.sleep(60)
    if how == []:
        raise RuntimeError(f"injected failure on rank {rank} before step {step} ({FAIL_ENV}={spec})")


def mid_step_if_asked(rank: int, step: int, model, stop) -> None:
    """The test hook between a step's backward and its optimizer step: ":term" sends SIGTERM to the launcher,
    ":usr1" SIGUSR1 to this rank alone, ":int" SIGINT to the launcher (Ctrl-C), ":nan" puts a NaN into one of this
    rank's gradients (its loss stays finite)."""
    how = failure_asked(rank, step)
    if how == ["term"]:
        _signal_and_wait(signal.SIGTERM, True, stop)
    elif how == ["usr1"]:
        _signal_and_wait(signal.SIGUSR1, False, stop)
    elif how == ["int"]:
        _signal_and_wait(signal.SIGINT, True, None)
        while True:  # the launcher ends this rank
            time.sleep(60)
    elif how == ["nan"]:
        grad = next(local_of(p.grad) for p in model.parameters() if p.grad is not None and local_of(p.grad).numel())
        grad.view(-1)[0] = float("nan")


# ---- the directory ----


def step_of(path: str) -> int | None:
    """The step of a complete checkpoint directory `.../step_NNNNNN`, else None."""
    m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m and os.path.exists(os.path.join(path, ".metadata")) else None


def _named_step(path: str) -> int | None:
    m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m and os.path.isdir(path) else None


def complete_checkpoints(directory: str) -> list[str]:
    """The complete `step_NNNNNN` checkpoint directories in `directory` (not `.tmp` stagings)."""
    return [p for p in glob.glob(os.path.join(directory, "step_*")) if step_of(p) is not None]


def checkpoint_path(args: argparse.Namespace, step: int) -> str:
    return os.path.join(args.checkpoint_dir, f"step_{step:06d}")


def estimated_bytes(args: argparse.Namespace) -> int:
    """A checkpoint's size: fp32 parameters and AdamW's two fp32 moments (the master weights are fp32 with
    --mixed-precision bf16 too), and some metadata."""
    cfg = preset(args.preset, seq=max(args.seq, PRESETS[args.preset].seq))
    if args.pp > 1:
        cfg = preset(args.preset, tied=False)
    return cfg.num_params() * 4 * 3 + _MIB


def _clean_leftovers(directory: str) -> list[str]:
    """Under the lock, nobody else writes here: remove the `.tmp` stagings of saves that did not finish (they only
    take space), and put back a checkpoint that a publish interrupted between its two renames (`.old`)."""
    notes = []
    for staging in sorted(glob.glob(os.path.join(directory, "step_*.tmp"))):
        shutil.rmtree(staging, ignore_errors=True)
        notes.append(f"removed {os.path.basename(staging)}, left by a save that did not finish")
    for old in sorted(glob.glob(os.path.join(directory, "step_*.old"))):
        target = old.removesuffix(".old")
        if os.path.exists(target):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, target)
            notes.append(f"restored {os.path.basename(target)} from {os.path.basename(old)} (an interrupted publish)")
    return notes


def prepare_dir(args: argparse.Namespace) -> CheckpointDirLock | None:
    """Before any rank trains: --checkpoint-dir is a writable directory (created if missing), its free space is
    compared with the checkpoints --keep holds while a save runs, no other live job writes there (its lock taken),
    and stale stagings are removed. Prints what it found; raises `CheckpointDirError` (one line)."""
    if not args.checkpoint_dir:
        return None
    directory = args.checkpoint_dir
    one = estimated_bytes(args)
    present = len(complete_checkpoints(directory)) if os.path.isdir(directory) else 0
    copies = max(1, args.keep + 1 - present)
    what = (
        f"--keep {args.keep} with {present} checkpoints already there: {copies} more of about {one / _MIB:,.1f} MiB "
        "while a save runs"
    )
    notes = check_checkpoint_dir(directory, copies * one, what)
    lock = CheckpointDirLock(directory)
    if taken := lock.acquire():
        notes.append(taken)
    try:
        notes += _clean_leftovers(directory)
    except OSError as e:
        lock.release()
        raise CheckpointDirError(f"checkpoint directory '{directory}': {e}") from None
    for note in notes:
        print(f"--checkpoint-dir: {note}", file=sys.stderr, flush=True)
    return lock


def prepare_dir_on_rank0(args: argparse.Namespace) -> CheckpointDirLock | None:
    """`prepare_dir` under torchrun: rank 0 does it and every rank raises its error alike."""
    if not args.checkpoint_dir:
        return None
    lock, error = None, [None]
    if dist.get_rank() == 0:
        try:
            lock = prepare_dir(args)
        except CheckpointDirError as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0, device=collective_device(None, torch.device("cpu")))
    if error[0] is not None:
        raise CheckpointDirError(error[0])
    return lock


def last_safe(directory: str | None) -> str | None:
    """The newest checkpoint in `directory` that is complete: its manifest there and every file it lists at the
    recorded size (stat calls only, no hashing: for the Ctrl-C message)."""
    if not directory or not os.path.isdir(directory):
        return None
    for path in sorted(complete_checkpoints(directory), key=step_of, reverse=True):
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                files = json.load(f)["files"]
            if all(os.path.getsize(os.path.join(path, n)) == e["size"] for n, e in files.items()):
                return path
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


# ---- resume ----


def _resume_candidates(args: argparse.Namespace) -> list[str]:
    """The checkpoints --resume may load, the preferred first: PATH alone, or the directory's `step_NNNNNN`
    directories newest to oldest (complete or not: an incomplete one is named and skipped). Rank 0's listing, so
    that every rank tries the same ones in the same order."""
    if args.resume is None:
        return []
    if args.resume != "latest":
        return [args.resume]
    listing: list = [None]
    if dist.get_rank() == 0:
        named = [p for p in glob.glob(os.path.join(args.checkpoint_dir, "step_*")) if _named_step(p) is not None]
        listing = [sorted(named, key=_named_step, reverse=True)]
    dist.broadcast_object_list(listing, src=0, device=collective_device(None, torch.device("cpu")))
    return listing[0]


def resume(args: argparse.Namespace, model, opt, rank: int, compiled=None) -> tuple[str, int, list] | None:
    """Load the newest checkpoint that is intact; returns (its path, its step, its loss history), or None when
    there is none yet. With `compiled` (the job's Inductor backend), the compiled artifacts saved with it are
    installed, so the first step loads them instead of compiling. One that is incomplete (no .metadata), has no manifest, or is damaged
    (`DamagedCheckpointError`, raised on every rank alike) is named with the reason and the next older one tried;
    an explicit --resume PATH is not replaced by another."""
    skipped = []
    for path in _resume_candidates(args):
        try:
            fsdp_graph.load_checkpoint(path, model, opt, foreign=args.foreign, compiled=compiled)
        except (fsdp_graph.DamagedCheckpointError, FileNotFoundError) as e:
            if args.resume != "latest":
                raise
            reason = str(e).removeprefix("load_checkpoint: ")
            if isinstance(e, FileNotFoundError):
                reason = f"'{path}' has no .metadata (its save did not finish, or the file was removed)"
            skipped.append(reason)
            if rank == 0:
                print(f"--resume: skipping {os.path.basename(path)}: {reason}", flush=True)
            continue
        if skipped and rank == 0:
            print(f"--resume: resuming from {path}, the newest intact checkpoint", flush=True)
        if compiled is not None and compiled.restored["graphs"] and rank == 0:
            graphs = compiled.restored["graphs"]
            print(f"--resume: compiled code from the checkpoint installed ({graphs} graph(s))", flush=True)
        step = step_of(path)
        if step is None:  # a foreign checkpoint not named step_NNNNNN: its weights, the count from 0
            step = 0
            if rank == 0:
                print(f"--resume: {path} names no step; counting steps from 0", flush=True)
        return path, step, _history_of(path, rank)
    if skipped:
        raise CheckpointDirError(
            f"--resume: no intact checkpoint in {args.checkpoint_dir}; skipped:\n" + "\n".join(skipped)
        )
    if args.resume and rank == 0:
        print(f"--resume: no checkpoint in {args.checkpoint_dir} yet, starting from step 0", flush=True)
    return None


def _history_of(path: str, rank: int) -> list[tuple[int, float]]:
    """The loss history saved in the checkpoint (verified with it); [] for one without (torch's, or older)."""
    try:
        with open(os.path.join(path, HISTORY), "rb") as f:
            return parse_history(f.read())
    except FileNotFoundError:
        return []
    except ValueError as e:
        if rank == 0:
            print(f"--resume: {path}/{HISTORY} unreadable ({e}); the loss curve starts at the resumed step", flush=True)
        return []


# ---- save ----


def save(args: argparse.Namespace, model, opt, step: int, history, rank: int, stop=None, compiled=None) -> str:
    """Save the checkpoint of `step` (collective) with its loss history inside (and with `compiled`, the job's
    Inductor backend, its compiled artifacts), then on rank 0 the run's loss log and keep the newest --keep. Only after a save succeeded is an older checkpoint removed, and a non-finite model
    is never saved (save_checkpoint refuses it), so the last finite checkpoint is never rotated out."""
    path = checkpoint_path(args, step)
    how = failure_asked(rank, step)
    writer = dcp.FileSystemWriter
    if how == ["save"]:
        writer = _KilledWhileSaving
    elif how == ["termsave"]:
        writer = _terminated_while_saving(stop)
    fsdp_graph.save_checkpoint(
        path, model, opt, writer=writer, extra_files={HISTORY: history_bytes(history)}, compiled=compiled
    )
    if rank == 0:
        try:
            save_history(os.path.join(args.checkpoint_dir, HISTORY), history)
        except OSError as e:  # the run's log only: the checkpoint holds its own copy
            print(f"--checkpoint-dir: could not update {HISTORY}: {e}", file=sys.stderr, flush=True)
        # The newest by write time, not by step number: a run resumed from an older step must keep its own.
        by_age = sorted(
            complete_checkpoints(args.checkpoint_dir), key=lambda p: os.path.getmtime(os.path.join(p, ".metadata"))
        )
        for old in by_age[: max(0, len(by_age) - max(args.keep, 1))]:
            if os.path.abspath(old) != os.path.abspath(path):
                shutil.rmtree(old, ignore_errors=True)
    return path
