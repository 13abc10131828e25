"""Inductor's precompiled C++ header, built only for a kernel that is compiled (issue 36: restarts from artifacts).

Before torch (2.11 to 2.13) loads a C++ kernel, even one whose library its cache holds, it precompiles the header
every kernel includes (`codecache._precompile_header` on `cpp_prefix.h`): on the first load in a process it
preprocesses the header (`g++ -E`, to key it) and, where no precompiled header is on disk yet, builds one (about
150 MB on x86). Only a kernel that is compiled uses it. A process whose kernels all come from the cache builds it all
the same when the directory holding precompiled headers is new, which is the case of a job resumed on a fresh
machine with its checkpoint's compiled artifacts.

`deferred_header()` defers that build to the first kernel compiled inside the block: torch still makes (and keys)
the header, and gets the same path back; the precompiled form is built only before a kernel whose library is not
there yet, so a compiled kernel is compiled exactly as before. A kernel library is found beside the source
`codecache.write` just wrote (`<hash>.main.cpp` -> `<hash>.main.so`), as torch's own loader finds it. Deferred
builds wait for the next block that compiles a kernel; a compile outside such a block in the same process (a
user's own `torch.compile` with Inductor) would compile its kernels against the header itself: the same code,
slower to compile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_pending: dict[str, list[tuple[Any, ...]]] = {}  # header path -> its deferred builds (torch's worker arguments)


@contextlib.contextmanager
def deferred_header() -> Iterator[None]:
    """Inside the block, torch's header precompile is deferred until a kernel is compiled (see the module)."""
    from torch._inductor import codecache

    precompile = getattr(codecache, "_precompile_header", None)
    worker = getattr(codecache, "_worker_compile_cpp", None)
    if precompile is None or worker is None:  # another torch: nothing deferred
        yield
        return
    write = codecache.write
    last_source: list[str] = []

    def noting_write(content, extension: str, *args, **kwargs):
        basename, path = write(content, extension, *args, **kwargs)
        if extension == "main.cpp":
            last_source[:] = [path]
        return basename, path

    def lazy_precompile(*args, **kwargs):
        deferred: list[tuple[Any, ...]] = []
        codecache._worker_compile_cpp = lambda *worker_args: deferred.append(worker_args)
        try:
            header = precompile(*args, **kwargs)
        finally:
            codecache._worker_compile_cpp = worker
        if deferred:
            _pending.setdefault(header, []).extend(deferred)
        library = Path(last_source[0]).with_suffix(".so") if last_source else None
        if library is None or not library.exists():  # this kernel is compiled: with the precompiled header
            for worker_args in _pending.pop(header, []):
                worker(*worker_args)
        return header

    codecache.write, codecache._precompile_header = noting_write, lazy_precompile
    try:
        yield
    finally:
        codecache.write, codecache._precompile_header = write, precompile
