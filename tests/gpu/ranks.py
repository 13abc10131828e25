"""Rank-side code of the multi-GPU tests: each rank is a process on its own GPU (NCCL)."""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fsdp_graph
from benchmarks.gpu_report import kernel_intervals, length, overlap_fraction
from fsdp_graph.train.gpt import GPT, GPTConfig, gpt_loss
from tests.workers.collective_order import fx_sequence, prefetched

# Big enough that a unit's gather (about 3 M parameters) and its matmuls take tens of microseconds each.
OVERLAP_CONFIG = GPTConfig(vocab=512, dim=512, heads=8, layers=4, seq=256, tied=True)


def gather_overlap(rank: int, world: int, port: int, out_path: str) -> None:
    """Train the GPT above (FULL_SHARD, Inductor) for 3 steps, profile the 4th with CUDA activity, and write
    rank 0's NCCL all-gather time, and the share of it that compute kernels overlap, to `out_path`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    # A cache hit would skip our passes, and with them the graphs kept for the prefetch check.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    try:
        torch.manual_seed(0)
        model = GPT(OVERLAP_CONFIG).to(device)
        fsdp_graph.fully_shard(model)
        backend = fsdp_graph.make_backend(keep_graphs=True)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)

        def step() -> None:
            idx = torch.randint(0, OVERLAP_CONFIG.vocab, (8, OVERLAP_CONFIG.seq), generator=gen).to(device)
            gpt_loss(compiled, (idx, idx)).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    fd, trace_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(trace_path)
    gathers, _ = kernel_intervals([e for e in events if "allgather" in e.get("name", "").lower()])
    _, compute = kernel_intervals(events)
    result = {
        "gather_us": length(gathers),
        "overlap": overlap_fraction(gathers, compute),
        "gathers": len(gathers),
        "prefetched": any(prefetched(fx_sequence(r.graph)) for r in backend.reports if r.stage == "fw"),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
