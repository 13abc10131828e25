"""Peak memory of a training step: optimizer after backward vs inside it (optimizer_in_backward).

    python benchmarks/memory.py

The benchmark Llama (benchmarks/workload.py), 2 gloo ranks, FULL_SHARD, compiled with eager kernels; peak bytes allocated above the step's
starting point (profiler memory events, so it works on CPU), median of 3 measured steps after 2 warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

import fsdp_graph
from fsdp_graph.planning.measure import peak_allocated_bytes
from fsdp_graph.train.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import BENCH_CONFIG, batches, bench_model, llama_loss  # noqa: E402


def measure(rank: int, world: int, in_backward: bool, compiled_step: bool, batch: int, seq: int, layers: int) -> float:
    torch.manual_seed(0)
    model = bench_model(dataclasses.replace(BENCH_CONFIG, layers=layers, seq=max(seq, BENCH_CONFIG.seq)))
    fsdp_graph.fully_shard(model)
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
    return statistics.median(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=BENCH_CONFIG.seq)
    parser.add_argument("--layers", type=int, default=BENCH_CONFIG.layers)
    args = parser.parse_args()
    n_params = dataclasses.replace(BENCH_CONFIG, layers=args.layers).num_params()
    print(
        f"benchmark Llama ({n_params / 1e6:.2f} M params), 2 ranks, FULL_SHARD, batch {args.batch}x{args.seq} per rank: "
        "peak allocated per step (rank 0)"
    )
    for compiled_step in (True, False):
        after = spawn(measure, 2, (False, compiled_step, args.batch, args.seq, args.layers))[0]
        inside = spawn(measure, 2, (True, compiled_step, args.batch, args.seq, args.layers))[0]
        label = "compiled (one graph)" if compiled_step else "eager"
        saved = after - inside
        print(
            f"  {label}: optimizer after backward {after / 2**20:.2f} MiB, optimizer_in_backward "
            f"{inside / 2**20:.2f} MiB (saves {saved / 2**20:.2f} MiB, {100 * saved / after:.1f}%)"
        )


if __name__ == "__main__":
    main()
