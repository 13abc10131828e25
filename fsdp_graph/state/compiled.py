"""A job's compiled code in its checkpoint (issue 36): a restart on an empty Inductor cache loads it instead of
compiling.

`save_checkpoint(..., compiled=backend)` writes, under `compiled/` in the checkpoint (through `extra_files`, so the
manifest's checksums cover every file), what the backend's compiles left in torch's caches
(`FSDPBackend.compiled`, recorded by `compiled_files.recording`): per graph, torch's serialized AOT autograd and FX
graph cache entries and what our passes reported of the graph (`rank_check.STORE`'s entry: `backend.reports` on a
cache hit, and the collective lists the rank check compares); the kernel libraries once each, under the CPU
they were built for; and `header.json`, which says what they were compiled for: torch's version, the world size, the
backend's options and passes, torch.compile's `mode=` and `options=`, and the model (every rank's parameter and
buffer names, shapes and dtypes and module classes, hashed).

`load_checkpoint(..., compiled=backend)` compares the header with this job before installing anything: another
torch, world size, model, backend options or passes, and the artifacts are ignored, rank 0 saying why in one line
(a warning). torch.compile's `mode=` and `options=` reach the backend only when it compiles, so they are compared
then: with other ones, the first compile says in one line that the artifacts do not apply (torch's cache keys,
which hold the options, miss them). Every file is checked against the manifest as it is read (also with
`verify_files=False`), and an entry torch cannot load is skipped with one line: the compile then runs as without
artifacts. Installing only fills torch's caches; torch's own cache keys still decide which code runs (its version,
configs, the graph, its inputs, the C++ compiler), so an artifact that does not apply after all costs a cache miss,
never other code.
Kernel libraries are installed only on ranks whose CPU is the one they were built for (`machine_id`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.compiler import compiled_files
from fsdp_graph.compiler.compiled_files import CompiledFiles, machine_id
from fsdp_graph.compiler.rank_check import STORE
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.state.checksums import MANIFEST

if TYPE_CHECKING:
    from fsdp_graph.compiler.backend import FSDPBackend

SUBDIR = "compiled"
HEADER = f"{SUBDIR}/header.json"
_FORMAT = 2  # 2: a graph carries its passes' reports (1: its collective lists)


def model_fingerprint(model: nn.Module) -> str:
    """This rank's model as compiled code depends on it: module classes, parameter and buffer names, shapes (as this
    rank holds them: every rank's fingerprint goes into the header, in rank order), dtypes and whether they train."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"m {name} {type(module).__module__}.{type(module).__qualname__}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"p {name} {tuple(p.shape)} {p.dtype} {p.requires_grad}\n".encode())
    for name, b in model.named_buffers():
        h.update(f"b {name} {tuple(b.shape)} {b.dtype}\n".encode())
    return h.hexdigest()


def _options(backend: FSDPBackend) -> dict[str, str]:
    """The backend's options that decide what its passes make of a graph (as in its cache key), by name."""
    schedule = {f.name: repr(getattr(backend.schedule, f.name)) for f in dataclasses.fields(backend.schedule)}
    return {"inductor": repr(backend.inductor), **schedule}


def _combined(fingerprints: list[str]) -> str:
    return hashlib.sha256("\n".join(fingerprints).encode()).hexdigest()[:32]


@dataclass
class _Graph:
    """One compiled graph as a rank holds it: its entries, its kernels and its passes' reports (`STORE`'s entry)."""

    key: str
    files: CompiledFiles
    reports: dict | None = None


def _held(backend: FSDPBackend) -> dict[str, _Graph]:
    return {key: _Graph(key, files, STORE.load(key)) for key, files in backend.compiled.items()}


