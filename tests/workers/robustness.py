"""Rank-side workers for issue 34's guarantees through the API: the non-finite guard (eager and compiled), stop
signals agreed on by every rank, and what save_checkpoint / load_checkpoint refuse or report."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_graph
from fsdp_graph.runtime.dtensor_views import local_of
from tests.workers.checkpointing import _full_optim_state
from tests.workers.training import Case, build, shard_and_compile


def _setup(mode: str, seed: int = 0):
    torch.manual_seed(seed)
    model, loss_fn, make_batch = build("gpt")
    compiled, _ = shard_and_compile(model, Case("gpt", mode=mode))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, compiled, opt, loss_fn, make_batch


def _batch(make_batch, step: int, rank: int, world: int) -> tuple:
    full = make_batch(torch.Generator().manual_seed(step), 2 * world)
    return tuple(t.chunk(world)[rank] for t in full)


def _set_first(tensors, value: float) -> float:
    """Set the first element of this rank's first non-empty local tensor among `tensors`; returns the old one."""
    local = next(local_of(t) for t in tensors if t is not None and local_of(t).numel())
    index = (0,) * local.dim()
    old = local[index].item()
    with torch.no_grad():
        local[index] = value
    return old


def _step(guard, model, compiled, opt, loss_fn, batch, step, *, clip=False, nan_grad=False, nan_loss=False):
    loss = loss_fn(compiled, batch)
    loss.backward()
    if nan_grad:
        _set_first((p.grad for p in model.parameters()), float("nan"))
    norm = fsdp_graph.clip_grad_norm_(model, 1.0) if clip else None
    check = guard.check(step, loss * float("nan") if nan_loss else loss, grad_norm=norm)
    if check.apply:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return check


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def guard_cases(rank: int, world: int, mode: str) -> dict:
    """Run A: steps 0-4, where 1 (NaN gradient on rank 1, clipped: the clip norm), 2 (the same unclipped: each
    rank's local gradient norms) and 3 (a NaN loss on rank 0, gradients finite) are skipped. Run B: steps 0 and 4
    only. Skipping must leave the model and optimizer exactly as if the steps never ran. Then the limit (max_skips)
    and "stop" mode raise `NonFiniteError` on every rank."""
    a = _setup(mode)
    model, compiled, opt, loss_fn, make_batch = a
    guard = fsdp_graph.StepGuard(model, max_skips=3)
    plan = {0: {"clip": True}, 1: {"clip": True, "nan_grad": rank == 1}, 2: {"nan_grad": rank == 1}}
    plan |= {3: {"nan_loss": rank == 0}, 4: {"clip": True}}
    verdicts = []
    for step, how in plan.items():
        check = _step(guard, model, compiled, opt, loss_fn, _batch(make_batch, step, rank, world), step, **how)
        verdicts.append((check.apply, check.what))
    b_model, b_compiled, b_opt, _, _ = _setup(mode)
    b_guard = fsdp_graph.StepGuard(b_model)
    for step in (0, 4):
        _step(b_guard, b_model, b_compiled, b_opt, loss_fn, _batch(make_batch, step, rank, world), step, clip=True)
    out = {
        "verdicts": verdicts,
        "skipped": guard.skipped,
        "param_diff": _max_diff(fsdp_graph.full_state_dict(model), fsdp_graph.full_state_dict(b_model)),
        "optim_diff": _max_diff(_full_optim_state(model, opt), _full_optim_state(b_model, b_opt)),
    }
    for name, kwargs in (("limit", {"max_skips": 1}), ("stop", {"nonfinite": "stop"})):
        strict = fsdp_graph.StepGuard(model, **kwargs)
        try:
            for step in (10, 11, 12):
                _step(strict, model, compiled, opt, loss_fn, _batch(make_batch, step, rank, world), step, nan_grad=True)
            out[name] = None
        except fsdp_graph.NonFiniteError as e:
            out[name] = (e.step, str(e))
    return out


