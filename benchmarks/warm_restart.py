"""Where a warm restart's compile time goes (issue 15): the main job's model, compiled cold, then again in fresh
processes with the same Inductor cache directory.

    python benchmarks/warm_restart.py                    # tiny preset, 2 gloo ranks, 1 cold + 2 warm runs
    python benchmarks/warm_restart.py --preset small --warm-runs 3
    python benchmarks/warm_restart.py --no-reuse-blocks   # the job's --no-reuse-blocks: every layer traced

Each run is a fresh `spawn` of the ranks (a new Python process per rank, as a restarted job): they build the job's
model (`train/job.py`'s `_build`: meta init, fully_shard, torch.compile with the job's backend) and time the first
compiled forward, where all compilation happens (the backward compiles with it: the backend's rank check asks for
it). Rank 0 reports torch's own compile-phase timers (`torch._dynamo.utils.compile_times`), the cache counters
(AOTAutogradCache, Inductor's FX graph cache) and the seconds our passes took (`FSDPBackend.pass_seconds`; zero on
a cache hit, where they do not run). The import of torch and of Inductor is timed separately: a restarted
process pays it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = {  # torch's timer names -> what the table calls them
    "_compile.compile_inner": "Dynamo + backend (all)",
    "bytecode_tracing": "Dynamo tracing",
    "OutputGraph.call_user_compiler": "backend call",
    "AOTAutogradCache.inductor_load": "cache load",
}


def _first_step(rank: int, world: int, argv: list[str]) -> dict:
    import_start = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401  (a restarted process imports it at its first compile)

    imported = time.perf_counter() - import_start
    import torch
    from torch._dynamo.utils import compile_times, counters

    from fsdp_graph.train import job

    args = job.parse_args(argv)
    backend = job._backend(args)
    cfg, _, _, step_model, _ = job._build(args, world, torch.device("cpu"), backend)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    step_model(tokens).float().mean().backward()
    first = time.perf_counter() - start
    timers = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(timers[0], timers[1])) if timers and timers[0] else {}
    passes = sum(backend.pass_seconds.values())
    return {
        "first_step_s": first,
        "import_inductor_s": imported,
        **{label: float(phases.get(name, 0.0)) for name, label in PHASES.items()},
        "our passes": passes,
        "aot_cache": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
        "fx_cache": {k: v for k, v in counters["inductor"].items() if "fxgraph" in k},
    }


def run_all_ranks(argv: list[str], world: int) -> list[dict]:
    """One start of the job's ranks: each rank's figures, in rank order."""
    from fsdp_graph.train.launch import spawn

    return spawn(_first_step, world, (argv,))


def run_once(argv: list[str], world: int) -> dict:
    return run_all_ranks(argv, world)[0]


def main(cli: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--backend-mode", choices=("inductor", "aot"), default="inductor")
    parser.add_argument(
        "--reuse-blocks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the job's --reuse-blocks / --no-reuse-blocks (default: the job's, one block body where eligible)",
    )
    parser.add_argument("--json", help="write every run's figures to this file")
    args = parser.parse_args(cli)
    job_argv = ["--preset", args.preset, "--backend-mode", args.backend_mode, "--batch", "8"]
    job_argv += [] if args.reuse_blocks is None else ["--reuse-blocks" if args.reuse_blocks else "--no-reuse-blocks"]
    cache = tempfile.mkdtemp(prefix="fsdp_graph_warm_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the ranks inherit it: one cache, shared as on a node
    runs = [("cold", run_once(job_argv, args.world))]
    runs += [(f"warm {i + 1}", run_once(job_argv, args.world)) for i in range(args.warm_runs)]
    columns = ["first_step_s", "import_inductor_s", *PHASES.values(), "our passes"]
    print(f"main job's model ({' '.join(job_argv)}, {args.world} gloo ranks), cache {cache}")
    print(f"{'run':8s} " + " ".join(f"{c[:22]:>22s}" for c in columns) + "  caches")
    for name, run in runs:
        figures = " ".join(f"{run[c]:22.2f}" for c in columns)
        print(f"{name:8s} {figures}  aot {run['aot_cache']} fx {run['fx_cache']}")
    warm = [run["first_step_s"] + run["import_inductor_s"] for name, run in runs if name != "cold"]
    if warm:
        print(f"warm restart (first step + Inductor import), median: {statistics.median(warm):.2f} s (goal: 5 s)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
