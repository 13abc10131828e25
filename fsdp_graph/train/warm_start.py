"""Imported by the launcher's fork server (`fsdp_graph.train.launch`, FSDP_GRAPH_START_METHOD=forkserver): compiles
and runs one tiny function forward and backward, so that every rank forked from the server starts with the compile
stack's lazily built state (Dynamo's trace rules and variable tables, AOT autograd's decompositions, the FX code
generators) already built.

Measured on the 2-core test machine: a process's first compile of a sharded 2-layer model took 2.0 s, the next
ones 0.75 s; after this warm-up the first one takes 0.75 s too. The suite forks several hundred ranks, each
paying that second once.

The server must stay safe to fork: the warm-up uses AOT autograd with eager kernels only (no Inductor, whose
compile workers are processes and threads), no process group, and afterwards resets Dynamo (no compiled code or
guards reach a rank) and its counters, and stops tqdm's monitor thread if the compile stack started one.
"""

from __future__ import annotations


def warm_up() -> None:
    import torch
    import torch._dynamo

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).relu().sum()

    compiled = torch.compile(tiny, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(8, requires_grad=True)).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _stop_tqdm_monitor()


def _stop_tqdm_monitor() -> None:
    try:
        from tqdm import tqdm
    except ImportError:
        return
    monitor = getattr(tqdm, "monitor", None)
    if monitor is not None:
        monitor.exit()
        tqdm.monitor = None


warm_up()
