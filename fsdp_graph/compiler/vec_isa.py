"""Inductor's CPU vector-ISA check, done once per machine instead of once per process (issue 25: warm restart).

Before Inductor loads a C++ kernel, even one from its cache, torch 2.13 decides which vector instruction sets the
machine can run (`cpu_vec_isa.pick_vec_isa`): for each set the CPU reports (avx512 with VNNI, avx512, avx2) it
builds a probe library and starts a fresh Python process that loads it. On the 2-core test machine that is about
0.9 CPU seconds of child processes in every process's first compiled step, about a sixth of a warm restart
(docs/design-notes.md, "Warm restart").

`vec_isa_patches()` records torch's verdict in Inductor's cache directory the first time, keyed by the torch
version, the C++ compiler and the sets the CPU reports. When torch found every reported set usable it returns
`{"cpp.vec_isa_ok": True}` for the compile's Inductor config, cold and warm alike: torch then skips the probe and
picks the same set it would have probed (the verdict is the same, so the compiled code and the cache key are the
same on every start). When a set failed, or the user set `cpp.vec_isa_ok`, it returns nothing: torch probes as
before. The per-feature probes torch runs after picking (avx512 bf16, VNNI) are left to torch.
`verdict_used()` names the record this process read or wrote: it travels with a compile's files
(`compiled_files.recording`), so a process that installs them on the same CPU skips the probe too.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

_used: list[Path] = []  # the record `vec_isa_patches` last read or wrote in this process


def verdict_used() -> Path | None:
    """The verdict record this process's compiles rely on, if one was read or written."""
    return _used[-1] if _used else None


def vec_isa_patches(record_dir: str | None = None) -> dict[str, bool]:
    """Inductor config patches that skip the per-process vector-ISA probe where torch's recorded verdict allows.
    The verdict is kept in `record_dir` (default: `<Inductor's cache directory>/fsdp_graph`)."""
    import torch
    from torch._inductor import config, cpp_builder, cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if config.cpp.vec_isa_ok is not None:  # the user's setting stands
        return {}
    with config.patch({"cpp.vec_isa_ok": True}):  # what the CPU reports, not probed (uncached call)
        reported = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]
    if not reported:
        return {}
    compiler = cpp_builder.get_cpp_compiler()
    facts = [torch.__version__, compiler, cpp_builder.get_compiler_version_info(compiler), *reported]
    key = hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:24]
    record = Path(record_dir or Path(cache_dir()) / "fsdp_graph") / f"vec_isa_{key}.json"
    try:
        usable = json.loads(record.read_text())
    except (OSError, ValueError):
        usable = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # torch's own probe, once per machine
        try:
            _write_atomically(record, json.dumps(usable))
        except OSError:  # a read-only cache: every process probes, as without the record, and decides alike
            return {"cpp.vec_isa_ok": True} if usable == reported else {}
    _used[:] = [record]
    return {"cpp.vec_isa_ok": True} if usable == reported else {}


def _write_atomically(path: Path, text: str) -> None:
    """Ranks starting together may all write it: each writes a file of its own and renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
