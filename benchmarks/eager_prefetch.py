"""The eager path's forward prefetch (issue 27 item 5) against gathering each unit when it is read.

    python benchmarks/eager_prefetch.py [--steps 12] [--batch 4] [--world 2]

The benchmark Llama (benchmarks/workload.py), FULL_SHARD over `world` gloo ranks on this machine, trained eagerly
(no torch.compile), SGD with momentum. One model; the steps alternate (A B A B ..., each after a barrier, so a drift
of the machine's speed hits both alike) between:
- "prefetched": `runtime/eager_prefetch.py` as it is: unit k+1's gather issued before unit k's is waited for;
- "gathered when read": its `prefetchable` answering False, so every gather is the op's, waited at once (the eager
  path before issue 27 item 5).
The modes are checked before timing: a prefetched forward has two functional gathers in flight at once, the other
at most one (its gathers run inside the `fsdp.unshard` op, out of a dispatch mode's sight). Printed: each mode's median step time and forward time (the mean over ranks of each
rank's median) and the ratios prefetched / gathered when read, from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from fsdp_graph.runtime.eager_prefetch import ForwardPrefetch
from fsdp_graph.train.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import batches, bench_model, llama_loss  # noqa: E402

PREFETCHED, WHEN_READ = "prefetched", "gathered when read"


@contextlib.contextmanager
def _mode(name: str):
    """Eager forwards inside this context prefetch (PREFETCHED) or not (WHEN_READ)."""
    prefetchable = ForwardPrefetch.prefetchable
    if name == WHEN_READ:
        ForwardPrefetch.prefetchable = lambda self, state: False
    try:
        yield
    finally:
        ForwardPrefetch.prefetchable = prefetchable


class _GathersInFlight(TorchDispatchMode):
    """The most all-gathers issued and not yet waited for at one time."""

    def __init__(self) -> None:
        super().__init__()
        self.open: set[int] = set()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.open.add(id(out))
            self.most = max(self.most, len(self.open))
        elif func is torch.ops._c10d_functional.wait_tensor.default:
            self.open.discard(id(args[0]))
        return out


def measure(rank: int, world: int, steps: int, batch: int) -> dict:
    data = next(batches(batch, rank, world, seed=0))
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(bench_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        loss = llama_loss(model, data)
        forward = time.perf_counter() - start
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start, forward

    step()  # records the forward's gather order
    in_flight = {}
    for name in (PREFETCHED, WHEN_READ):
        with _mode(name), _GathersInFlight() as watch:
            llama_loss(model, data)
        in_flight[name] = watch.most
    if in_flight[PREFETCHED] < 2 or in_flight[WHEN_READ] > 1:
        raise RuntimeError(f"the two modes are not the ones compared (gathers in flight at once): {in_flight}")
    times: dict[str, list[tuple[float, float]]] = {PREFETCHED: [], WHEN_READ: []}
    for _ in range(steps):
        for name in (PREFETCHED, WHEN_READ):
            with _mode(name):
                times[name].append(step())
    return {
        name: {"step": statistics.median(t[0] for t in ts), "forward": statistics.median(t[1] for t in ts)}
        for name, ts in times.items()
    } | {"in_flight": in_flight}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (after one untimed)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    args = parser.parse_args()
    results = spawn(measure, args.world, (args.steps, args.batch), timeout_s=900)
    print(f"FULL_SHARD eager, {args.world} gloo ranks, batch {args.batch}/rank, {args.steps} steps per mode")
    print(f"most gathers in flight at once (rank 0): {results[0]['in_flight']}")
    mean = {
        name: {part: statistics.mean(r[name][part] for r in results) for part in ("step", "forward")}
        for name in (PREFETCHED, WHEN_READ)
    }
    for name in (WHEN_READ, PREFETCHED):
        print(
            f"{name:>18}: median step {mean[name]['step'] * 1e3:.1f} ms, forward {mean[name]['forward'] * 1e3:.1f} ms"
        )
    for part in ("step", "forward"):
        print(f"ratio prefetched / gathered when read, {part}: {mean[PREFETCHED][part] / mean[WHEN_READ][part]:.3f}")


if __name__ == "__main__":
    main()
