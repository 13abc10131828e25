"""Collectives per training step with and without `make_backend(bucket_bytes=...)`, counted from what executes.

    python benchmarks/bucketing.py

The benchmark Llama (benchmarks/workload.py; 5 units: 4 blocks of 2.8 MiB of fp32 parameters and
the root, 0.25 MiB), 2 gloo ranks, eager kernels. Bucketing only re-lays out the data, so the bytes stay the same and the count drops.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from fsdp_graph.train.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import batches, bench_model, llama_loss  # noqa: E402

MIB = 2**20
BF16 = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def measure(rank: int, world: int, strategy: str, mp: bool, bucket_bytes: int) -> dict:
    torch.manual_seed(0)
    model = bench_model()
    fsdp_graph.fully_shard(model, strategy=fsdp_graph.ShardingStrategy[strategy], mixed_precision=BF16 if mp else None)
    backend = fsdp_graph.make_backend(inductor=False, bucket_bytes=bucket_bytes)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    batch = next(batches(4, rank, world, seed=0))
    llama_loss(compiled, batch).backward()
    executed = executed_collectives(lambda: llama_loss(compiled, batch).backward())
    return {
        "counts": dict(executed.counts),
        "payload": sum(executed.payload_bytes.values()),
        "sent": executed.total_wire_bytes,
        "graphs": [(r.stage, r.collectives.units) for r in backend.reports],
    }


def main() -> None:
    rows = [
        ("FULL_SHARD", False, 0),
        ("FULL_SHARD", False, 8 * MIB),
        ("FULL_SHARD", False, 64 * MIB),
        ("SHARD_GRAD_OP", False, 0),
        ("SHARD_GRAD_OP", False, 64 * MIB),
        ("FULL_SHARD", True, 0),
        ("FULL_SHARD", True, 8 * MIB),
    ]
    print("| strategy | bucket_bytes | collectives per step | payload MiB | MiB sent per rank |")
    print("|---|---|---|---|---|")
    buckets = []
    for strategy, mp, cap in rows:
        r = spawn(measure, 2, (strategy, mp, cap))[0]
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items()))
        name = f"{strategy}{' + bf16 params' if mp else ''} | {cap // MIB} MiB"
        print(f"| {name} | {counts} | {r['payload'] / MIB:.3f} | {r['sent'] / MIB:.3f} |")
        for stage, units in r["graphs"]:
            listed = " ".join(f"{kind}[{unit.replace('+', ' ') if unit else '<root>'}]" for kind, unit in units)
            buckets.append(f"{name.replace(' | ', ', ')}, {stage}: {listed}")
    print("\nCollectives of each graph in order (units; the root is the empty name):")
    print("\n".join(buckets))


if __name__ == "__main__":
    main()