def stop_signal_cases(rank: int, world: int) -> dict:
    """SIGUSR1 reaches rank 1 alone: through StepGuard's all-reduce every rank stops after the same step; through
    the store (`StopSignal.agreed`, a world all-reduce per step as the loop's own) too, `lookahead` steps later."""
    out = {}
    with fsdp_graph.StopSignal() as stop:
        guard = fsdp_graph.StepGuard(nonfinite="off", stop=stop)
        for step in range(6):
            if rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
                while not stop.requested:
                    time.sleep(0.001)
            if guard.check(step, 1.0).stop:
                out["guard_stop_step"] = step
                break
        out["guard_saw_signal"] = stop.signal_name
    with fsdp_graph.StopSignal(lookahead=2) as stop:
        for step in range(10):
            dist.all_reduce(torch.ones(1))
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
                while not stop.requested:
                    time.sleep(0.001)
            if stop.agreed(step):
                out["store_stop_step"] = step
                break
    out["handler_restored"] = signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    return out


class _FullDisk(dcp.FileSystemWriter):
    """Rank 1's shard write fails as a full disk does."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write_data(plan, planner)


def _raises(fn, *errors) -> str | None:
    try:
        fn()
    except errors as e:
        return str(e)
    return None


def checkpoint_cases(rank: int, world: int, root: str) -> dict:
    """What save_checkpoint refuses (non-finite state) and reports (a failed write, one line, its .tmp removed,
    the previous checkpoint loadable), and what load_checkpoint refuses (no manifest, unless foreign; a damaged
    extra file)."""
    model, compiled, opt, loss_fn, make_batch = _setup("eager")
    guard = fsdp_graph.StepGuard(model)
    _step(guard, model, compiled, opt, loss_fn, _batch(make_batch, 0, rank, world), 0)
    path = os.path.join(root, "ckpt")
    fsdp_graph.save_checkpoint(path, model, opt)
    saved = fsdp_graph.full_state_dict(model)
    out: dict = {}

    if rank == 1:
        kept = _set_first(model.parameters(), float("inf"))
    out["nonfinite"] = _raises(
        lambda: fsdp_graph.save_checkpoint(path, model, opt), fsdp_graph.NonFiniteCheckpointError
    )
    if rank == 1:
        _set_first(model.parameters(), kept)
    out["nonfinite_tmp_left"] = os.path.exists(path + ".tmp")

    out["full_disk"] = _raises(
        lambda: fsdp_graph.save_checkpoint(path, model, opt, writer=_FullDisk), fsdp_graph.CheckpointSaveError
    )
    dist.barrier()
    out["full_disk_tmp_left"] = os.path.exists(path + ".tmp")
    blocker = os.path.join(root, "a_file")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    dist.barrier()
    out["under_a_file"] = _raises(
        lambda: fsdp_graph.save_checkpoint(os.path.join(blocker, "ckpt"), model, opt), fsdp_graph.CheckpointSaveError
    )

    fresh, _, fresh_opt, _, _ = _setup("eager", seed=3)
    fsdp_graph.load_checkpoint(path, fresh, fresh_opt)
    loaded = fsdp_graph.full_state_dict(fresh)
    out["previous_diff"] = max((loaded[k] - saved[k]).abs().max().item() for k in saved)

    unmanifested = os.path.join(root, "no_manifest")
    if rank == 0:
        shutil.copytree(path, unmanifested)
        os.remove(os.path.join(unmanifested, "checksums.json"))
    dist.barrier()
    out["no_manifest"] = _raises(
        lambda: fsdp_graph.load_checkpoint(unmanifested, fresh), fsdp_graph.DamagedCheckpointError
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_graph.load_checkpoint(unmanifested, fresh, foreign=True)
    out["foreign_warnings"] = [str(w.message) for w in caught if "cannot be verified" in str(w.message)]

    extra = os.path.join(root, "extra")
    fsdp_graph.save_checkpoint(
        extra, model, extra_files={"notes.txt": b"written beside the shards", "compiled/a.bin": b"\x00\x01"}
    )
    with open(os.path.join(extra, "checksums.json")) as f:
        out["extra_files_listed"] = sorted(n for n in json.load(f)["files"] if not n.endswith(".distcp"))
    if rank == 0:
        with open(os.path.join(extra, "notes.txt"), "r+b") as f:
            f.write(b"W")
    dist.barrier()
    out["extra_damaged"] = _raises(lambda: fsdp_graph.load_checkpoint(extra, fresh), fsdp_graph.DamagedCheckpointError)
    return out


def api_cases(rank: int, world: int, root: str) -> dict:
    """Every case above in one launch."""
    return {
        "guard_eager": guard_cases(rank, world, "eager"),
        "guard_compiled": guard_cases(rank, world, "aot"),
        "signals": stop_signal_cases(rank, world),
        "checkpoints": checkpoint_cases(rank, world, root),
    }
