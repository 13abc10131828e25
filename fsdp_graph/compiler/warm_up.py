"""What a process's first compile imports and computes once, done ahead of it (issue 36: one compile per job).

A compile that torch's caches serve still pays, once per process, for what torch does lazily: importing AOT
autograd, its partitioner, and with Inductor `compile_fx` and the C++ codegen and builder (about 300 modules, 0.9 s
of a 2-core machine's CPU), and `torch_key()`, the hash of torch's source files that every AOT autograd and FX graph
cache key includes (0.2 s), and with Inductor its device backends' registration. A rank that waits for another
rank's compile (`shared_compile`) calls it before it waits, so that this work overlaps the other rank's compile
instead of following it; the tests' fork server calls it once for every rank it forks
(`fsdp_graph.train.warm_start`).
"""

from __future__ import annotations

import importlib

# Imported by any compile through our backend (eager kernels included: AOT autograd's cache keeps them as torch's
# RegionalOutputCode).
AOT_MODULES = (
    "torch._dynamo.backends.common",
    "torch._dynamo.repro.after_aot",
    "torch._functorch.aot_autograd",
    "torch._functorch._aot_autograd.autograd_cache",
    "torch._functorch.partitioners",
    "functorch.compile",
    "networkx",
    "torch.export._trace",
    "torch._inductor.output_code",
    # Dynamo's check of whether a call is `local_map`'s, on every traced function call it cannot skip
    "torch.distributed.tensor.experimental._func_map",
)
# Imported by an Inductor compile, also when its FX graph cache serves it (the cached graph's module imports them).
INDUCTOR_MODULES = (
    "torch._inductor.compile_fx",
    "torch._inductor.codegen.cpp",
    "torch._inductor.cpp_builder",
    "torch.utils.cpp_extension",
)


def load_compile_stack(inductor: bool = True) -> None:
    """Imports what this process's first compile would (`AOT_MODULES`, and `INDUCTOR_MODULES` with `inductor`), with
    `inductor` registers Inductor's device backends, and computes torch's source key: torch keeps each for the
    process (forked children inherit them)."""
    for name in AOT_MODULES + (INDUCTOR_MODULES if inductor else ()):
        try:
            importlib.import_module(name)
        # Another torch may name them otherwise: the compile then imports what it uses, and meets any error there.
        except Exception:
            pass
    if inductor:
        # Inductor's device backends (cached for the process): registered by the first FX graph hash, cached or not
        try:
            from torch._inductor.codegen.common import init_backend_registration

            init_backend_registration()
        except Exception:  # another torch may have none, or fail here: the compile then registers what it uses
            pass
    from torch._inductor import codecache

    torch_key = getattr(codecache, "torch_key", None)  # another torch may have none: its compile keys as it will
    if torch_key is not None:
        torch_key()
