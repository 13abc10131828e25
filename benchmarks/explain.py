"""explain()'s cost model against measurements, and a plan for a 12-layer Llama (GPT-2-small-sized) on 8 GPUs.

    python benchmarks/explain.py memory            # predicted vs measured peak memory, 2 gloo ranks
    python benchmarks/explain.py plan [--png PATH]  # 12 layers, 8 ranks, NVLink: exposed communication
    python benchmarks/explain.py                    # both

memory: each model and its loss compiled as one graph with make_backend(inductor=False); measured = peak bytes
allocated above the step's start (profiler memory events, least of 5 steps after a compiling one), predicted =
explain(..., inductor=False).memory.peak_bytes; rank 0 shown (rank 1 is the same within gloo's buffers).
plan: Llama(vocab 50304, dim 768, 12 heads, 4 key/value heads, SwiGLU 2048, 12 layers, seq 1024, tied; fp32) built
on the meta device, so no
kernel runs and nothing is allocated; fake process group of 8 ranks; batch 8 x 1024 tokens per rank; FULL_SHARD.
Writes nothing but stdout (and the PNG when asked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test models live in tests/

import fsdp_graph  # noqa: E402
from fsdp_graph.train.launch import spawn  # noqa: E402
from fsdp_graph.train.llama import Llama, LlamaConfig  # noqa: E402

MIB = 2**20
MEMORY_CASES = [  # (model, per-rank batch, what it is)
    ("gpt", 8, "test GPT (2 layers, dim 32)"),
    ("llama", 8, "main job's tiny Llama (4 layers, dim 128, seq 128)"),
    ("hf", 64, "HF-style net (loss inside)"),
    ("mlp", 512, "MLP + F.mse_loss"),
    ("bn", 64, "BatchNorm net"),
    ("conv", 16, "conv net"),
]
PLAN_CONFIG = LlamaConfig(vocab=50304, dim=768, layers=12, heads=12, kv_heads=4, hidden=2048, seq=1024)


def memory() -> None:
    from tests.workers.explaining import predicted_vs_measured

    print("peak memory of one forward + backward above its start, rank 0 of 2 (eager kernels):")
    print(f"  {'model':46s} {'predicted KiB':>14s} {'measured KiB':>13s} {'error':>7s}")
    for name, batch, what in MEMORY_CASES:
        r = spawn(predicted_vs_measured, 2, (name, batch))[0]
        label = f"{what}, batch {batch}"
        print(f"  {label:46s} {r['predicted'] / 1024:14.1f} {r['measured'] / 1024:13.1f} {100 * r['error']:+6.1f}%")


def plan(png: str | None, world: int, hardware: str, batch: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = Llama(PLAN_CONFIG)
        fsdp_graph.fully_shard(model, device="meta")
        idx = torch.empty(batch, PLAN_CONFIG.seq, dtype=torch.long, device="meta")

        def lm_loss(logits):  # cross-entropy (F.cross_entropy has no autograd kernel on meta in torch 2.13)
            return -logits.log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

        reports = {
            p: fsdp_graph.explain(model, idx, loss_fn=lm_loss, hardware=hardware, prefetch=p) for p in (True, False)
        }
    finally:
        dist.destroy_process_group()
    params = sum(r.params for r in reports[True].units)
    print(
        f"\nplan: {PLAN_CONFIG.layers}-layer Llama ({params / 1e6:.1f} M params, dim {PLAN_CONFIG.dim}), {world} ranks, "
        f"batch {batch} x {PLAN_CONFIG.seq} tokens per rank, hardware {hardware}, FULL_SHARD fp32:"
    )
    for prefetch, report in reports.items():
        print(
            f"  prefetch={prefetch!s:5s}: step {report.step_time * 1e3:.2f} ms, communication "
            f"{report.comm_time * 1e3:.2f} ms, exposed {report.exposed_comm * 1e3:.2f} ms "
            f"({100 * report.exposed_fraction:.1f}% of the step), peak memory {report.peak_memory_bytes / MIB:.0f} MiB"
        )
    other = reports[True].with_hardware("infiniband")
    print(
        f"  (the same plan on infiniband: step {other.step_time * 1e3:.2f} ms, exposed "
        f"{100 * other.exposed_fraction:.1f}%)"
    )
    print()
    print(reports[True].to_text())
    if png:
        reports[True].save(png)
        print(f"timeline: {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=("memory", "plan", "all"), default="all")
    parser.add_argument("--png", help="save the plan's timeline here")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--hardware", default="nvlink")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per rank (plan)")
    args = parser.parse_args()
    if args.mode in ("memory", "all"):
        memory()
    if args.mode in ("plan", "all"):
        plan(args.png, args.world, args.hardware, args.batch)


if __name__ == "__main__":
    main()
