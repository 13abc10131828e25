"""Cold compile time against depth (issue 15): fsdp_graph vs plain `torch.compile`, one rank, Inductor.

    python benchmarks/compile_depth.py                      # 4 and 16 layers, both peers, 1 run each
    python benchmarks/compile_depth.py --layers 4 8 16 --runs 3
    python benchmarks/compile_depth.py --peers all     # also reuse_blocks=True and plain with a block region

Model: the main job's Llama at hidden 64 (`dim=64, heads=4, kv_heads=2, hidden=176`, vocabulary 256, sequence 64,
batch 4), SGD. Each measurement is a fresh process with an empty Inductor cache of its own (`TORCHINDUCTOR_CACHE_DIR`
in a new temporary directory, FX graph and AOT autograd caches included): cold compile = the first training step
minus the median of the next three, in wall seconds and in CPU seconds (the process's and its C++ compiler runs',
with `TORCHINDUCTOR_COMPILE_THREADS=1`: the figure to compare on a machine other jobs share). fsdp_graph runs
`fully_shard` over a world of one gloo rank (no collectives: the passes still run) with
`torch.compile(backend=fsdp_backend, fullgraph=True)`; the peer is the unsharded model under
`torch.compile(fullgraph=True)`. `--peers all` adds `fully_shard(reuse_blocks=True)` and the plain model with each
block's forward a `torch.compiler.nested_compile_region` (the ceiling of compiling one block). Prints each median
and the ratios issue 15 sets goals for: ours(deepest) / ours(shallowest) and ours / plain at the deepest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("fsdp_graph", "plain torch.compile")
EXTRA_PEERS = ("fsdp_graph reuse_blocks", "plain block region")


def measure(peer: str, layers: int, steps: int = 4) -> tuple[float, float]:
    """One cold compile in this process (the caller gives it a fresh Inductor cache): wall and CPU seconds."""
    import torch
    import torch.distributed as dist

    import fsdp_graph
    from fsdp_graph.train.llama import Llama, LlamaConfig, llama_loss

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, layers=layers, heads=4, kv_heads=2, hidden=176, seq=64, vocab=256)
    model = Llama(cfg)
    if peer.startswith(PEERS[0]):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        fsdp_graph.fully_shard(model, reuse_blocks=peer == EXTRA_PEERS[0])
        compiled = torch.compile(model, backend=fsdp_graph.fsdp_backend, fullgraph=True)
    elif peer == EXTRA_PEERS[1]:
        block_class = type(model.blocks[0])
        region = type(
            "RegionBlock", (block_class,), {"forward": torch.compiler.nested_compile_region(block_class.forward)}
        )
        for block in model.blocks:
            block.__class__ = region
        compiled = torch.compile(model, fullgraph=True)
    else:
        compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=torch.Generator().manual_seed(1))
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), cpu_seconds()
        llama_loss(compiled, (tokens[:, :-1], tokens[:, 1:])).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    if dist.is_initialized():
        dist.destroy_process_group()
    return times[0] - statistics.median(times[1:]), cpu[0] - statistics.median(cpu[1:])


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (Inductor's C++ compiler runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cold_run(script: str, peer: str, layers: int):
    """`script --one PEER LAYERS` in a fresh process with a fresh Inductor cache: the JSON its last line prints."""
    with tempfile.TemporaryDirectory() as cache:
        # Inductor compiles in this process (no worker pool), so its CPU time is counted.
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "PYTHONPATH": str(ROOT),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
        args = [sys.executable, script, "--one", peer, str(layers)]
        out = subprocess.run(args, check=True, capture_output=True, text=True, env=env, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cold(peer: str, layers: int) -> tuple[float, float]:
    result = cold_run(__file__, peer, layers)
    return result["seconds"], result["cpu_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--peers", choices=("two", "all"), default="two")
    parser.add_argument("--one", nargs=2, metavar=("PEER", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        wall, cpu = measure(args.one[0], int(args.one[1]))
        print(json.dumps({"seconds": wall, "cpu_seconds": cpu}))
        return
    medians: dict[tuple[str, int], float] = {}
    peers = PEERS + (EXTRA_PEERS if args.peers == "all" else ())
    for layers in args.layers:
        for peer in peers:
            runs = [_cold(peer, layers) for _ in range(args.runs)]
            medians[peer, layers] = statistics.median(wall for wall, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(
                f"{peer:>24} {layers:>3} layers: cold compile {medians[peer, layers]:.1f} s, {cpu:.1f} CPU s "
                f"(runs {[(round(w, 1), round(c, 1)) for w, c in runs]})",
                flush=True,
            )
    low, high = min(args.layers), max(args.layers)
    ours = PEERS[0]
    print(f"ours({high} layers) / ours({low} layers) = {medians[ours, high] / medians[ours, low]:.2f} (goal <= 1.6)")
    ratio = medians[ours, high] / medians[PEERS[1], high]
    print(f"ours / plain torch.compile at {high} layers = {ratio:.2f} (goal <= 1.1)")
    for peer in peers[2:]:
        print(f"{peer}: ({high} layers) / ({low} layers) = {medians[peer, high] / medians[peer, low]:.2f}")


if __name__ == "__main__":
    main()