def checkpoint_files(backend: FSDPBackend, model: nn.Module) -> dict[str, bytes]:
    """The files `save_checkpoint(compiled=backend)` adds ({} when the backend compiled nothing yet): their content
    on rank 0, which writes them, and their names (empty content) on the others. Collective: the ranks' graph keys
    are gathered, and a rank holding a graph rank 0 lacks (a pipeline stage of its own) sends it to rank 0."""
    if not backend.inductor:
        raise ValueError(
            "save_checkpoint(compiled=backend): this backend was made with make_backend(inductor=False) and "
            "compiles no code to save; drop compiled= or use an Inductor backend"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    held = _held(backend)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (model_fingerprint(model), sorted(held)))
    sender: dict[str, int] = {}
    for r, (_, keys) in enumerate(everyone):
        for key in keys:
            sender.setdefault(key, r)
    if any(r != 0 for r in sender.values()):
        mine = {key: held[key] for key, r in sender.items() if r == rank and rank != 0}
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        for sent in gathered or []:
            held.update(sent)
    files: dict[str, bytes] = {}
    if rank == 0 and held:
        files = _encode(backend, held, _combined([fp for fp, _ in everyone]), world)
    elif rank == 0:
        warnings.warn(
            "save_checkpoint(compiled=backend): the backend has compiled nothing with torch's caches on yet; the "
            "checkpoint carries no compiled artifacts",
            stacklevel=3,
        )
    names: list = [sorted(files)]  # every rank checksums the same list of files (a collective); rank 0 writes them
    dist.broadcast_object_list(names, src=0, device=collective_device(None, torch.device("cpu")))
    return files if rank == 0 else dict.fromkeys(names[0], b"")


def _encode(backend: FSDPBackend, held: dict[str, _Graph], model: str, world: int) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    graphs, kernels = [], []
    seen: set[tuple[str, str]] = set()
    for index, key in enumerate(sorted(held)):
        graph = held[key]
        entry = {"key": key, "artifacts": None, "reports": graph.reports}
        if graph.files.artifacts:
            entry["artifacts"] = f"{SUBDIR}/graph_{index}.bin"
            files[entry["artifacts"]] = graph.files.artifacts
        graphs.append(entry)
        for relative, data in sorted(graph.files.kernels.items()):
            if (graph.files.machine, relative) in seen:
                continue
            seen.add((graph.files.machine, relative))
            name = f"{SUBDIR}/kernels/{graph.files.machine}/{relative}"
            files[name] = data
            kernels.append({"path": relative, "machine": graph.files.machine, "file": name})
    header = {
        "format": _FORMAT,
        "torch": torch.__version__,
        "world": world,
        "options": _options(backend),
        "passes": backend.passes_hash(),
        "compile_options": sorted(backend.compile_options),
        "model": model,
        "graphs": graphs,
        "kernels": kernels,
    }
    files[HEADER] = json.dumps(header, indent=1).encode()
    return files


@dataclass
class _Found:
    """The loading job's ranks, gathered: their torch versions and CPUs, and the model (all ranks' fingerprints)."""

    torch: list[str]
    machines: list[str]
    model: str


def _mismatch(header: dict, backend: FSDPBackend, found: _Found) -> str | None:
    """Why the artifacts do not apply to this job, or None."""
    if header.get("format") != _FORMAT:
        return f"written in format {header.get('format')!r} by another fsdp_graph version (this one reads {_FORMAT})"
    others = sorted({v for v in found.torch if v != header["torch"]})
    if others:
        return f"compiled by torch {header['torch']}, this job runs torch {', '.join(others)}"
    if header["world"] != len(found.torch):
        world = len(found.torch)
        return f"compiled for {header['world']} ranks, this job has {world} (the graphs' shard sizes differ)"
    if header["passes"] != backend.passes_hash():
        return "compiled by other fsdp_graph passes (the passes' code changed since)"
    if header["options"] != (mine := _options(backend)):
        saved = header["options"]
        changed = [
            f"{k}={saved.get(k)} -> {mine.get(k)}" for k in sorted({*saved, *mine}) if saved.get(k) != mine.get(k)
        ]
        return f"compiled with other backend options ({', '.join(changed)})"
    if header["model"] != found.model:
        return "compiled for another model (its module classes, or its parameters' names, shapes or dtypes differ)"
    return None


def _check_listing(header: dict) -> None:
    """Raises ValueError unless the header's graphs and kernels are listed as `_encode` lists them."""
    inside = f"{SUBDIR}/"
    for graph in header["graphs"]:
        artifacts = graph["artifacts"]
        if not isinstance(graph["key"], str) or not (artifacts is None or str(artifacts).startswith(inside)):
            raise ValueError(f"graph entry {graph!r:.80}")
    for kernel in header["kernels"]:
        if not (isinstance(kernel["machine"], str) and str(kernel["file"]).startswith(inside)):
            raise ValueError(f"kernel entry {kernel!r:.80}")
        if not compiled_files.machine_file(str(kernel["path"])):
            raise ValueError(f"kernel path {kernel['path']!r} is not a kernel file inside Inductor's cache")


