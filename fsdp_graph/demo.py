"""The main job for now: train a small GPT with fully_shard + fsdp_backend on local gloo ranks.

    python -m fsdp_graph.demo [--steps 20] [--strategy FULL_SHARD] [--mode inductor|aot|eager] [--world 2]

Outside torchrun it starts `--world` CPU ranks itself; under torchrun it uses the launcher's environment.
Trains on the bytes of fsdp_graph's own source (byte-level tokens: real text, shipped, nothing downloaded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.launch import spawn
from fsdp_graph.models import GPT, GPTConfig, gpt_loss

DEMO_CONFIG = GPTConfig(vocab=256, dim=256, heads=8, layers=4, seq=128, tied=True)


def corpus() -> torch.Tensor:
    package = Path(fsdp_graph.__file__).parent
    text = b"".join(p.read_bytes() for p in sorted(package.glob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch: int, seq: int, rank: int, world: int, seed: int):
    """Random windows of the corpus; every rank draws the same global batch and takes its slice."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch * world,), generator=gen)
        window = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
        local = window.chunk(world)[rank]
        yield local[:, :-1], local[:, 1:]


def collectives_per_step(backend: fsdp_graph.FSDPBackend) -> str:
    train = [r for r in backend.reports if r.stage in ("fw", "bw")]
    counts = {}
    total_bytes = 0
    for report in train:
        for kind, n in report.collectives.counts.items():
            counts[kind] = counts.get(kind, 0) + n
        total_bytes += sum(report.collectives.bytes.values())
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" ({total_bytes / 2**20:.1f} MiB unsharded)"


def train(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = GPT(DEMO_CONFIG)
    fsdp_graph.fully_shard(model, strategy=fsdp_graph.ShardingStrategy[args.strategy])
    backend = None
    step_model = model
    if args.mode != "eager":
        backend = fsdp_graph.make_backend(inductor=args.mode == "inductor", dump_dir=args.dump_dir)
        step_model = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(corpus(), args.batch, DEMO_CONFIG.seq, rank, world, seed=1)
    times, log = [], rank == 0
    if log:
        n_params = sum(p.numel() for p in GPT(DEMO_CONFIG).parameters())
        print(f"demo GPT: {n_params / 1e6:.2f} M params, {world} ranks, {args.strategy}, mode={args.mode}", flush=True)
    for step in range(args.steps):
        start = time.perf_counter()
        loss = gpt_loss(step_model, next(data))
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        value = loss.detach().clone()
        dist.all_reduce(value)
        if log:
            comm = collectives_per_step(backend) if backend else "eager: one all_gather per unit in forward"
            label = "compile+step" if step == 0 and backend else "step"
            print(
                f"step {step:3d}  loss {value.item() / world:.4f}  {label} {elapsed:.3f}s  collectives: {comm}",
                flush=True,
            )
    summary = {"first_step_s": times[0], "median_step_s": statistics.median(times[1:] or times)}
    if log:
        print(f"median step {summary['median_step_s']:.3f}s (first step, incl. compile: {times[0]:.1f}s)")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fsdp_graph.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--world", type=int, default=2, help="ranks to start when not under torchrun")
    parser.add_argument("--strategy", choices=[s.name for s in fsdp_graph.ShardingStrategy], default="FULL_SHARD")
    parser.add_argument("--mode", choices=["inductor", "aot", "eager"], default="inductor")
    parser.add_argument("--dump-dir", default=None, help="write each compile stage's graph here")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        spawn(train, args.world, (args,))


if __name__ == "__main__":
    main()
