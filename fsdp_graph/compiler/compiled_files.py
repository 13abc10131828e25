"""What one compile leaves in torch's caches, captured so another process can load it instead of compiling (issue 36).

A compile through Inductor writes two kinds of files into Inductor's cache directory:
- the AOT autograd and FX graph cache entries (the forward and backward graphs, partitioned, lowered and generated
  as code), which torch's cache-artifact API serializes (`torch.compiler.save_cache_artifacts`, the "mega-cache");
- on CPU, the C++ kernel libraries that code loads (`<cache>/<xx>/<hash>.main.so`, and the `<hash>.so` probes torch
  builds to check CPU features). The mega-cache does not carry them: a process that loads the entries into an empty
  cache runs g++ for every kernel again (measured: the same compiler runs as a cold compile, on a 2-op graph).

`recording()` captures both for the compile it surrounds: the mega-cache entries of that compile only (torch's
`CacheArtifactManager.with_fresh_cache`, the entries then recorded again in the caller's, so a user's own
`save_cache_artifacts()` still sees them), and every kernel library the compile wrote or loaded (its sources go
through `torch._inductor.codecache.write`; the library sits beside the source), with the vector-ISA verdict the
compile relied on (`vec_isa.verdict_used`). `install()` puts them into this process's caches. A kernel library is
built with `-march=native`: it is installed only on a machine with the same CPU (`machine_id()`), elsewhere torch
builds it again. Installing only fills caches: torch's own cache keys still decide which code runs, so a file that
does not apply here costs a cache miss, never other code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath


@dataclass
class CompiledFiles:
    """One compile's cache entries (`artifacts`: torch's serialized mega-cache, None if it recorded none) and the files
    that only apply on the CPU they were made on (`kernels`: path relative to Inductor's cache directory -> bytes:
    kernel libraries, and the vector-ISA verdict), made on `machine`."""

    artifacts: bytes | None = None
    kernels: dict[str, bytes] = field(default_factory=dict)
    machine: str = ""

    @property
    def nbytes(self) -> int:
        return len(self.artifacts or b"") + sum(len(data) for data in self.kernels.values())


@functools.cache
def machine_id() -> str:
    """The CPU a kernel library built here runs on: its architecture, model and feature flags (Inductor builds with
    `-march=native`, so a library from a CPU with other features may not run)."""
    facts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name = line.split(":", 1)[0].strip()
                if name in ("model name", "flags", "Features", "CPU part") and line not in facts:
                    facts.append(line.strip())
                if not line.strip() and len(facts) > 1:
                    break  # the first processor's entry is enough: a machine's cores are alike here
    except OSError:
        facts.append(platform.processor())
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def caches_on() -> bool:
    """torch's compile caches (AOT autograd's and Inductor's FX graph cache) are on: a compile leaves entries."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    caches = inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    return bool(caches) and not inductor_config.force_disable_caches


def _cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


@contextlib.contextmanager
def recording() -> Iterator[CompiledFiles]:
    """Captures the cache entries and kernel libraries of the compile run inside; filled in when the block ends
    without an error."""
    from torch._inductor import codecache
    from torch.compiler._cache import CacheArtifactManager

    files = CompiledFiles(machine=machine_id())
    sources: list[str] = []
    write = codecache.write

    def recorded_write(content, extension: str, *args, **kwargs):
        basename, path = write(content, extension, *args, **kwargs)
        if extension.endswith("cpp"):
            sources.append(path)
        return basename, path

    with CacheArtifactManager.with_fresh_cache():
        codecache.write = recorded_write
        try:
            yield files
            captured = {kind: list(items) for kind, items in CacheArtifactManager._new_cache_artifacts.items()}
            serialized = CacheArtifactManager.serialize()
        finally:
            codecache.write = write
    _record_in_callers_cache(captured)
    files.artifacts = serialized[0] if serialized is not None else None
    root = _cache_dir()
    for source in dict.fromkeys(sources):
        library = Path(source).with_suffix(".so")
        try:
            relative = library.relative_to(root)
            files.kernels[relative.as_posix()] = library.read_bytes()
        except (ValueError, OSError):  # outside the cache directory, or never built (an object file, linked)
            continue
    from fsdp_graph.compiler.vec_isa import verdict_used

    if (verdict := verdict_used()) is not None:
        try:
            files.kernels[verdict.relative_to(root).as_posix()] = verdict.read_bytes()
        except (ValueError, OSError):  # kept elsewhere (a caller's record directory)
            pass


def _record_in_callers_cache(captured: dict) -> None:
    """The entries recorded under the fresh cache, recorded again where the caller's `save_cache_artifacts()` reads
    them (torch's own `record_artifact`, which takes the content before encoding, would encode them twice)."""
    from torch.compiler._cache import CacheArtifactManager

    for kind, items in captured.items():
        for artifact in items:
            if artifact not in CacheArtifactManager._seen_artifacts:
                CacheArtifactManager._new_cache_artifacts[kind].append(artifact)
                CacheArtifactManager._seen_artifacts.add(artifact)


def install(files: CompiledFiles) -> int:
    """Puts `files` into this process's caches: the entries through torch's `load_cache_artifacts`, the kernel
    libraries (and ISA verdict) under Inductor's cache directory where none is yet (only if made on this machine's
    CPU). Returns the number of files written there. Raises ValueError for a path outside the cache directory."""
    import torch

    if files.artifacts:
        torch.compiler.load_cache_artifacts(files.artifacts)
    if files.machine != machine_id():
        return 0
    root, written = _cache_dir(), 0
    for relative, data in files.kernels.items():
        if not machine_file(relative):
            raise ValueError(f"fsdp_graph: a compiled kernel's path {relative!r} is not inside the Inductor cache")
        target = root.joinpath(*PurePosixPath(relative).parts)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755 if relative.endswith(".so") else 0o644)
        os.replace(tmp, target)  # ranks sharing a cache directory may write the same library at once
        written += 1
    return written


def machine_file(relative: str) -> bool:
    """`relative` names a file `install` may write: a kernel library or an ISA verdict inside Inductor's cache."""
    path = PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts or "\\" in relative:
        return False
    verdict = path.parent.as_posix() == "fsdp_graph" and path.name.startswith("vec_isa_") and path.suffix == ".json"
    return path.suffix == ".so" or verdict
