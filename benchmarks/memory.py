"""Peak memory of a training step: optimizer after backward vs inside it (optimizer_in_backward), or, with
`--layouts`, `fully_shard(layout="flat")` vs `layout="rows"` (step time too).

    python benchmarks/memory.py
    python benchmarks/memory.py --layouts

The benchmark Llama (benchmarks/workload.py), 2 gloo ranks, FULL_SHARD, compiled with eager kernels (and eager);
peak bytes allocated above the step's starting point (profiler memory events, so it works on CPU), median of 3
measured steps after 2 warm-up; step time: median of `--steps` steps after those, timed without the profiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

import fsdp_graph
from fsdp_graph.planning.measure import peak_allocated_bytes
from fsdp_graph.runtime.unit import flat_params
from fsdp_graph.train.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import BENCH_CONFIG, batches, bench_model, llama_loss  # noqa: E402


def measure(
    rank: int,
    world: int,
    in_backward: bool,
    compiled_step: bool,
    batch: int,
    seq: int,
    layers: int,
    layout: str = "flat",
    timed_steps: int = 0,
) -> dict:
    torch.manual_seed(0)
    model = bench_model(dataclasses.replace(BENCH_CONFIG, layers=layers, seq=max(seq, BENCH_CONFIG.seq)))
    fsdp_graph.fully_shard(model, layout=layout)
    compiled = model
    if compiled_step:
        compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    if in_backward:
        fsdp_graph.optimizer_in_backward(model, torch.optim.AdamW, lr=3e-3)
        optimizer = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(batch, rank, world, seed=1, seq=seq)

    def step():
        llama_loss(compiled, next(data)).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()

    peaks = []
    for i in range(5):
        peak, _ = peak_allocated_bytes(step)
        if i >= 2:
            peaks.append(peak)
    times = []
    for _ in range(timed_steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    # A unit holding one parameter reads it as a view; otherwise each parameter is copied out of the gathered flat.
    copies = {
        s.name or "<root>": s.layout.numel * s.flat_shard.element_size() if len(s.layout.slots) > 1 else 0
        for s in flat_params(model)
    }
    steps = statistics.median(times) if times else float("nan")
    return {"peak": statistics.median(peaks), "step": steps, "copy_bytes": copies if layout == "rows" else {}}


def compare_layouts(args: argparse.Namespace) -> None:
    """flat vs rows, same step otherwise: the rows layout's cost is the copy-out of each parameter after a gather
    (forward, and the backward's re-gather) and the copy-in of its gradient before the reduce-scatter."""
    for compiled_step in (True, False):
        results = {}
        for layout in ("flat", "rows"):
            shape = (args.batch, args.seq, args.layers, layout, args.steps)
            results[layout] = spawn(measure, 2, (False, compiled_step, *shape))[0]
        flat, rows = results["flat"], results["rows"]
        label = "compiled (one graph)" if compiled_step else "eager"
        print(
            f"  {label}: step flat {flat['step']:.3f} s, rows {rows['step']:.3f} s ({rows['step'] / flat['step']:.2f}x); "
            f"peak flat {flat['peak'] / 2**20:.2f} MiB, rows {rows['peak'] / 2**20:.2f} MiB "
            f"({rows['peak'] / flat['peak']:.3f}x)"
        )
    units = ", ".join(f"{name} {n / 2**20:.2f} MiB" for name, n in results["rows"]["copy_bytes"].items())
    print(
        f"  rows copy-out per unit per gather (FULL_SHARD: twice a step, forward and backward; the gradient's copy-in "
        f"once, the same size): {units}"
    )
    out, into, numel = copy_seconds(args.layers)
    print(
        f"  one block unit ({numel * 4 / 2**20:.2f} MiB, 1 thread, no communication): copy-out {out * 1e3:.2f} ms, "
        f"copy-in {into * 1e3:.2f} ms; per FULL_SHARD step, all blocks: {args.layers * (2 * out + into) * 1e3:.1f} ms"
    )


def copy_seconds(layers: int) -> tuple[float, float, int]:
    """The rows layout's copies alone, for one block of the benchmark Llama at world 2: every parameter out of a
    gathered flat, and every gradient into the flat gradient (what `passes/flat_grad.py` leaves: one cat)."""
    from torch.utils import benchmark

    from fsdp_graph.runtime.flat_param import RowShardLayout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    block = bench_model(dataclasses.replace(BENCH_CONFIG, layers=1)).blocks[0]
    layout = RowShardLayout.build([((n,), p.shape) for n, p in block.named_parameters()], world=2, rank=0)
    flat = torch.randn(layout.padded_numel)
    grads = [torch.randn(s.shape) for s in layout.slots]

    def copy_out():
        return [layout.param_of(flat, s) for s in layout.slots]

    def copy_in():
        return torch.cat([g.reshape(2, -1) for g in grads], dim=1).view(-1)

    times = [
        benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=1.0).median
        for fn in (copy_out, copy_in)
    ]
    torch.set_num_threads(threads)
    return times[0], times[1], layout.numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=BENCH_CONFIG.seq)
    parser.add_argument("--layers", type=int, default=BENCH_CONFIG.layers)
    parser.add_argument("--layouts", action="store_true", help="compare layout='flat' with layout='rows'")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run (--layouts)")
    args = parser.parse_args()
    n_params = dataclasses.replace(BENCH_CONFIG, layers=args.layers).num_params()
    print(
        f"benchmark Llama ({n_params / 1e6:.2f} M params), 2 ranks, FULL_SHARD, batch {args.batch}x{args.seq} per rank: "
        "peak allocated per step (rank 0)"
    )
    if args.layouts:
        compare_layouts(args)
        return
    for compiled_step in (True, False):
        after = spawn(measure, 2, (False, compiled_step, args.batch, args.seq, args.layers))[0]["peak"]
        inside = spawn(measure, 2, (True, compiled_step, args.batch, args.seq, args.layers))[0]["peak"]
        label = "compiled (one graph)" if compiled_step else "eager"
        saved = after - inside
        print(
            f"  {label}: optimizer after backward {after / 2**20:.2f} MiB, optimizer_in_backward "
            f"{inside / 2**20:.2f} MiB (saves {saved / 2**20:.2f} MiB, {100 * saved / after:.1f}%)"
        )


if __name__ == "__main__":
    main()
