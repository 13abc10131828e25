"""Per-file checksums of a checkpoint directory: computed at save, checked before a load.

DCP checks nothing itself: a truncated shard file fails inside torch.load with a message that names no file, and a
file whose bytes were flipped loads silently (measured: the resumed run went on from corrupted weights). So
`save_checkpoint` writes a manifest (size and SHA-256 of every file, `.metadata` included) and `load_checkpoint`
checks it first. Both spread the hashing over the ranks and agree on the result through collectives, so every rank
reaches the same verdict on the same files.

The manifest is a list of files (`{"files": {name: {"size", "sha256"}}}`): files written beside DCP's (a loss
history, compiled artifacts) are covered by adding them to it. A checkpoint without one is refused unless the caller
says it is foreign (written by torch's DCP); then only the sizes its `.metadata` implies are checked."""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from fsdp_graph.compat import saved_storage_data
from fsdp_graph.runtime.devices import collective_device

MANIFEST = "checksums.json"
_FORMAT = 1
_METADATA = ".metadata"
_CHUNK = 8 << 20
_DIGEST_WORDS = 32  # SHA-256 bytes, one int64 each: summed over ranks, where only the file's hasher is non-zero

_OK, _MISSING, _WRONG_SIZE, _WRONG_CHECKSUM, _UNREADABLE = range(5)


def files_written(metadata, directory: str) -> list[str]:
    """The files of the checkpoint DCP's FileSystemWriter has just written to `directory` (`metadata`: what
    `dcp.save` returned), sorted."""
    storage_data = saved_storage_data(metadata, directory)
    return sorted({info.relative_path for info in storage_data.values()} | {_METADATA})


def _digest(path: str) -> tuple[int, bytes]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return os.path.getsize(path), sha.digest()


def _summed(t: torch.Tensor) -> torch.Tensor:
    on_device = t.to(collective_device(None, torch.device("cpu")))
    dist.all_reduce(on_device)
    return on_device.cpu()


def checksums(directory: str, files: list[str]) -> dict[str, dict]:
    """{file: {"size", "sha256"}} for `files` in `directory`; size -1 where the file could not be read back.
    Collective: rank r hashes files r, r + world, ..."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(len(files), dtype=torch.int64)
    digests = torch.zeros(len(files), _DIGEST_WORDS, dtype=torch.int64)
    for i in range(rank, len(files), world):
        try:
            size, digest = _digest(os.path.join(directory, files[i]))
        except OSError:
            sizes[i] = -1
            continue
        sizes[i] = size
        digests[i] = torch.tensor(list(digest), dtype=torch.int64)
    sizes, digests = _summed(sizes), _summed(digests)
    return {
        name: {"size": int(size), "sha256": bytes(row.tolist()).hex()}
        for name, size, row in zip(files, sizes.tolist(), digests)
    }


def write_manifest(directory: str, entries: dict[str, dict]) -> None:
    """Rank 0: write `checksums()`' result into the checkpoint directory (before it is published)."""
    unread = [name for name, entry in entries.items() if entry["size"] < 0]
    if unread:
        raise OSError(f"save_checkpoint: could not read back {', '.join(unread)} in '{directory}'.")
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": _FORMAT, "writer": "fsdp_graph", "algorithm": "sha256", "files": entries}, f, indent=1)


def _expected(directory: str, foreign: bool) -> tuple[dict[str, tuple[int, str | None]] | str, bool]:
    """({file: (size, sha256)} from the manifest, False). Without one: with `foreign`, the least size each data file
    must have, from DCP's `.metadata`, and no checksum (True: the content is unverified); else why it is refused.
    A string: why the checkpoint cannot be checked."""
    manifest = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                files = json.load(f)["files"]
            return {name: (int(e["size"]), str(e["sha256"])) for name, e in files.items()}, False
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{MANIFEST}: unreadable ({type(e).__name__}: {e})", False
    if not foreign:
        return (
            f"{MANIFEST}: missing (every checkpoint fsdp_graph writes has one; for a checkpoint written by torch's "
            "DCP pass foreign=True)",
            False,
        )
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as e:  # a damaged pickle raises anything
        return f"{_METADATA}: unreadable ({type(e).__name__}: {e})", True
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return {name: (end, None) for name, end in ends.items()}, True


def _check(path: str, size: int, sha256: str | None) -> tuple[int, int]:
    """(code, the size found) for one file against what is expected of it."""
    if not os.path.exists(path):
        return _MISSING, -1
    found = os.path.getsize(path)
    if found < size or (sha256 is not None and found != size):
        return _WRONG_SIZE, found
    if sha256 is None:
        return _OK, found
    try:
        _, digest = _digest(path)
    except OSError:
        return _UNREADABLE, found
    return (_OK if digest.hex() == sha256 else _WRONG_CHECKSUM), found


def verify(directory: str, *, foreign: bool = False) -> tuple[list[str], bool]:
    """(what is wrong with the files of the checkpoint in `directory`, one line per damaged file ([] if nothing);
    whether only sizes could be checked (a foreign checkpoint without a manifest)). Collective, and every rank
    returns the same: rank 0 reads what to expect, rank r checks files r, r + world, ..., and the verdicts are
    combined."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shared: list = [_expected(directory, foreign) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0, device=collective_device(None, torch.device("cpu")))
    expected, unverified = shared[0]
    if isinstance(expected, str):
        return [expected], unverified
    names = sorted(expected)
    codes = torch.zeros(len(names), dtype=torch.int64)
    found = torch.zeros(len(names), dtype=torch.int64)
    for i in range(rank, len(names), world):
        codes[i], found[i] = _check(os.path.join(directory, names[i]), *expected[names[i]])
    codes, found = _summed(codes), _summed(found)
    problems = []
    for name, code, size in zip(names, codes.tolist(), found.tolist()):
        want, sha256 = expected[name]
        if code == _MISSING:
            problems.append(f"{name}: missing")
        elif code == _WRONG_SIZE:
            what = f"{want:,} bytes" if sha256 is not None else f"at least {want:,} bytes (from {_METADATA})"
            problems.append(f"{name}: {size:,} bytes, {what} expected (truncated or overwritten)")
        elif code == _WRONG_CHECKSUM:
            problems.append(f"{name}: its SHA-256 differs from {MANIFEST}'s (bytes changed after the save)")
        elif code == _UNREADABLE:
            problems.append(f"{name}: unreadable")
    return problems, unverified
