"""Why a checkpoint save failed, in one line.

DCP reports a failed write as `CheckpointException` (a `BaseException`, so `except Exception` never sees it) whose
text holds every rank's traceback; with a full disk the root cause it shows can be torch.save's zip writer
("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), with no errno. So the reason is taken
from an errno where one of the failures carries it, else from the file system as it is after the failure: free
space, whether the directory still exists and whether a file can be created in it.
"""

from __future__ import annotations

import errno
import os
import shutil

_MIB = 2**20
_FULL_BELOW = 1 * _MIB  # free bytes under which a failed write is put down to a full disk
_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "the directory is missing (removed while saving?)",
}


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written. Raised on every rank alike, after the partial `<path>.tmp` was removed;
    the checkpoint previously at `path` (if any) is untouched. `reason` is the one-line cause (no space, read-only,
    missing, ...), `details` the underlying error's full text (DCP's per-rank tracebacks)."""

    fsdp_graph_brief = True  # the launcher reports the message alone, not a traceback

    def __init__(self, path: str, reason: str, details: str = ""):
        self.path, self.reason, self.details = path, reason, details
        super().__init__(
            f"save_checkpoint: could not write '{path}': {reason}. The partial {os.path.basename(path)}.tmp was "
            "removed; the previous checkpoint is untouched."
        )


def _errors(error: BaseException) -> list[BaseException]:
    """`error`, its causes, and for a DCP `CheckpointException` each rank's failure."""
    found, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in found):
            continue
        found.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in failures.values())
        todo.extend([e.__cause__, e.__context__])
    return found


def free_bytes(directory: str) -> int | None:
    """Free bytes for an unprivileged writer on the file system holding `directory` (or its nearest existing
    parent); None if it cannot be read."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def probe_writable(directory: str) -> str | None:
    """None if a file can be created in `directory`, else why not (one phrase)."""
    if not os.path.exists(directory):
        return "it does not exist"
    if not os.path.isdir(directory):
        return "it is not a directory"
    probe = os.path.join(directory, f".fsdp_graph_probe.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        return _REASONS.get(e.errno, e.strerror or str(e))
    return None


def diagnose(directory: str, error: BaseException, need_bytes: int | None = None) -> str:
    """One line saying why writing a checkpoint into `directory` failed with `error`."""
    errors = _errors(error)
    for e in errors:
        if isinstance(e, OSError) and e.errno in _REASONS:
            reason = _REASONS[e.errno]
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                reason += _space(directory, need_bytes)
            return reason
    free = free_bytes(directory)
    if free is not None and free < _FULL_BELOW:
        return "no space left on device" + _space(directory, need_bytes)
    if (why := probe_writable(directory)) is not None:
        return why
    root = next((e for e in errors if not isinstance(getattr(e, "failures", None), dict)), error)
    text = str(root).strip().splitlines()
    return f"{type(root).__name__}: {text[-1] if text else '(no message)'}"


def _space(directory: str, need_bytes: int | None) -> str:
    free = free_bytes(directory)
    have = f"{free / _MIB:,.1f} MiB free on {os.path.abspath(directory)} when the write failed"
    need = f"; the checkpoint takes about {need_bytes / _MIB:,.1f} MiB" if need_bytes else ""
    return f" ({have}{need})" if free is not None else ""
