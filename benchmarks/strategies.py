"""Collectives and bytes per training step for every strategy, counted from what executes (profiler), against
the ZeRO minimum; and the peak memory of initialisation, full vs meta-device construction.

    python benchmarks/strategies.py

The benchmark Llama (benchmarks/workload.py, 3.0 M params); 2 gloo ranks, HYBRID_SHARD on 4 (2x2). Bytes are what each rank sends with ring
algorithms: (N-1)/N of each gather/scatter payload, 2(N-1)/N of each all-reduce.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives, peak_allocated_bytes
from fsdp_graph.train.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import BENCH_CONFIG, batches, bench_model, llama_loss  # noqa: E402

BF16 = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def zero_minimum(strategy: str, psi: int, shard: int, replicate: int, param_bytes: int, reduce_bytes: int) -> float:
    gathers = {"FULL_SHARD": 2, "HYBRID_SHARD": 2, "SHARD_GRAD_OP": 1, "_HYBRID_SHARD_ZERO2": 1, "NO_SHARD": 0}
    n = shard
    sent = gathers[strategy] * (n - 1) / n * psi * param_bytes
    if strategy == "NO_SHARD":
        return sent + 2 * (replicate - 1) / replicate * psi * reduce_bytes
    sent += (n - 1) / n * psi * reduce_bytes
    return sent + 2 * (replicate - 1) / replicate * psi / n * reduce_bytes


def measure(rank: int, world: int, strategy: str, mp: bool) -> dict:
    mesh = None
    if fsdp_graph.ShardingStrategy[strategy].is_hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2))
    torch.manual_seed(0)
    model = bench_model()
    fsdp_graph.fully_shard(
        model, mesh, strategy=fsdp_graph.ShardingStrategy[strategy], mixed_precision=BF16 if mp else None
    )
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    batch = next(batches(4, rank, world, seed=0))
    llama_loss(compiled, batch).backward()
    state = fsdp_graph.runtime.unit.flat_params(model)[0]
    # Every group in these runs has the shard group's size (or the replicas', for NO_SHARD): gloo's own events
    # carry no group, so their ring bytes are computed for that size.
    group = state.world if state.world > 1 else state.replicate_world
    executed = executed_collectives(
        lambda: llama_loss(compiled, batch).backward(), state.replicate_world, group_size=group
    )
    psi = BENCH_CONFIG.num_params()
    minimum = zero_minimum(strategy, psi, state.world, state.replicate_world, 2 if mp else 4, 4)
    return {
        "counts": dict(executed.counts),
        "sent": sum(executed.backend_wire_bytes.values()),  # what gloo itself ran (its own profiler events)
        "minimum": minimum,
    }


def init_peak(rank: int, world: int, meta: bool) -> dict:
    def build():
        if meta:
            with torch.device("meta"):
                model = bench_model()
        else:
            torch.manual_seed(0)
            model = bench_model()
        return fsdp_graph.fully_shard(model)

    peak, model = peak_allocated_bytes(build)
    dist.barrier()
    return {"peak": peak, "full": BENCH_CONFIG.num_params() * 4}


def main() -> None:
    rows = [
        ("FULL_SHARD", 2, False),
        ("SHARD_GRAD_OP", 2, False),
        ("NO_SHARD", 2, False),
        ("FULL_SHARD", 2, True),
        ("HYBRID_SHARD", 4, False),
        ("_HYBRID_SHARD_ZERO2", 4, False),
    ]
    print("| strategy | ranks | collectives per step | MiB gloo sent per rank | ZeRO minimum MiB | ratio |")
    print("|---|---|---|---|---|---|")
    for strategy, world, mp in rows:
        r = spawn(measure, world, (strategy, mp))[0]
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items())) or "none"
        name = strategy + (" + bf16 params" if mp else "")
        topology = "2x2" if world == 4 else str(world)
        print(
            f"| {name} | {topology} | {counts} | {r['sent'] / 2**20:.3f} | {r['minimum'] / 2**20:.3f} | "
            f"{r['sent'] / r['minimum']:.4f} |"
        )
    print("\n| construction | peak allocated during init (rank 0) | full model | ratio |")
    print("|---|---|---|---|")
    for meta in (False, True):
        r = spawn(init_peak, 2, (meta,))[0]
        label = "meta device + fully_shard" if meta else "cpu + fully_shard"
        print(f"| {label} | {r['peak'] / 2**20:.2f} MiB | {r['full'] / 2**20:.2f} MiB | {r['peak'] / r['full']:.2f} |")


if __name__ == "__main__":
    main()
