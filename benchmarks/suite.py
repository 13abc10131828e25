"""The benchmark suite: every peer on the same model, batch and world size, measured in ONE run.

    python benchmarks/suite.py [--runs 5] [--steps 6] [--warmup 2] [--world 2] [--batch 8] [--out docs/benchmarks.md]

Peers (the benchmark Llama of benchmarks/workload.py, gloo ranks on this machine):
- fsdp_graph: `fully_shard` + `torch.compile(backend=fsdp_backend)` (Inductor), FULL_SHARD, default scheduling;
- fsdp_graph without scheduling (`prefetch=False, reduce_scatter="native"`): what the schedule passes buy;
- fsdp_graph with `activation_memory_budget=0.5`: the partitioner recomputes activations to cut the peak;
- torch FSDP2 eager (`fully_shard` per block, then the root), and FSDP2 with each block `torch.compile`d;
- DDP (eager);
- single process: each rank trains its own unsharded copy with plain `torch.compile` (no communication);
- SimpleFSDP (torchtitan's `experiments/graph_trainer/simple_fsdp.data_parallel(mode="fully_shard")`, loaded from
  the installed torchtitan at run time) with whole-model `torch.compile(fullgraph=True)` (Inductor). Skipped, with
  the reason on one line, when torchtitan is not importable.

Two phases, all peers in one spawn:
1. cold, one peer at a time (`--cold-runs` times): fresh Dynamo state and an empty Inductor cache of its own;
   cold compile = first step minus the median of the next steps; then the peak memory allocated during a step per
   rank (profiler memory events, above the step's starting point, so the persistent parameter, gradient and
   optimizer shards are not in it), the bytes gloo itself sent in a step (its profiler events, ring-algorithm bytes
   per rank) against the ZeRO-3 minimum 3(N-1)/N * params * 4, and the global loss of each step (parity check).
2. warm, all peers alive at once in one Dynamo state, each over its now warm cache: warm compile = first step
   minus the median step; then `--runs` timed sections, each timing `--steps` steps of every peer in turn (the
   order rotates per run) and one profiled step for the peak. Every ratio (ours against DDP, FSDP2 eager,
   SimpleFSDP) is taken within a run, so a load change on a shared machine hits both sides of it, and reported as
   min/median/max over the runs.
Then the wall time of our passes on a 12-layer and a 48-layer Llama (fake process group, 8 ranks), and the
compile-time goals of issues 15 and 36 (`benchmarks/compile_goals.py`: a Hugging Face Llama's cold compile as its
users call it, against depth and against plain torch.compile; real shapes on the meta device; 4 ranks against 1;
a restart from a checkpoint's artifacts; a warm restart of the main job and the ranks' shared cache;
`--no-compile-goals` skips them).
Writes the tables, the machine and the versions to `--out` and a bar chart next to it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
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
from benchmarks import compile_goals  # noqa: E402
from benchmarks.suite_tables import BASELINE, SINGLE, chart, parity_table, peer_table, ratio_table  # noqa: E402
from benchmarks.workload import BENCH_CONFIG, batches, bench_model, llama_loss  # noqa: E402

OURS = "fsdp_graph (Inductor)"
MEMORY_PEER = "fsdp_graph, activation_memory_budget=0.5"
SIMPLE_FSDP = "SimpleFSDP (torchtitan) + Inductor"

# How the SimpleFSDP peer's environment was made (a venv of its own: torchtitan is not a dependency of this project,
# and its declared dependencies would pull a CUDA torch). Written into the report.
SIMPLE_FSDP_RECIPE = """\
python3 -m venv /work/venv-bench
/work/venv-bench/bin/pip install torch==2.13.0          # always this exact pin: unpinned pulls GBs of CUDA wheels
/work/venv-bench/bin/pip install -e ".[test]"
/work/venv-bench/bin/pip install --no-deps torchtitan==0.3.0
/work/venv-bench/bin/pip install tyro                   # torchtitan.config imports it (pulls typeguard, docstring-parser)
/work/venv-bench/bin/pip install --no-deps spmd_types==0.2.3   # torchtitan.protocols.module imports it
/work/venv-bench/bin/python benchmarks/suite.py --runs 5"""


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


def simple_fsdp_unavailable() -> str | None:
    """Why the SimpleFSDP peer cannot run here (None when it can)."""
    try:
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel  # noqa: F401
    except Exception as error:  # ImportError, or a torchtitan that fails at import against this torch
        return f"{type(error).__name__}: {error}"
    return None


def _simple_fsdp(model, compile: bool = True):
    """torchtitan's SimpleFSDP, as its graph_trainer applies it: every parameter a `Shard(0)` DTensor on a 1-D mesh,
    gathered by a parametrization at each use; then whole-model Inductor.

    Two things our harness must add:
    - `data_parallel` replaces each module's parameters one module at a time, so a tied head (`output.weight is
      tok_embeddings.weight`) comes out as a second, separately sharded and separately trained parameter. We re-tie
      it: both modules then read one DTensor, gathered at each use, its gradient the sum of both reduce-scatters.
    - Gradients are reduced as `Partial("sum")`, not averaged (torchtitan divides its loss by the global token
      count instead), so the loss is divided by the world size (the third value) to train like the other peers.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    world = dist.get_world_size()
    tied = model.output.weight is model.tok_embeddings.weight
    model = data_parallel(model, init_device_mesh("cpu", (world,)), mode="fully_shard")
    if tied:
        model.output._parameters["weight"] = model.tok_embeddings._parameters["weight"]
    return (torch.compile(model, fullgraph=True) if compile else model), model.parameters(), world


PEERS = {
    OURS: _fsdp_graph,
    "fsdp_graph, no scheduling": lambda m: _fsdp_graph(m, prefetch=False, reduce_scatter="native"),
    MEMORY_PEER: lambda m: _fsdp_graph(m, activation_memory_budget=0.5),
    BASELINE: lambda m: _fsdp2(m, compile_blocks=False),
    "FSDP2 + per-block compile": lambda m: _fsdp2(m, compile_blocks=True),
    "DDP": _ddp,
    SINGLE: _single,
    SIMPLE_FSDP: _simple_fsdp,
}
DISTRIBUTED = set(PEERS) - {SINGLE}
CORE = (OURS, BASELINE, "DDP", SINGLE, SIMPLE_FSDP)  # the peers every ratio of issue 15 needs (--core)


class _Peer:
    """One peer's model and optimizer, built from a fresh copy of the base model, and its own data stream."""

    def __init__(self, setup, base, data, distributed: bool):
        model, params, *scale = setup(copy.deepcopy(base))
        self.model, self.data, self.distributed = model, data, distributed
        self.loss_divisor = scale[0] if scale else 1
        self.opt = torch.optim.AdamW(list(params), lr=3e-3)

    def step(self) -> torch.Tensor:
        loss = llama_loss(self.model, next(self.data))
        (loss / self.loss_divisor).backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def timed(self, steps: int) -> tuple[list[float], list[torch.Tensor]]:
        times, losses = [], []
        for _ in range(steps):
            if self.distributed:
                dist.barrier()
            start = time.perf_counter()
            losses.append(self.step())
            times.append(time.perf_counter() - start)
        return times, losses


def _global_losses(losses: list[torch.Tensor], distributed: bool) -> list[float]:
    """The mean over ranks of each step's loss (the loss of the global batch); one collective, after timing."""
    stacked = torch.stack(losses)
    if distributed:
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return stacked.tolist()


def _cold(setup, base, args, rank: int, world: int, distributed: bool) -> dict:
    """A fresh Dynamo state and an empty Inductor cache: the compile a user pays once."""
    torch._dynamo.reset()
    peer = _Peer(setup, base, batches(args.batch, rank, world, seed=1), distributed)
    times, losses = peer.timed(1 + args.warmup + args.steps)
    peak, _ = peak_allocated_bytes(peer.step)
    seen = executed_collectives(peer.step)
    return {
        "cold_compile": times[0] - statistics.median(times[1 + args.warmup :]),
        "peak": peak,
        "bytes": sum(seen.backend_wire_bytes.values()),
        "losses": _global_losses(losses, distributed),
    }


def _progress(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {message} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)


def measure_peers(rank: int, world: int, args: argparse.Namespace, skip: tuple[str, ...]) -> dict:
    # Load Inductor and start its compile workers before any peer is timed: the first compile in a process pays
    # for that, and it must not be charged to whichever peer happens to run first.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"suite-warmup-rank{rank}-")
    torch.compile(lambda x: torch.nn.functional.gelu(x @ x).sum())(torch.randn(16, 16, requires_grad=True)).backward()
    torch.manual_seed(0)
    base = bench_model()
    names = [name for name in PEERS if name not in skip]
    caches = {name: tempfile.mkdtemp(prefix=f"suite-rank{rank}-") for name in names}

    # Phase 1, one peer at a time: cold compile (each from an empty Inductor cache of its own), peak, bytes, losses.
    cold = {name: [] for name in names}
    for _ in range(args.cold_runs):
        for name in names:
            cache = tempfile.mkdtemp(prefix=f"suite-cold-rank{rank}-")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            cold[name].append(_cold(PEERS[name], base, args, rank, world, name in DISTRIBUTED))
            _progress(rank, f"cold {name}: compile {cold[name][-1]['cold_compile']:.1f} s")
            caches[name] = cache  # the warm phase compiles over the last cold compile's cache

    # Phase 2, every peer alive in one Dynamo state (each compiles its model once more, over its warm cache), then
    # `runs` timed sections of every peer in turn. Whole-model compiles of the same `Llama.forward` would otherwise
    # mark the shapes that differ between peers dynamic (a sharded weight is smaller), which a fresh compile does not.
    torch._dynamo.reset()
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(names))
    peers, first = {}, {}
    for name in names:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = caches[name]
        peers[name] = _Peer(PEERS[name], base, batches(args.batch, rank, world, seed=2), name in DISTRIBUTED)
        first[name] = peers[name].timed(1 + args.warmup)[0][0]
        _progress(rank, f"warm {name}: first step {first[name]:.1f} s")
    runs = []
    for run in range(args.runs):
        shift = run % len(names)
        measured = {}
        for name in names[shift:] + names[:shift]:
            times, _ = peers[name].timed(args.steps)
            peak, _ = peak_allocated_bytes(peers[name].step)
            measured[name] = {"median": statistics.median(times), "peak": peak}
        runs.append(measured)
        _progress(
            rank, f"run {run + 1}/{args.runs}: " + ", ".join(f"{n} {m['median']:.3f} s" for n, m in measured.items())
        )

    results = {}
    for name in names:
        medians = [run[name]["median"] for run in runs]
        results[name] = {
            "median": statistics.median(medians),
            "cold_compile": statistics.median(c["cold_compile"] for c in cold[name]),
            "warm_compile": first[name] - statistics.median(medians),
            "peak": max(max(c["peak"] for c in cold[name]), max(run[name]["peak"] for run in runs)),
            "bytes": cold[name][-1]["bytes"],
            "losses": cold[name][0]["losses"],
        }
    return {
        "peers": results,
        "runs": runs,
        "cold": {name: [c["cold_compile"] for c in cold[name]] for name in names},
        "zero3_min_bytes": 3 * (world - 1) / world * sum(p.numel() for p in base.parameters()) * 4,
    }


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


def _ratios(measured: dict) -> list[tuple[str, list[float], float | None]]:
    """(label, one value per run, target or None) for every ratio issue 15 asks for. Step time and memory are
    paired within each timed run, cold compile within each cold run. Rows of a skipped peer are left out."""
    runs, cold = measured["runs"], measured["cold"]
    rows = [  # (label, metric, numerator, denominator, target)
        ("step time, ours / DDP", "median", OURS, "DDP", 1.0),
        ("step time, ours / FSDP2 eager", "median", OURS, BASELINE, 0.85),
        ("step time, ours / FSDP2 + per-block compile", "median", OURS, "FSDP2 + per-block compile", None),
        ("step time, ours / SimpleFSDP", "median", OURS, SIMPLE_FSDP, None),
        (f"step time, {MEMORY_PEER} / FSDP2 eager", "median", MEMORY_PEER, BASELINE, None),
        ("peak memory, ours / FSDP2 eager", "peak", OURS, BASELINE, None),
        (f"peak memory, {MEMORY_PEER} / FSDP2 eager", "peak", MEMORY_PEER, BASELINE, None),
        ("peak memory, ours / SimpleFSDP", "peak", OURS, SIMPLE_FSDP, None),
        ("cold compile, ours / plain torch.compile", "cold", OURS, SINGLE, None),
        ("cold compile, ours / SimpleFSDP", "cold", OURS, SIMPLE_FSDP, None),
    ]
    out = []
    for label, metric, a, b, target in rows:
        if a not in cold or b not in cold:
            continue
        if metric == "cold":
            values = [x / y for x, y in zip(cold[a], cold[b])]
        else:
            values = [run[a][metric] / run[b][metric] for run in runs]
        out.append((label, values, target))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed sections; each ratio is reported over them")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per peer per run (their median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cold-runs", type=int, default=1, help="cold compiles per peer (each a full compile)")
    parser.add_argument(
        "--core", action="store_true", help=f"only {', '.join(CORE)}: skips the three compiled variants' cost"
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--out", default="docs/benchmarks.md", help="also writes the raw numbers next to it (.json)")
    parser.add_argument("--from-json", help="render the tables of a saved run (its .json) instead of measuring")
    parser.add_argument(
        "--no-compile-goals",
        action="store_true",
        help="skip the compile-time goals of issues 15 and 36 (about 12 minutes)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".json")
    if args.from_json:  # re-render a saved run's tables without measuring again
        saved = json.loads(Path(args.from_json).read_text())
        measured, passes, skipped, load_before, load_after = (
            saved[k] for k in ("measured", "passes", "skipped", "load_before", "load_after")
        )
        compile_measured = saved.get("compile_goals")
        passes = {int(k): v for k, v in passes.items()}
        started -= saved["seconds"]
        for key, value in saved["args"].items():  # the settings of the measured run, for the header
            if key not in ("out", "from_json"):
                setattr(args, key, value)
        command = saved["command"]
    else:
        command = " ".join(["python benchmarks/suite.py", *sys.argv[1:]])
        load_before = os.getloadavg()
        skipped = simple_fsdp_unavailable()
        if skipped:
            print(f"SimpleFSDP peer skipped (torchtitan not importable: {skipped})", flush=True)
        skip = ((SIMPLE_FSDP,) if skipped else ()) + tuple(n for n in PEERS if args.core and n not in CORE)
        measured = spawn(measure_peers, args.world, (args, skip), timeout_s=3600)[0]
        load_after = os.getloadavg()
        saved = {"measured": measured, "args": vars(args)}
        raw.write_text(json.dumps(saved, indent=1))  # the ranks' numbers are kept even if the pass timing fails
        passes = {layers: _fake_world(pass_seconds, 8, layers) for layers in (12, 48)}
        compile_measured = None if args.no_compile_goals else compile_goals.measure()
        saved = {
            "measured": measured,
            "passes": passes,
            "skipped": skipped,
            "load_before": load_before,
            "load_after": load_after,
            "compile_goals": compile_measured,
            "seconds": time.perf_counter() - started,
            "args": vars(args),
            "command": command,
        }
        raw.write_text(json.dumps(saved, indent=1))
    results, zero_min = measured["peers"], measured["zero3_min_bytes"]
    ours = results[OURS]
    ratios = _ratios(measured)
    targets = [
        ("bytes per step <= 1.01x ZeRO-3 minimum", ours["bytes"] / zero_min, 1.01),
        ("pass time 48 layers <= 4.5x 12 layers", passes[48] / passes[12], 4.5),
    ]
    n_params = BENCH_CONFIG.num_params()
    cfg = dataclasses.asdict(BENCH_CONFIG)
    versions = f"torch {torch.__version__}"
    if not skipped:
        from importlib.metadata import version

        versions += f", torchtitan {version('torchtitan')}"
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{command}` on {datetime.date.today()}, in {time.perf_counter() - started:.0f} s.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; Python "
        f"{platform.python_version()}, {versions}; {args.world} gloo ranks on this machine. Load average "
        f"(1/5/15 min) {' / '.join(f'{x:.1f}' for x in load_before)} at the start, "
        f"{' / '.join(f'{x:.1f}' for x in load_after)} at the end of the measurements.",
        f"Model: the benchmark Llama ({n_params / 1e6:.2f} M params, {cfg}), batch {args.batch}x{BENCH_CONFIG.seq} per "
        f"rank, AdamW. Step time: median over {args.runs} runs of each run's median of {args.steps} steps (after "
        f"{args.warmup} warm-up steps); cold compile: {args.cold_runs} per peer.",
        *([f"SimpleFSDP peer skipped (torchtitan not importable: {skipped})."] if skipped else []),
        *(
            [f"`--core`: only {'; '.join(CORE)}. Not run: {'; '.join(n for n in PEERS if n not in CORE)}."]
            if getattr(args, "core", False)
            else []
        ),
        "",
        *peer_table(results, zero_min),
        "",
        "Peak memory is what a step allocates above its starting point (activations, gathered parameters, "
        "gradients in flight, optimizer temporaries), measured per rank with the profiler's memory events (the "
        "largest seen over the runs).",
        "Bytes are what gloo itself sent (its own profiler events, ring-algorithm bytes per rank).",
        "",
        f"Ratios (ours = {OURS}), each taken within one run and reported over the runs:",
        "",
        *ratio_table(ratios),
        "",
        "Loss parity (cold phase: every peer starts from the same weights and sees the same global batches; the "
        "loss is the mean over ranks):",
        "",
        *parity_table(results),
        "",
        f"Pass time (our passes only, one training step's graphs, fake process group at 8 ranks): 12 layers "
        f"{passes[12]:.3f} s, 48 layers {passes[48]:.3f} s ({passes[48] / passes[12]:.2f}x).",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {label} | {value:.2f} | {'yes' if value <= limit else 'no'} |" for label, value, limit in targets],
        "",
        *(
            [
                "Compile time (issues 15 and 36; `benchmarks/compile_goals.py`, measured in this run after the peers; "
                "CPU seconds where both are measured, the steadier figure on a shared machine; wall seconds for the "
                "ranks and restarts):",
                "",
                *compile_goals.table(compile_measured),
            ]
            if compile_measured
            else ["Compile-time goals not measured in this run (`--no-compile-goals`)."]
        ),
        "",
        "SimpleFSDP on CPU/gloo: `data_parallel(model, init_device_mesh('cpu', (world,)), mode='fully_shard')` "
        "(no mixed precision: fp32 like every peer), then `torch.compile(model, fullgraph=True)`; Dynamo traces "
        "the DTensor parametrizations into functional collectives, which gloo runs, in one graph. Two harness "
        "adjustments: its `data_parallel` replaces parameters module by module, so the tied head comes out "
        "untied (a second, separately trained copy of the embedding): the suite re-ties "
        "`output._parameters['weight']` to the embedding's DTensor; and it reduces gradients as a sum "
        "(`Partial('sum')`; torchtitan divides its loss by the global token count), so the suite divides the "
        "loss by the world size. With both, its losses match single-process training "
        "(`tests/numerics/test_simple_fsdp_peer.py`, eager and Inductor, and the parity table above). Its "
        "optimizer steps DTensor parameters (eagerly, as in torchtitan), and that cost is in its step time.",
        "",
        "SimpleFSDP's environment (torchtitan is loaded from the installed package at run time, never copied; "
        "without it the suite prints why and measures the other peers):",
        "",
        "```bash",
        SIMPLE_FSDP_RECIPE,
        "```",
    ]
    chart_path = out.with_suffix(".png")
    if chart(results, chart_path):
        lines += ["", f"![ratios against FSDP2 eager]({chart_path.name})"]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
