"""Rank-side code of tests/numerics/test_simple_fsdp_peer.py: the suite's SimpleFSDP peer (torchtitan's
`data_parallel`, as `benchmarks/suite.py` sets it up) trained for a few AdamW steps."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.suite import _simple_fsdp
from benchmarks.workload import BENCH_CONFIG, batches, bench_model, llama_loss
from fsdp_graph.train.llama import LlamaConfig

SMALL = LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, hidden=160, seq=32, tied=True)


def single_process_losses(steps: int, batch: int) -> list[float]:
    torch.manual_seed(0)
    model = bench_model(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(batch, 0, 1, seed=1, seq=SMALL.seq)
    losses = []
    for _ in range(steps):
        loss = llama_loss(model, next(data))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def simple_fsdp_losses(rank: int, world: int, steps: int, batch: int, compile: bool) -> dict:
    assert BENCH_CONFIG.tied == SMALL.tied
    torch.manual_seed(0)
    model, params, divisor = _simple_fsdp(bench_model(SMALL), compile=compile)
    inner = getattr(model, "_orig_mod", model)
    params = list(params)
    opt = torch.optim.AdamW(params, lr=3e-3)
    data = batches(batch, rank, world, seed=1, seq=SMALL.seq)
    losses = []
    for _ in range(steps):
        loss = llama_loss(model, next(data))
        (loss / divisor).backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    return {
        "losses": losses,
        "tied": inner.output._parameters["weight"] is inner.tok_embeddings._parameters["weight"],
        "n_params": len(params),
        "dtensors": all(type(p).__name__ == "DTensor" for p in params),
    }
