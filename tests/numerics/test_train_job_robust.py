"""The main job through what a first week of real use does to it (issue 34): bad flags, an unusable or shared
checkpoint directory, NaN, preemption signals, Ctrl-C, a full disk, damaged checkpoints and side files. Each case
runs the job as a user would (`cli`, its exit code and what it prints); the API's side is test_robustness.py."""

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from fsdp_graph.train import job as train
from tests.workers.train_job import FAST

LOCK = ".fsdp_graph.lock"
EXIT_FAILED, EXIT_USAGE, EXIT_PREEMPTED, EXIT_INTERRUPTED = 1, 2, 75, 130  # the job's exit codes, as documented


def _mount_tmpfs(where, options: str) -> None:
    where.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        pytest.skip(f"mounting a tmpfs needs root: {done.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    """Mounts a small tmpfs for a test and unmounts it after."""
    mounted = []

    def mount(where, options: str):
        _mount_tmpfs(where, options)
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=False)


def _intact(checkpoint) -> bool:
    """Every file the checkpoint's manifest lists has the recorded SHA-256 (what load_checkpoint checks first)."""
    files = json.loads((checkpoint / "checksums.json").read_text())["files"]
    return all(hashlib.sha256((checkpoint / n).read_bytes()).hexdigest() == e["sha256"] for n, e in files.items())


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--world", "0"], "--world 0: must be at least 1 (ranks)"),
        (["--batch", "0"], "--batch 0: must be at least 1 (sequences per rank)"),
        (["--steps", "-1"], "--steps -1: must be at least 1 (steps)"),
        (["--steps", "0"], "--steps 0: must be at least 1 (steps)"),
        (["--timeout", "0"], "--timeout 0.0: must be a finite number > 0 (seconds)"),
        (["--seq", "1000000"], "--seq 1000000: the corpus has "),
        (["--lr", "nan"], "--lr nan: must be a finite number > 0"),
        (["--clip", "-1"], "--clip -1.0: must be a finite number >= 0"),
        (["--keep", "0"], "--keep 0: must be at least 1 (checkpoints)"),
        (["--checkpoint-every", "-2"], "--checkpoint-every -2: must be at least 0"),
        (["--nonfinite-skips", "-1"], "--nonfinite-skips -1: must be at least 0"),
        (["--seed", "-1"], "--seed -1: must be between 0 and 4,294,967,295"),
    ],
)
def test_numeric_flags_are_checked_before_any_rank_starts(flag, message, capsys):
    """Before: --world 0 raised IndexError, --batch 0 failed in Dynamo after 37 s of compiling, --steps 0 and -1
    exited 0 naming a checkpoint that did not exist, --timeout 0 gave a C++ stack trace, and --seq 1000000 was
    refused only after the model was built. Now parse_args refuses each with the allowed range (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        train.parse_args([*FAST, *flag])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_checkpoint_dir_problems_are_found_before_any_rank_starts(tmp_path, mounts, capsys):
    """A --checkpoint-dir that is a file, on a read-only file system, or locked by a live job is refused in one
    line before any rank starts (exit 2), instead of at the first save, after the training up to it was done."""
    from fsdp_graph.state.directory import CheckpointDirLock

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    read_only = mounts(tmp_path / "ro", "ro,size=1m")
    shared = tmp_path / "shared"
    shared.mkdir()
    live = CheckpointDirLock(str(shared))  # this process: a job that is running
    live.acquire()
    try:
        assert (shared / LOCK).exists()
        for directory, why in (
            (a_file, "is not a directory (a file is there)"),
            (read_only, "is not writable: read-only file system"),
            (shared, f"is in use by another job (pid {os.getpid()} on "),
        ):
            start = time.monotonic()
            code = train.cli([*FAST, "--steps", "2", "--checkpoint-dir", str(directory), "--plot", "none"])
            err = capsys.readouterr().err
            assert code == EXIT_USAGE and f"fsdp-graph train: checkpoint directory '{directory}' {why}" in err
            assert time.monotonic() - start < 5, "refused before starting ranks"
    finally:
        live.release()
    assert not (shared / LOCK).exists()


def test_a_lock_left_by_a_dead_job_is_taken_over(tmp_path):
    """Same host: the holder's pid is not running. Another host: its heartbeat (the lock's mtime) is stale."""
    from fsdp_graph.state.directory import CheckpointDirError, CheckpointDirLock

    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / LOCK).write_text(json.dumps({"host": os.uname().nodename, "pid": gone.pid, "started": None}))
    lock = CheckpointDirLock(str(tmp_path))
    assert f"pid {gone.pid} on this host is not running" in lock.acquire()
    lock.release()
    (tmp_path / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(CheckpointDirError, match="in use by another job \\(pid 1 on elsewhere"):
        CheckpointDirLock(str(tmp_path)).acquire()  # fresh heartbeat
    os.utime(tmp_path / LOCK, (time.time() - 600, time.time() - 600))
    lock = CheckpointDirLock(str(tmp_path))
    assert "no heartbeat for 600 s" in lock.acquire()
    lock.release()


def test_non_finite_steps_are_skipped_then_the_job_stops_and_no_nan_is_saved(tmp_path, capfd):
    """--lr 1e6 --clip 0 (eager here; the guard compiled is in test_robustness.py): the gradients turn non-finite
    while the loss stays finite (the loss alone is not enough). Before: the run trained on NaN, exited 0, and its NaN checkpoints replaced the last good one. Now
    each such step is skipped, the job stops after --nonfinite-skips (3) in a row with an error naming the step, and
    every checkpoint it saved holds finite values only."""
    ckpt = tmp_path / "ckpt"
    args = [*FAST, "--no-compile", "--steps", "8", "--lr", "1e6", "--clip", "0", "--plot", "none"]  # skip, 3 skips
    code = train.cli([*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"])
    out, err = capfd.readouterr()
    assert code == EXIT_FAILED, (out, err)
    stopped = [line for line in err.splitlines() if "steps in a row non-finite" in line]
    assert stopped and "more than the 3 skips allowed; stopped" in stopped[0], err
    assert "the gradients are non-finite (the loss was finite, " in stopped[0], err
    assert "skipped: the gradients are non-finite (the loss was finite, " in out, out
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (saved,) = glob.glob(str(ckpt / "step_*"))
    dcp_to_torch_save(saved, tmp_path / "saved.pt")
    state = torch.load(tmp_path / "saved.pt", weights_only=False)
    tensors = [v for part in ("model", "optim") for v in _tensors(state[part])]
    assert len(tensors) > 20 and all(torch.isfinite(t).all() for t in tensors)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def test_preemption_saves_and_the_resume_repeats_the_uninterrupted_losses(tmp_path, monkeypatch, capfd, plain_job):
    """SIGUSR1 reaching rank 1 alone in the middle of step 2, and SIGTERM reaching the launcher while the checkpoint
    of step 1 is being written: every rank finishes its step, saves, and the job exits 75 naming the checkpoint
    (before: SIGTERM ended the launcher at once, with no message and no checkpoint). Both save the same state.
    Then, beside it, newer checkpoints: one without .metadata, one without checksums.json whose shard lost 64 bytes,
    one whose rank-1 shard is truncated, and a truncated history.json: --resume names each skipped checkpoint with its reason (before: the manifest-less
    one loaded silently, with corrupted weights; the truncated history stopped the resume), resumes from the
    preemption's checkpoint and repeats the uninterrupted run's losses exactly."""
    one_rank, launcher = tmp_path / "usr1", tmp_path / "term"
    gone = subprocess.Popen(["true"])
    gone.wait()
    one_rank.mkdir()
    (one_rank / LOCK).write_text(json.dumps({"host": os.uname().nodename, "pid": gone.pid}))
    args = [*FAST, "--steps", "4", "--plot", "none"]
    monkeypatch.setenv("FSDP_GRAPH_FAIL_AT_STEP", "1:1:usr1")
    assert train.cli([*args, "--checkpoint-dir", str(one_rank)]) == EXIT_PREEMPTED
    err = capfd.readouterr().err
    assert f"took over the lock of a job that is gone (pid {gone.pid} on this host is not running)" in err, err
    assert (
        "stopped by a signal that reached 1 of the 2 ranks after step 2 of 4; checkpoint "
        f"{one_rank / 'step_000002'} saved; continue with --resume (exit code 75)" in err
    ), err
    monkeypatch.setenv("FSDP_GRAPH_FAIL_AT_STEP", "0:1:termsave")
    assert train.cli([*args, "--checkpoint-dir", str(launcher), "--checkpoint-every", "1", "--keep", "3"]) == 75
    err = capfd.readouterr().err
    assert f"stopped by SIGTERM after step 2 of 4; checkpoint {launcher / 'step_000002'} saved" in err, err
    monkeypatch.delenv("FSDP_GRAPH_FAIL_AT_STEP")
    assert sorted(p.name for p in launcher.iterdir()) == ["history.json", "step_000001", "step_000002"]

    def shards(directory):
        files = json.loads((directory / "step_000002" / "checksums.json").read_text())["files"]
        return {n: e["sha256"] for n, e in files.items() if n.endswith(".distcp")}

    assert shards(one_rank) == shards(launcher) and len(shards(launcher)) == 2

    saved = launcher / "step_000002"
    shutil.copytree(saved, launcher / "step_000003")
    (launcher / "step_000003" / ".metadata").unlink()
    shutil.copytree(saved, launcher / "step_000004")
    (launcher / "step_000004" / "checksums.json").unlink()
    with open(launcher / "step_000004" / "__1_0.distcp", "r+b") as f:
        f.seek(4096)
        flipped = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(4096)
        f.write(flipped)
    shutil.copytree(saved, launcher / "step_000005")
    truncated = launcher / "step_000005" / "__1_0.distcp"
    os.truncate(truncated, truncated.stat().st_size // 2)
    os.truncate(launcher / "history.json", 10)
    resumed = train.main([*args, "--checkpoint-dir", str(launcher), "--resume"])
    out = capfd.readouterr().out
    assert f"skipping step_000005: '{launcher / 'step_000005'}' is damaged: __1_0.distcp: " in out, out
    assert "bytes expected (truncated" in out, out
    assert f"skipping step_000004: '{launcher / 'step_000004'}' is damaged: checksums.json: missing" in out, out
    assert f"skipping step_000003: '{launcher / 'step_000003'}' has no .metadata" in out, out
    assert f"resuming from {saved}, the newest intact checkpoint" in out, out
    assert resumed["start_step"] == 2 and resumed["history"] == plain_job["history"][:4], (resumed, plain_job)


def test_ctrl_c_names_the_last_safe_checkpoint_without_a_traceback(tmp_path, monkeypatch, capfd):
    """Before: a 20-line KeyboardInterrupt traceback that never said which checkpoint was safe. Now (as a terminal
    does: SIGINT to the launcher, the ranks ignoring it) every rank is ended, exit code 130, one line naming the
    newest complete checkpoint, and the directory's lock is released."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("FSDP_GRAPH_FAIL_AT_STEP", "0:2:int")
    # Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it started; a shell without job
    # control starts background commands (`pytest &`) with it ignored, and the rank's SIGINT would then be lost.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = train.cli([*FAST, "--no-compile", "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capfd.readouterr().err
    assert code == EXIT_INTERRUPTED and "Traceback" not in err, err
    assert (
        f"interrupted (Ctrl-C); every rank was stopped; the last safe checkpoint is {ckpt / 'step_000002'} "
        "(continue with --resume)." in err
    ), err
    assert not (ckpt / LOCK).exists()


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, mounts, capfd):
    """16 MiB of tmpfs hold one checkpoint of the tiny preset (10 MiB), not two. Before: the second save failed with
    rank 0's "[enforce fail at inline_container.cc:672] . unexpected pos" in 247 lines, "No space left on device"
    nowhere, and its partial step_000002.tmp kept the disk full. Now the job warns before training that --keep's
    checkpoints will not fit, and the failed save says why in one line, removes its .tmp, and leaves the previous
    checkpoint intact."""
    disk = mounts(tmp_path / "disk", "size=16m")
    ckpt = disk / "ckpt"
    args = [*FAST, "--no-compile", "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    code = train.cli([*args, "--plot", "none"])
    err = capfd.readouterr().err
    assert code == EXIT_FAILED, err
    assert f"checkpoint directory '{ckpt}' has 16.0 MiB free, but --keep 1 with 0 checkpoints" in err, err
    assert "saves may fail" in err, err
    reason = next(line for line in err.splitlines() if line.startswith("save_checkpoint: could not write"))
    assert reason.startswith(f"save_checkpoint: could not write '{ckpt / 'step_000002'}': no space left on device ("), (
        err
    )
    assert "inline_container" not in err and "Traceback" not in err, err
    assert sorted(p.name for p in ckpt.iterdir()) == ["history.json", "step_000001"]
    assert _intact(ckpt / "step_000001")
