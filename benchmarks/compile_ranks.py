"""Issue 36's goal for one compile per job: at 4 gloo ranks, a cold compile's wall time at most 1.15x that of 1 rank.

    python benchmarks/compile_ranks.py [--layers 4] [--worlds 1 4] [--no-share] [--replicas R]
    # --no-share: every rank compiles; --replicas R: HYBRID_SHARD over (R, world / R) at worlds above 1

Model and call: `benchmarks/hf_compile.py`'s Hugging Face Llama (hidden 64, built from a config), called as its
users call it, `fully_shard(model)` and `fsdp_backend` with their defaults (`share_compiles` on). Per world: fresh
rank processes (`spawn`), one new empty Inductor cache directory for all of them (one node). Each rank times its
first four steps after a barrier; its cold compile is the first step minus the median of the other three, and the
world's figure is its slowest rank's. Prints each world's figure and every world / the first, the kernel libraries
Inductor built, and the longest seconds any rank spent compiling for the others, loading the compile stack before
it waited (preparing), waiting for them and loading their files (`CompileSharing.seconds`). On a machine with fewer cores than ranks, the ranks' Dynamo traces
(every rank traces before the first one compiles for all) share the cores: say the core count with the figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def first_steps(rank: int, world: int, layers: int, share: bool, replicas: int = 1) -> dict:
    """Wall seconds of this rank's first four steps, from a barrier of all ranks ("times"), and the sharing's
    seconds per phase ("phases": compiling for the others, or waiting for and loading another rank's files)."""
    import torch.distributed as dist

    import fsdp_graph
    from benchmarks.hf_compile import _trainer

    fsdp_graph.fsdp_backend.share_compiles = share  # the backend `_trainer` compiles with

    step = _trainer("ours", layers, replicas if world > 1 else 1)
    dist.barrier()
    times = []
    for _ in range(4):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"times": times, "phases": dict(fsdp_graph.fsdp_backend.sharing.seconds)}


def cold_compile(world: int, layers: int, share: bool = True, replicas: int = 1) -> tuple[float, dict, int]:
    """The slowest rank's first step minus its median later step, on a new empty Inductor cache; the longest
    seconds any rank spent in each sharing phase; the kernel libraries Inductor built (the compile's C++ work)."""
    from fsdp_graph.train.launch import spawn

    with tempfile.TemporaryDirectory(prefix="fsdp_graph_ranks_") as cache:
        with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache}):  # the ranks inherit it: one cache
            per_rank = spawn(first_steps, world, (layers, share, replicas), timeout_s=1800.0)
        kernels = sum(1 for _ in Path(cache).rglob("*.so"))
    phases: dict[str, float] = {}
    for result in per_rank:
        for phase, seconds in result["phases"].items():
            phases[phase] = max(phases.get(phase, 0.0), seconds)
    figure = max(r["times"][0] - statistics.median(r["times"][1:]) for r in per_rank)
    return figure, phases, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--no-share", action="store_true", help="make_backend(share_compiles=False)")
    parser.add_argument("--replicas", type=int, default=1, help="HYBRID_SHARD over (R, world / R) above 1 rank")
    args = parser.parse_args()
    figures = {world: cold_compile(world, args.layers, not args.no_share, args.replicas) for world in args.worlds}
    first = args.worlds[0]
    sharing = "every rank compiles" if args.no_share else "one compile per job"
    if args.replicas > 1:
        sharing += f", HYBRID_SHARD over ({args.replicas}, world / {args.replicas})"
    print(f"Hugging Face Llama, {args.layers} layers, cold Inductor compile, {sharing}, {os.cpu_count()} cores:")
    for world, (seconds, phases, kernels) in figures.items():
        parts = ", ".join(f"{phase} {value:.1f} s" for phase, value in sorted(phases.items()))
        print(
            f"  {world} rank(s): {seconds:6.1f} s   {seconds / figures[first][0]:.2f}x of {first} rank(s);"
            f" {kernels} kernel libraries built" + (f"; longest per phase: {parts}" if parts else "")
        )
    print("issue 36's goal: 4 ranks at most 1.15x of 1 rank")


if __name__ == "__main__":
    main()
