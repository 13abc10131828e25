"""A checkpoint directory before training: a writable directory with room for the checkpoints, used by one job.

`check_checkpoint_dir` runs before the first step, so a directory that is a file, read-only or too small is
reported before any work is lost (the main job used to find out at its first save). `CheckpointDirLock` is a lock
file naming the job that writes there; a second job is refused with the holder's host and pid. A lock left by a job
that died is taken over: on the same host when its process is gone (pid and start time), elsewhere when its
heartbeat (the lock file's modification time, touched every `HEARTBEAT_S`) is older than `STALE_S`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from fsdp_graph.state.save_failure import free_bytes, probe_writable

LOCK = ".fsdp_graph.lock"
HEARTBEAT_S = 10.0
STALE_S = 120.0
_MIB = 2**20


class CheckpointDirError(RuntimeError):
    """The checkpoint directory cannot be used (not a directory, cannot be created, not writable, or another job's
    lock is on it)."""

    fsdp_graph_brief = True


def check_checkpoint_dir(directory: str, need_bytes: int | None = None, what: str = "") -> list[str]:
    """Create `directory` if it is missing and check that files can be written in it; raises `CheckpointDirError`
    saying why not. Returns warnings (none, or one when the file system has fewer than `need_bytes` free; `what`
    says what those bytes are for, e.g. "2 checkpoints of about 9.8 MiB while a save runs")."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointDirError(f"checkpoint directory '{directory}' is not a directory (a file is there)")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointDirError(f"checkpoint directory '{directory}' cannot be created: {e.strerror or e}") from None
    if (why := probe_writable(directory)) is not None:
        raise CheckpointDirError(f"checkpoint directory '{directory}' is not writable: {why}")
    free = free_bytes(directory)
    if need_bytes and free is not None and free < need_bytes:
        return [
            f"checkpoint directory '{directory}' has {free / _MIB:,.1f} MiB free, but {what or 'the checkpoints'} "
            f"need about {need_bytes / _MIB:,.1f} MiB: saves may fail"
        ]
    return []


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), telling a live pid from a reused one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    return started is None or _start_time(pid) in (None, started)


class CheckpointDirLock:
    """`with CheckpointDirLock(directory):` — the job writing checkpoints into `directory`. `acquire()` raises
    `CheckpointDirError` naming the holder when a live job holds it, takes over a stale one (returning a note that
    says so), and starts a heartbeat thread; `release()` removes the lock."""

    def __init__(self, directory: str):
        self.directory, self.path = directory, os.path.join(directory, LOCK)
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid())}

    def _holder(self) -> dict | None:
        """The lock's content, {} when unreadable (being written, or damaged), None when there is no lock."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is gone, or None if it may be alive."""
        age = self._age()
        if holder.get("host") == self._mine["host"] and isinstance(holder.get("pid"), int):
            if not _alive(holder["pid"], holder.get("started")):
                return f"pid {holder['pid']} on this host is not running"
            return None
        if age > STALE_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _age(self) -> float:
        try:
            return time.time() - os.path.getmtime(self.path)
        except OSError:
            return 0.0

    def _create(self) -> bool:
        """Write the lock if there is none (atomic: O_EXCL); False when one is there."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({**self._mine, "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
        return True

    def acquire(self) -> str | None:
        for _ in range(50):
            if self._create():
                self._thread = threading.Thread(target=self._beat, name="checkpoint-dir-lock", daemon=True)
                self._thread.start()
                return self.note
            holder = self._holder()
            if holder is None:
                continue  # removed meanwhile
            if not holder and self._age() < 1.0:
                time.sleep(0.1)  # being written by its holder
                continue
            why = self._stale(holder) if holder else "its lock file is unreadable"
            if why is None:
                raise CheckpointDirError(
                    f"checkpoint directory '{self.directory}' is in use by another job (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {holder.get('since', '?')}): two jobs writing checkpoints into one "
                    f"directory would rotate out each other's. Use another --checkpoint-dir, or remove {self.path} "
                    "if that job is gone."
                )
            # Moved aside, then removed: of two jobs taking over the same stale lock, one rename succeeds.
            aside = f"{self.path}.stale.{os.getpid()}"
            try:
                os.rename(self.path, aside)
                os.remove(aside)
            except FileNotFoundError:
                continue
            self.note = f"took over the lock of a job that is gone ({why}): {self.path}"
        raise CheckpointDirError(f"checkpoint directory '{self.directory}': could not take its lock {self.path}")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            holder = self._holder()
            if holder and holder.get("pid") == self._mine["pid"] and holder.get("host") == self._mine["host"]:
                try:
                    os.remove(self.path)
                except OSError:
                    pass

    def __enter__(self) -> CheckpointDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
