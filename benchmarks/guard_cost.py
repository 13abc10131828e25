"""What the non-finite guard costs per step (issue 34): `StepGuard.check` against the loss all-reduce the main job
made per step before it (the guard's all-reduce replaces it), on 2 gloo ranks with a sharded Llama's gradients.

    python benchmarks/guard_cost.py [--preset tiny|small] [--iters 200]

Three ways per step, alternated so machine noise hits each alike: the old loss all-reduce and `.item()`; the guard
given the clip norm (clipping on: no pass over the gradients); the guard measuring the local gradients itself
(clipping off: one `_foreach_norm` over this rank's gradient pieces). Prints the median microseconds of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fsdp_graph  # noqa: E402
from fsdp_graph.train.corpus import batch_at, load_tokens  # noqa: E402
from fsdp_graph.train.launch import spawn  # noqa: E402
from fsdp_graph.train.llama import Llama, llama_loss, preset  # noqa: E402


def _rank(rank: int, world: int, name: str, iters: int) -> dict:
    torch.manual_seed(0)
    model = Llama(preset(name))
    fsdp_graph.fully_shard(model)
    batch = batch_at(load_tokens(), 0, 0, 2, 64, rank, world)
    loss = llama_loss(model, batch)
    loss.backward()
    norm = fsdp_graph.clip_grad_norm_(model, float("inf"))
    guard = fsdp_graph.StepGuard(model)

    def old() -> None:
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        reduced.item()

    ways = {
        "loss all-reduce (before)": old,
        "guard, clip norm given": lambda: guard.check(0, loss, grad_norm=norm),
        "guard, local gradient norms": lambda: guard.check(0, loss),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(iters):
        for key, fn in ways.items():
            dist.barrier()
            began = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - began)
    grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    return {"local gradient elements": grads, **{k: statistics.median(v) * 1e6 for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    result = spawn(_rank, 2, (args.preset, args.iters))[0]
    print(f"preset {args.preset}, 2 gloo ranks, rank 0's median of {args.iters}:")
    for key, value in result.items():
        print(f"  {key}: {value:,.0f}" + (" us" if key != "local gradient elements" else ""))


if __name__ == "__main__":
    main()
