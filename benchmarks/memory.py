"""Peak memory of a training step: optimizer after backward vs inside it (optimizer_in_backward).

    python benchmarks/memory.py

Demo GPT, 2 gloo ranks, FULL_SHARD, compiled with eager kernels; peak bytes allocated above the step's
starting point (profiler memory events, so it works on CPU), median of 3 measured steps after 2 warm-up.
"""

from __future__ import annotations

import statistics

import torch

import fsdp_graph
from fsdp_graph.demo import DEMO_CONFIG, batches, corpus
from fsdp_graph.launch import spawn
from fsdp_graph.measure import peak_allocated_bytes
from fsdp_graph.models import GPT, gpt_loss


def measure(rank: int, world: int, in_backward: bool) -> float:
    torch.manual_seed(0)
    model = GPT(DEMO_CONFIG)
    fsdp_graph.fully_shard(model)
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    if in_backward:
        fsdp_graph.optimizer_in_backward(model, torch.optim.AdamW, lr=3e-3)
        optimizer = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(corpus(), 8, DEMO_CONFIG.seq, rank, world, seed=1)

    def step():
        gpt_loss(compiled, next(data)).backward()
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
    after = spawn(measure, 2, (False,))[0]
    inside = spawn(measure, 2, (True,))[0]
    n_params = sum(p.numel() for p in GPT(DEMO_CONFIG).parameters())
    print(f"demo GPT ({n_params / 1e6:.2f} M params), 2 ranks, FULL_SHARD: peak allocated per step (rank 0)")
    print(f"  optimizer after backward: {after / 2**20:.2f} MiB")
    print(
        f"  optimizer_in_backward:    {inside / 2**20:.2f} MiB  (saves {(after - inside) / 2**20:.2f} MiB, "
        f"{100 * (after - inside) / after:.1f}%)"
    )


if __name__ == "__main__":
    main()
