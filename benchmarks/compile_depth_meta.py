"""Compile time against depth at real model shapes (issue 15): a Llama preset on the meta device, world N on the
fake process group, compiled by our backend with eager kernels (`explain()`'s compile: Dynamo, AOT autograd, our
passes; no Inductor code generation, which needs real tensors), at a shallow and a deep layer count.

    python benchmarks/compile_depth_meta.py                         # 70b shapes, 8 and 80 layers, world 8
    python benchmarks/compile_depth_meta.py --preset 1b --layers 8 16
    python benchmarks/compile_depth_meta.py --reuse-blocks          # fully_shard(reuse_blocks=True)
    python benchmarks/compile_depth_meta.py --torch regions         # plain torch.compile, no fsdp_graph (below)

Each depth runs in a fresh process: `scale_plans.explain_llama` (build on meta, `fully_shard(device="meta")`,
`fsdp_graph.explain`: one training step traced and compiled, then its plan replayed). Prints, per depth, the
seconds torch.compile took (`torch._dynamo.utils.compilation_time_metrics`: Dynamo, AOT autograd and our passes
for both graphs), and the wall and CPU seconds of the whole call, then deep / shallow for both.

`--torch plain|regions`: the same Llama, unsharded, compiled by plain `torch.compile(backend="aot_eager")` (Dynamo
and AOT autograd with eager kernels: the stages our compile has, without sharding and our passes), one forward and
backward of the same loss; `regions` makes each block's forward torch's own block reuse,
`torch.compiler.nested_compile_region`. The yardstick for what torch's tracing costs per layer without us.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(preset_name: str, layers: int, world: int, reuse_blocks: bool) -> dict:
    import torch.distributed as dist
    from torch._dynamo.utils import compilation_time_metrics
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.scale_plans import explain_llama, hardware_for
    from fsdp_graph.train.llama import preset

    cfg = replace(preset(preset_name), layers=layers)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        explain_llama(cfg, 1, hardware_for(world), reuse_blocks=reuse_blocks)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        # torch.compile's own share of it (Dynamo, AOT autograd, our passes, both graphs: the fake world checks
        # collectives, so the backward compiles up front), without the build, the sharding and the plan replay.
        compile_s = sum(compilation_time_metrics["_compile.compile_inner"])
        return {"layers": layers, "wall_s": wall, "cpu_s": cpu, "compile_s": compile_s}
    finally:
        dist.destroy_process_group()


def measure_torch(preset_name: str, layers: int, regions: bool) -> dict:
    import torch
    from torch._dynamo.utils import compilation_time_metrics

    from fsdp_graph.train.llama import Llama, LlamaBlock, preset

    cfg = replace(preset(preset_name), layers=layers)
    if regions:
        LlamaBlock.forward = torch.compiler.nested_compile_region(LlamaBlock.forward)
    with torch.device("meta"):
        llama = Llama(cfg)
    idx = torch.zeros(1, cfg.seq, dtype=torch.long, device="meta")

    def step(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return -model(idx).float().log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

    start, cpu = time.perf_counter(), time.process_time()
    torch.compile(step, backend="aot_eager", fullgraph=True)(llama, idx).backward()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    compile_s = sum(compilation_time_metrics["_compile.compile_inner"])
    return {"layers": layers, "wall_s": wall, "cpu_s": cpu, "compile_s": compile_s}


def in_fresh_process(
    preset_name: str, layers: int, world: int, reuse_blocks: bool, torch_mode: str | None = None
) -> dict:
    """`measure` (or `measure_torch`) in a new Python process (nothing compiled or imported before it)."""
    command = [sys.executable, __file__, "--child", "--preset", preset_name, "--world", str(world)]
    command += ["--layers", str(layers), str(layers)] + (["--reuse-blocks"] if reuse_blocks else [])
    command += ["--torch", torch_mode] if torch_mode else []
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="70b")
    parser.add_argument("--layers", type=int, nargs=2, default=(8, 80))
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--reuse-blocks", action="store_true")
    parser.add_argument("--torch", choices=("plain", "regions"), help="plain torch.compile instead (see above)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.torch:
            print(json.dumps(measure_torch(args.preset, args.layers[0], args.torch == "regions")))
        else:
            print(json.dumps(measure(args.preset, args.layers[0], args.world, args.reuse_blocks)))
        return 0
    results = [
        in_fresh_process(args.preset, layers, args.world, args.reuse_blocks, args.torch) for layers in args.layers
    ]
    if args.torch:
        label = f"{args.preset}, plain torch.compile (aot_eager){', nested_compile_region' * (args.torch == 'regions')}"
    else:
        label = f"{args.preset}, world {args.world}, reuse_blocks={args.reuse_blocks}"
    whole = "the first step" if args.torch else "all of explain()"
    for r in results:
        print(
            f"{label}: {r['layers']:3d} layers  {r['compile_s']:7.1f} s compiling  ({whole}: "
            f"{r['wall_s']:7.1f} s wall, {r['cpu_s']:7.1f} s CPU)"
        )
    shallow, deep = results
    print(
        f"{label}: {deep['layers']} / {shallow['layers']} layers: {deep['compile_s'] / shallow['compile_s']:.2f}x "
        f"compile (issue 15's goal: <= 2x); {whole}: {deep['wall_s'] / shallow['wall_s']:.2f}x wall, "
        f"{deep['cpu_s'] / shallow['cpu_s']:.2f}x CPU"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
