"""Median step time and bytes per step on the demo GPT, 2 gloo ranks, every peer measured in ONE run.

    python benchmarks/step_time.py [--steps 15] [--warmup 3] [--world 2] [--batch 8]

Peers: fsdp_graph (Inductor, FULL_SHARD) with its default scheduling (prefetch, sunk reduce waits, gradient
reduction as all-to-all on gloo) and without it (`prefetch=False, reduce_scatter="native"`), torch FSDP2 eager
(fully_shard per block), FSDP2 with each block torch.compile'd, and DDP. Prints ratios against FSDP2 eager, the
cold compile time, and the bytes gloo itself sent per step per rank (its profiler events, ring-algorithm bytes)
against the ZeRO-3 minimum 3(N-1)/N * params * 4 bytes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.demo import DEMO_CONFIG, batches, corpus
from fsdp_graph.launch import spawn
from fsdp_graph.models import GPT, gpt_loss


def _time_steps(step_model, params, data, steps: int, warmup: int) -> tuple[float, float, float]:
    """(first step, median step, bytes gloo sent in one more step)."""
    from fsdp_graph.measure import executed_collectives

    opt = torch.optim.AdamW(params, lr=3e-3)
    times = []
    for _ in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        gpt_loss(step_model, next(data)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    seen = executed_collectives(lambda: gpt_loss(step_model, next(data)).backward())
    opt.zero_grad()
    return times[0], statistics.median(times[warmup:]), sum(seen.backend_wire_bytes.values())


def _ours(model, args, scheduled: bool = True):
    fsdp_graph.fully_shard(model)
    options = {} if scheduled else {"prefetch": False, "reduce_scatter": "native"}
    backend = fsdp_graph.make_backend(**options)
    return torch.compile(model, backend=backend, fullgraph=True), model.parameters(), backend


def _fsdp2(model, args, compile_blocks: bool):
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        if compile_blocks:
            block.compile()
        fully_shard(block)
        model.blocks[i] = block
    fully_shard(model)
    return model, model.parameters(), None


def _ddp(model, args):
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, ddp.parameters(), None


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    base = GPT(DEMO_CONFIG)
    tokens = corpus()
    peers = {
        "fsdp_graph (Inductor)": lambda m: _ours(m, args),
        "fsdp_graph, no scheduling": lambda m: _ours(m, args, scheduled=False),
        "FSDP2 eager": lambda m: _fsdp2(m, args, compile_blocks=False),
        "FSDP2 + per-block compile": lambda m: _fsdp2(m, args, compile_blocks=True),
        "DDP": lambda m: _ddp(m, args),
    }
    results = {}
    for name, setup in peers.items():
        torch._dynamo.reset()
        step_model, params, backend = setup(copy.deepcopy(base))
        data = batches(tokens, args.batch, DEMO_CONFIG.seq, rank, world, seed=1)
        first, median, wire = _time_steps(step_model, list(params), data, args.steps, args.warmup)
        results[name] = {"first": first, "median": median, "bytes": wire}
    n_params = sum(p.numel() for p in base.parameters())
    results["zero3_min_bytes"] = 3 * (world - 1) / world * n_params * 4
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    results = spawn(run, args.world, (args,))[0]
    zero_min = results.pop("zero3_min_bytes")
    baseline = results["FSDP2 eager"]["median"]
    print(
        f"\ndemo GPT, {args.world} gloo ranks, batch {args.batch}x{DEMO_CONFIG.seq} per rank, "
        f"median of {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}"
    )
    print(f"{'peer':28s} {'median step':>12s} {'vs FSDP2 eager':>15s} {'first step':>11s} {'MiB sent':>9s}")
    for name, r in results.items():
        print(
            f"{name:28s} {r['median']:11.3f}s {r['median'] / baseline:14.2f}x {r['first']:10.1f}s "
            f"{r['bytes'] / 2**20:9.2f}"
        )
    ours = results["fsdp_graph (Inductor)"]
    print(f"fsdp_graph cold compile (first step - median): {ours['first'] - ours['median']:.1f}s")
    print(
        f"MiB sent per step per rank (gloo's own events); ZeRO-3 minimum {zero_min / 2**20:.2f} MiB; "
        f"fsdp_graph ratio {ours['bytes'] / zero_min:.4f}"
    )


if __name__ == "__main__":
    main()
