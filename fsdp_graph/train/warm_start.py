"""Imported by the launcher's fork server (`fsdp_graph.train.launch`, FSDP_GRAPH_START_METHOD=forkserver): compiles
and runs one tiny function, so that every rank forked from the server starts with the compile
stack's lazily built state (Dynamo's trace rules and variable tables, AOT autograd's decompositions, the FX code
generators) already built.

Measured on the 2-core test machine: a process's first compile of a sharded 2-layer model took 1.94 s, 1.58 s
after this warm-up (the next ones 0.75 s: the rest is the first backward's set-up, which cannot be warmed here).
The suite forks several hundred ranks. Only CPU builds of torch warm up: a CUDA or ROCm build could initialise its
driver while compiling, and a process forked after that cannot use the GPU.

It also indexes the sources Dynamo names functions from (`_index_traced_sources`), and imports and computes what a
first compile does once per process (`fsdp_graph.compiler.warm_up.load_compile_stack`: about 800 modules, Inductor's
C++ codegen among them, and torch's source key; over 1 s of CPU a rank).

The server must stay safe to fork: the warm-up compiles an inference graph with eager kernels only (no autograd,
whose engine marks a forked child unable to run a backward once it has started, torch 2.11; no Inductor, whose
compile workers are processes and threads), no process group, and afterwards resets Dynamo (no compiled code or
guards reach a rank) and its counters, and stops tqdm's monitor thread if the compile stack started one.
"""

from __future__ import annotations

from fsdp_graph.compiler.warm_up import load_compile_stack


def warm_up() -> None:
    import torch
    import torch._dynamo

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).relu().sum()

    compiled = torch.compile(tiny, backend="aot_eager", fullgraph=True)
    with torch.no_grad():  # no autograd: its engine, once started, refuses to run in a forked child (torch 2.11)
        compiled(torch.randn(8))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _stop_tqdm_monitor()
    _index_traced_sources()
    load_compile_stack(inductor=True)


def _index_traced_sources() -> None:
    """Dynamo names the function behind each graph node it records by tokenizing that function's whole source file,
    once per file and process (`torch._dynamo.funcname_cache`; 0.1-0.3 s a rank for torch.nn's and fsdp_graph's
    files). Here once, for the files every compile traces through."""
    import glob
    import os

    import torch.nn

    try:
        from torch._dynamo.funcname_cache import get_funcname
    except ImportError:  # another torch: each rank indexes what it traces, as before
        return
    nn_dir = os.path.dirname(torch.nn.__file__)
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = [os.path.join(nn_dir, "functional.py"), *glob.glob(os.path.join(nn_dir, "modules", "*.py"))]
    sources += glob.glob(os.path.join(package_dir, "runtime", "*.py"))
    for source in sources:
        get_funcname(source, 1)


def _stop_tqdm_monitor() -> None:
    try:
        from tqdm import tqdm
    except ImportError:
        return
    monitor = getattr(tqdm, "monitor", None)
    if monitor is not None:
        monitor.exit()
        tqdm.monitor = None


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


if _cpu_only_torch():  # a GPU build could initialise its driver while compiling: no fork is safe after that
    warm_up()
