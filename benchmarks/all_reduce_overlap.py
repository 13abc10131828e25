"""HYBRID_SHARD's replica all-reduce overlapped with the backward (issue 27 item 3) against waited at once.

    python benchmarks/all_reduce_overlap.py [--steps 12] [--batch 4] [--world 4]

The benchmark Llama (benchmarks/workload.py) under HYBRID_SHARD on a (2, world/2) mesh of gloo ranks on this
machine, compiled with the eager-kernel backend (the lowered graph's node order is the order that runs), SGD with
momentum. Two models on every rank, one per schedule:
- "overlapped": `passes.schedule` as it is: each replica all-reduce is waited at the next all-reduce's issue;
- "waited at once": the schedule before issue 27 item 3, the all-reduce's wait and tail moved with its
  reduce-scatter's wait (here: `passes.schedule._sink_reduce_waits` replaced, for that model's compile only, by its
  first sweep alone; the compile caches are off, so neither model reuses the other's code).
Both are checked before timing: "waited at once" has no node between any all-reduce and its wait, "overlapped" has
some. Then the two are stepped in turn (A B A B ...), every step after a barrier, so a drift of the machine's speed
hits both alike. Printed: each schedule's median step time (the mean over ranks of each rank's median) and the ratio
overlapped / waited at once from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp_graph
import passes.schedule
from fsdp_graph.ir import ALL_TO_ALL, REDUCE_SCATTER
from fsdp_graph.train.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import batches, bench_model, llama_loss  # noqa: E402

OVERLAPPED, AT_ONCE = "overlapped", "waited at once"


@contextlib.contextmanager
def _schedule(name: str):
    """Compiles inside this context use the named schedule."""
    current = passes.schedule._sink_reduce_waits
    if name == AT_ONCE:
        passes.schedule._sink_reduce_waits = lambda graph, serial: passes.schedule._sink_waits(
            graph, {(REDUCE_SCATTER, None), (ALL_TO_ALL, None)}, serial
        )
    try:
        yield
    finally:
        passes.schedule._sink_reduce_waits = current


def nodes_between_all_reduces_and_waits(code: str) -> list[int]:
    """For each `all_reduce` in a lowered graph's code: the number of lines between its issue and its wait."""
    lines = code.splitlines()
    gaps = []
    for k, line in enumerate(lines):
        issued = re.match(r"\s*(\w+) = torch\.ops\._c10d_functional\.all_reduce\.default\(", line)
        if issued:
            wait = next(j for j in range(k + 1, len(lines)) if f"wait_tensor.default({issued[1]})" in lines[j])
            gaps.append(wait - k - 1)
    return gaps


def measure(rank: int, world: int, steps: int, batch: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    data = next(batches(batch, rank, world, seed=0))
    runs, gaps = {}, {}
    for name in (OVERLAPPED, AT_ONCE):
        torch.manual_seed(0)
        model = fsdp_graph.fully_shard(bench_model(), mesh, strategy=fsdp_graph.ShardingStrategy.HYBRID_SHARD)
        backend = fsdp_graph.make_backend(inductor=False)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(compiled=compiled, optimizer=optimizer) -> None:
            llama_loss(compiled, data).backward()
            optimizer.step()
            optimizer.zero_grad()

        with _schedule(name):
            step()  # compiles forward and backward
        step()
        (bw,) = [r for r in backend.reports if r.stage == "bw"]
        gaps[name] = nodes_between_all_reduces_and_waits(bw.code)
        runs[name] = step
    if any(gaps[AT_ONCE]) or not any(gaps[OVERLAPPED]):
        raise RuntimeError(f"the two schedules are not the ones compared: {gaps}")
    times: dict[str, list[float]] = {OVERLAPPED: [], AT_ONCE: []}
    for _ in range(steps):
        for name, step in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {"median": {name: statistics.median(t) for name, t in times.items()}, "gaps": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per schedule (after two untimed)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world", type=int, default=4, help="gloo ranks, an even number (mesh 2 x world/2)")
    args = parser.parse_args()
    if args.world < 4 or args.world % 2:
        parser.error("--world must be an even number >= 4 (2 replicas of at least 2 shards)")
    results = spawn(measure, args.world, (args.steps, args.batch), timeout_s=900)
    median = {name: statistics.mean(r["median"][name] for r in results) for name in (OVERLAPPED, AT_ONCE)}
    print(f"HYBRID_SHARD, mesh 2x{args.world // 2} gloo, batch {args.batch}/rank, {args.steps} steps per schedule")
    print(f"nodes between each all-reduce and its wait (rank 0): {results[0]['gaps']}")
    for name in (AT_ONCE, OVERLAPPED):
        print(f"{name:>15}: median step {median[name] * 1e3:.1f} ms")
    print(f"ratio overlapped / waited at once: {median[OVERLAPPED] / median[AT_ONCE]:.3f}")


if __name__ == "__main__":
    main()