class _UnreadableError(Exception):
    """A file of `compiled/` that cannot be used as saved."""


def _reader(path: str):
    """Reads a file of the checkpoint, checked against its manifest entry (also when the load skipped the
    manifest check): a file the manifest does not list, or whose bytes differ, raises `_UnreadableError`."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _UnreadableError(f"{MANIFEST} unreadable or missing ({type(e).__name__})") from None

    def read(name: str) -> bytes:
        entry = listed.get(name) if isinstance(listed, dict) else None
        if entry is None:
            raise _UnreadableError(f"{name} is not in {MANIFEST}")
        try:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
        except OSError as e:
            raise _UnreadableError(f"{name} unreadable ({e.strerror or e})") from None
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise _UnreadableError(f"{name} differs from {MANIFEST}'s checksum")
        return data

    return read


def install_from_checkpoint(path: str, backend: FSDPBackend, model: nn.Module) -> Counter:
    """Installs the compiled artifacts of the checkpoint at `path` into this process's caches, if they apply to
    this job; returns what was installed ("graphs", "kernels"), also added to `backend.restored`. Collective
    (one all-gather) where the checkpoint has a `compiled/` header; warns in one line (rank 0, or the rank it
    concerns) when they are ignored, in part or whole. Call it before the first compile."""
    installed: Counter = Counter()
    if not os.path.exists(os.path.join(path, HEADER)):
        return installed
    rank = dist.get_rank()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (torch.__version__, machine_id(), model_fingerprint(model)))
    found = _Found([v for v, _, _ in everyone], [m for _, m, _ in everyone], _combined([fp for _, _, fp in everyone]))
    where = f"'{os.path.join(path, SUBDIR)}'"
    try:
        read = _reader(path)
        header = json.loads(read(HEADER))
        reason = _mismatch(header, backend, found)
        if reason is None:
            _check_listing(header)
    except (_UnreadableError, ValueError, KeyError, TypeError, AttributeError) as e:
        header, reason = None, f"their header is unusable ({type(e).__name__}: {e})"
    if reason is not None:
        if rank == 0:
            _warn(f"compiled artifacts in {where} ignored: {reason}; compiling as without them")
        return installed
    problems = []
    for graph in header["graphs"]:
        try:
            if graph["artifacts"] is not None:
                _load_entries(read(graph["artifacts"]))
            if graph["reports"] is not None:
                STORE.save(graph["key"], graph["reports"]["rank"], graph["reports"]["reports"])
            installed["graphs"] += 1
        except Exception as e:  # torch's loader raises whatever a bad entry makes it raise
            problems.append(f"graph {graph['key'][:12]}: {type(e).__name__}: {e}"[:300])
    mine = machine_id()
    kernels = [k for k in header["kernels"] if k["machine"] == mine]
    try:
        files = CompiledFiles(None, {k["path"]: read(k["file"]) for k in kernels}, mine)
        installed["kernels"] += compiled_files.install(files)
    except (_UnreadableError, ValueError, OSError) as e:
        problems.append(f"kernels: {e}")
    backend.restored.update(installed)
    backend.restored_options = (where, frozenset(header.get("compile_options", ())))
    built_for = {k["machine"] for k in header["kernels"]}
    elsewhere = [r for r, m in enumerate(found.machines) if built_for and m not in built_for]
    if problems:
        _warn(f"compiled artifacts in {where} partly ignored on rank {rank}: {'; '.join(problems)}; those compile")
    elif elsewhere and rank == 0:
        ranks = ", ".join(str(r) for r in elsewhere)
        _warn(
            f"compiled artifacts in {where}: the kernel libraries were built for another CPU than rank(s) {ranks} "
            "run on; those ranks build them again (the graphs' cache entries are installed)"
        )
    return installed


def _load_entries(data: bytes) -> None:
    """torch's `load_cache_artifacts`, raising where torch cannot read the entries (it logs a traceback and
    returns None; the caller says it in one line instead)."""
    cache_log = logging.getLogger("torch.compiler._cache")
    level = cache_log.level
    cache_log.setLevel(logging.ERROR)
    try:
        if torch.compiler.load_cache_artifacts(data) is None:
            raise ValueError("torch cannot read these cache entries")
    finally:
        cache_log.setLevel(level)


def _warn(message: str) -> None:
    warnings.warn(f"load_checkpoint: {message}", stacklevel=3)
