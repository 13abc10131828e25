"""Compile time against depth at real model shapes (issue 15): a Llama preset on the meta device, world N on the
fake process group, compiled by our backend with eager kernels (`explain()`'s compile: Dynamo, AOT autograd, our
passes; no Inductor code generation, which needs real tensors), at a shallow and a deep layer count.

    python benchmarks/compile_depth_meta.py                         # 70b shapes, 8 and 80 layers, world 8
    python benchmarks/compile_depth_meta.py --preset 1b --layers 8 16
    python benchmarks/compile_depth_meta.py --reuse-blocks          # fully_shard(reuse_blocks=True)
    python benchmarks/compile_depth_meta.py --reuse-blocks --repeats 5   # 5 interleaved pairs, each depth's median
    python benchmarks/compile_depth_meta.py --torch regions         # plain torch.compile, no fsdp_graph (below)
    python benchmarks/compile_depth_meta.py --reuse-blocks --instructions   # what Dynamo traces per layer (below)

Each depth runs in a fresh process: `scale_plans.explain_llama` (build on meta, `fully_shard(device="meta")`,
`fsdp_graph.explain`: one training step traced and compiled, then its plan replayed). Prints, per depth, the
seconds torch.compile took (`torch._dynamo.utils.compilation_time_metrics`: Dynamo, AOT autograd and our passes
for both graphs), and the wall and CPU seconds of the whole call, then deep / shallow for both.

`--torch plain|regions`: the same Llama, unsharded, compiled by plain `torch.compile(backend="aot_eager")` (Dynamo
and AOT autograd with eager kernels: the stages our compile has, without sharding and our passes), one forward and
backward of the same loss; `regions` makes each block's forward torch's own block reuse,
`torch.compiler.nested_compile_region`. The yardstick for what torch's tracing costs per layer without us.

`--instructions`: also count the bytecode instructions Dynamo traces, by function, and print the functions that
grow with depth, per layer. Unlike seconds, the counts do not depend on how busy the machine is (the same code and
options trace the same instructions), so a change to what the runtime makes Dynamo trace can be measured exactly on
a shared machine whose speed varies twofold from day to day. The counting slows Dynamo's tracing: take seconds
from a run without it.

`--repeats N`: N pairs of runs (shallow, deep, shallow, deep, ...: a change in the machine's speed meets both depths
alike). Prints each depth's median, their ratio, and each pair's own ratio: one pair's ratio has varied by 0.3 to 0.9 on
this 2-core machine within minutes, mostly from the shallow depth's fixed cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# torch.compile's phases, as `compilation_time_metrics` names them: Dynamo's bytecode tracing (the model's and the
# runtime's Python, run symbolically), the backend (AOT autograd's joint trace and partition, then our passes) and
# the guards built at its end.
PHASES = {
    "dynamo_tracing": "bytecode_tracing",
    "backend": "OutputGraph.call_user_compiler",
    "guards": "build_guards",
}


def count_traced_instructions() -> Counter:
    """From now on, each bytecode instruction Dynamo traces adds 1 to its function's count, keyed
    "path/to/file.py:function" (paths from the package root: fsdp_graph/..., torch/...)."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    counts: Counter = Counter()
    step = InstructionTranslatorBase.step

    def counted_step(self) -> bool:
        code = self.f_code
        counts[f"{code.co_filename.split('site-packages/')[-1].removeprefix(str(ROOT) + '/')}:{code.co_name}"] += 1
        return step(self)

    InstructionTranslatorBase.step = counted_step
    return counts


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
        phases = {name: sum(compilation_time_metrics.get(key, [])) for name, key in PHASES.items()}
        return {"layers": layers, "wall_s": wall, "cpu_s": cpu, "compile_s": compile_s, "phases": phases}
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
    phases = {name: sum(compilation_time_metrics.get(key, [])) for name, key in PHASES.items()}
    return {"layers": layers, "wall_s": wall, "cpu_s": cpu, "compile_s": compile_s, "phases": phases}


def in_fresh_process(
    preset_name: str,
    layers: int,
    world: int,
    reuse_blocks: bool,
    torch_mode: str | None = None,
    instructions: bool = False,
) -> dict:
    """`measure` (or `measure_torch`) in a new Python process (nothing compiled or imported before it)."""
    command = [sys.executable, __file__, "--child", "--preset", preset_name, "--world", str(world)]
    command += ["--layers", str(layers), str(layers)] + (["--reuse-blocks"] if reuse_blocks else [])
    command += ["--torch", torch_mode] if torch_mode else []
    command += ["--instructions"] if instructions else []
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="70b")
    parser.add_argument("--layers", type=int, nargs=2, default=(8, 80))
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--reuse-blocks", action="store_true")
    parser.add_argument("--torch", choices=("plain", "regions"), help="plain torch.compile instead (see above)")
    parser.add_argument("--instructions", action="store_true", help="count what Dynamo traces (see above)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved pairs of runs; prints each depth's median")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        counts = count_traced_instructions() if args.instructions else Counter()
        if args.torch:
            result = measure_torch(args.preset, args.layers[0], args.torch == "regions")
        else:
            result = measure(args.preset, args.layers[0], args.world, args.reuse_blocks)
        print(json.dumps({**result, "instructions": dict(counts)}))
        return 0
    runs = [  # interleaved, shallow then deep, so that a change in the machine's speed meets both depths alike
        [
            in_fresh_process(args.preset, layers, args.world, args.reuse_blocks, args.torch, args.instructions)
            for layers in args.layers
        ]
        for _ in range(args.repeats)
    ]
    results = [median_run([run[depth] for run in runs]) for depth in range(2)]
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
    print(
        f"{label}: seconds a layer added, by phase: "
        + ", ".join(
            f"{name} {1000 * (deep['phases'][name] - shallow['phases'][name]) / (deep['layers'] - shallow['layers']):.0f} ms"
            for name in PHASES
        )
    )
    if args.repeats > 1:
        ratios = sorted(deep_run["compile_s"] / shallow_run["compile_s"] for shallow_run, deep_run in runs)
        print(
            f"{label}: {args.repeats} interleaved pairs (figures above: each depth's median): each pair's "
            f"{deep['layers']} / {shallow['layers']} compile ratio " + ", ".join(f"{r:.2f}" for r in ratios)
        )
    if args.instructions:
        print_instructions(label, shallow, deep)
    return 0


def median_run(results: list[dict]) -> dict:
    """One depth's runs folded into one: each figure (and each phase's) the median over the runs."""
    merged = dict(results[0])
    for key in ("wall_s", "cpu_s", "compile_s"):
        merged[key] = statistics.median(r[key] for r in results)
    merged["phases"] = {name: statistics.median(r["phases"][name] for r in results) for name in PHASES}
    return merged


def print_instructions(label: str, shallow: dict, deep: dict, top: int = 15) -> None:
    """Dynamo's traced instructions at both depths, and the functions whose count grows with depth, per layer."""
    added = deep["layers"] - shallow["layers"]
    before, after = Counter(shallow["instructions"]), Counter(deep["instructions"])
    print(
        f"{label}: Dynamo traced {sum(before.values())} instructions at {shallow['layers']} layers, "
        f"{sum(after.values())} at {deep['layers']}: {(sum(after.values()) - sum(before.values())) / added:.0f} a layer"
    )
    growth = Counter({name: (after[name] - before[name]) / added for name in after})
    for name, per_layer in growth.most_common(top):
        if per_layer > 0:
            print(f"  {per_layer:7.1f} a layer  {name}")


if __name__ == "__main__":
    raise SystemExit(main())
