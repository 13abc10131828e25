"""The benchmark suite: every peer on the same model, batch and world size, measured in ONE run.

    python benchmarks/suite.py [--steps 15] [--warmup 3] [--world 2] [--batch 8] [--out docs/benchmarks.md]

Peers (the benchmark Llama of benchmarks/workload.py, gloo ranks on this machine):
- fsdp_graph: `fully_shard` + `torch.compile(backend=fsdp_backend)` (Inductor), FULL_SHARD, default scheduling;
- fsdp_graph without scheduling (`prefetch=False, reduce_scatter="native"`): what the schedule passes buy;
- fsdp_graph with `activation_memory_budget=0.5`: the partitioner recomputes activations to cut the peak;
- torch FSDP2 eager (`fully_shard` per block, then the root), and FSDP2 with each block `torch.compile`d;
- DDP (eager);
- single process: each rank trains its own unsharded copy with plain `torch.compile` (no communication).

Per peer: median step time (after warm-up), cold compile (first step minus median, with an empty Inductor cache
of its own), warm compile (the same again in a fresh Dynamo state over the now warm cache), peak memory allocated
during a step per rank (profiler memory events, above the step's starting point, so the persistent parameter,
gradient and optimizer shards are not in it), and the bytes gloo itself sent in a step (its profiler events,
ring-algorithm bytes per rank) against the ZeRO-3 minimum 3(N-1)/N * params * 4.
Then the wall time of our passes on a 12-layer and a 48-layer Llama (fake process group, 8 ranks).
Writes the tables, the machine and the versions to `--out` and a bar chart next to it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives, peak_allocated_bytes
from fsdp_graph.train.launch import spawn
from fsdp_graph.train.llama import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workload import BENCH_CONFIG, batches, bench_model, llama_loss  # noqa: E402

OURS = "fsdp_graph (Inductor)"
MEMORY_PEER = "fsdp_graph, activation_memory_budget=0.5"
BASELINE = "FSDP2 eager"


def _fsdp_graph(model, **options):
    fsdp_graph.fully_shard(model)
    return torch.compile(model, backend=fsdp_graph.make_backend(**options), fullgraph=True), model.parameters()


def _fsdp2(model, compile_blocks: bool):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block)
    fully_shard(model)
    return model, model.parameters()


def _ddp(model):
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return ddp, ddp.parameters()


def _single(model):
    return torch.compile(model), model.parameters()


PEERS = {
    OURS: _fsdp_graph,
    "fsdp_graph, no scheduling": lambda m: _fsdp_graph(m, prefetch=False, reduce_scatter="native"),
    MEMORY_PEER: lambda m: _fsdp_graph(m, activation_memory_budget=0.5),
    BASELINE: lambda m: _fsdp2(m, compile_blocks=False),
    "FSDP2 + per-block compile": lambda m: _fsdp2(m, compile_blocks=True),
    "DDP": _ddp,
    "single process (torch.compile)": _single,
}
DISTRIBUTED = {OURS, "fsdp_graph, no scheduling", MEMORY_PEER, BASELINE, "FSDP2 + per-block compile", "DDP"}


def _train(setup, base, data, steps: int, warmup: int, distributed: bool) -> dict:
    model, params = setup(copy.deepcopy(base))
    opt = torch.optim.AdamW(list(params), lr=3e-3)

    def step():
        llama_loss(model, next(data)).backward()
        opt.step()
        opt.zero_grad()

    times = []
    for _ in range(warmup + steps):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak, _ = peak_allocated_bytes(step)
    seen = executed_collectives(step)
    return {
        "first": times[0],
        "median": statistics.median(times[warmup:]),
        "peak": peak,
        "bytes": sum(seen.backend_wire_bytes.values()),
    }


def measure_peers(rank: int, world: int, args: argparse.Namespace) -> dict:
    # Load Inductor and start its compile workers before any peer is timed: the first compile in a process pays
    # for that, and it must not be charged to whichever peer happens to run first.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"suite-warmup-rank{rank}-")
    torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum())(torch.randn(16, 16, requires_grad=True)).backward()
    torch.manual_seed(0)
    base = bench_model()
    results = {}
    for name, setup in PEERS.items():
        # Each peer compiles from an empty Inductor cache of its own (cold), then once more over it (warm).
        cache = tempfile.mkdtemp(prefix=f"suite-rank{rank}-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        runs = []
        for _ in range(2):
            torch._dynamo.reset()
            data = batches(args.batch, rank, world, seed=1)
            runs.append(_train(setup, base, data, args.steps, args.warmup, name in DISTRIBUTED))
        cold, warm = runs
        results[name] = {
            "median": statistics.median([cold["median"], warm["median"]]),
            "cold_compile": cold["first"] - cold["median"],
            "warm_compile": warm["first"] - warm["median"],
            "peak": max(cold["peak"], warm["peak"]),
            "bytes": warm["bytes"],
        }
    results["zero3_min_bytes"] = 3 * (world - 1) / world * sum(p.numel() for p in base.parameters()) * 4
    return results


def pass_seconds(rank: int, world: int, layers: int) -> float:
    """Wall time of our passes (dedup, reshard, lower, bucket, all-to-all, schedule) for one training step's graphs
    of a `layers`-layer Llama, planned on the fake process group at `world` ranks."""
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, layers=layers, heads=4, kv_heads=2, hidden=192, seq=32)
    model = fsdp_graph.fully_shard(bench_model(cfg))
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    idx = torch.randint(0, cfg.vocab, (1, cfg.seq))
    llama_loss(compiled, (idx, idx)).backward()
    return sum(backend.pass_seconds.values())


def _fake_world(fn, world: int, *args):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return fn(0, world, *args)
    finally:
        dist.destroy_process_group()


def _table(results: dict, zero_min: float) -> list[str]:
    base = results[BASELINE]
    ddp = results["DDP"]
    lines = [
        "| peer | median step | vs FSDP2 eager | vs DDP | peak MiB/rank | vs FSDP2 eager | MiB sent/rank/step "
        "| vs ZeRO-3 min | cold compile | warm compile |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['median']:.3f} s | {r['median'] / base['median']:.2f}x | {r['median'] / ddp['median']:.2f}x "
            f"| {r['peak'] / 2**20:.1f} | {r['peak'] / base['peak']:.2f}x | {r['bytes'] / 2**20:.2f} "
            f"| {r['bytes'] / zero_min:.4f} | {r['cold_compile']:.1f} s | {r['warm_compile']:.1f} s |"
        )
    return lines


def _chart(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results)
    base = results[BASELINE]
    metrics = [("median step", "median"), ("peak memory", "peak"), ("bytes sent", "bytes")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (title, key) in zip(axes, metrics):
        values = [results[n][key] / base[key] if base[key] else 0.0 for n in names]
        ax.barh(names, values, color=["tab:blue" if n.startswith("fsdp_graph") else "tab:gray" for n in names])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title} (x FSDP2 eager)")
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--out", default="docs/benchmarks.md")
    args = parser.parse_args()
    started = time.perf_counter()
    results = spawn(measure_peers, args.world, (args,), timeout_s=1800)[0]
    zero_min = results.pop("zero3_min_bytes")
    passes = {layers: _fake_world(pass_seconds, 8, layers) for layers in (12, 48)}
    ours, base, ddp = results[OURS], results[BASELINE], results["DDP"]
    single = results["single process (torch.compile)"]
    n_params = BENCH_CONFIG.num_params()
    targets = [
        ("step time <= 0.9x FSDP2 eager", ours["median"] / base["median"], 0.9),
        ("step time <= 1.1x DDP", ours["median"] / ddp["median"], 1.1),
        ("peak memory <= 0.85x FSDP2 eager", ours["peak"] / base["peak"], 0.85),
        (f"peak memory <= 0.85x FSDP2 eager ({MEMORY_PEER})", results[MEMORY_PEER]["peak"] / base["peak"], 0.85),
        (f"step time <= 0.9x FSDP2 eager ({MEMORY_PEER})", results[MEMORY_PEER]["median"] / base["median"], 0.9),
        ("bytes per step <= 1.01x ZeRO-3 minimum", ours["bytes"] / zero_min, 1.01),
        ("cold compile <= 1.25x plain torch.compile", ours["cold_compile"] / single["cold_compile"], 1.25),
        ("pass time 48 layers <= 4.5x 12 layers", passes[48] / passes[12], 4.5),
    ]
    cfg = dataclasses.asdict(BENCH_CONFIG)
    lines = [
        "# Benchmarks",
        "",
        f"Written by `python benchmarks/suite.py` on {datetime.date.today()}, in {time.perf_counter() - started:.0f} s.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {args.world} gloo ranks on this machine.",
        f"Model: the benchmark Llama ({n_params / 1e6:.2f} M params, {cfg}), batch {args.batch}x{BENCH_CONFIG.seq} per "
        f"rank, AdamW; median of 2x{args.steps} steps after {args.warmup} warm-up each.",
        "",
        *_table(results, zero_min),
        "",
        "Peak memory is what a step allocates above its starting point (activations, gathered parameters, "
        "gradients in flight, optimizer temporaries), measured per rank with the profiler's memory events.",
        "Bytes are what gloo itself sent (its own profiler events, ring-algorithm bytes per rank).",
        "",
        f"Pass time (our passes only, one training step's graphs, fake process group at 8 ranks): 12 layers "
        f"{passes[12]:.3f} s, 48 layers {passes[48]:.3f} s ({passes[48] / passes[12]:.2f}x).",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {label} | {value:.2f} | {'yes' if value <= limit else 'no'} |" for label, value, limit in targets],
    ]
    out = Path(args.out)
    chart = out.with_suffix(".png")
    if _chart(results, chart):
        lines += ["", f"![ratios against FSDP2 eager]({chart.name})"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
