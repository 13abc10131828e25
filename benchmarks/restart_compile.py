"""Restarts that skip compiling (issue 36): the main job's model restarted from a checkpoint, with Inductor's cache
warm, and on an empty cache with the compiled artifacts the checkpoint carries.

    python benchmarks/restart_compile.py                   # tiny preset, 1 and 2 gloo ranks, 2 restarts of each kind
    python benchmarks/restart_compile.py --worlds 2 --runs 3 --preset small

Every run is a fresh `spawn` of the ranks (a new Python process per rank, as a restarted job), which builds the
job's model (`train/job.py`'s `_build`: meta init, fully_shard, torch.compile with the job's backend):
- cold: an empty Inductor cache; two trained steps (AdamW, as the job), then `save_checkpoint(compiled=backend)`
  (timed, and a save without artifacts for comparison);
- warm: the cold run's cache (populated); `load_checkpoint` without artifacts, then one trained step;
- artifacts: as on a new machine, a new empty cache each time, and a new empty TMPDIR, where torch keeps its
  precompiled C++ header (`/tmp/torchinductor_<user>/precompiled_headers`, whatever the cache directory);
  `load_checkpoint(compiled=backend)`, then one trained step.
A restart's time is rank 0's import of Inductor + the load + the first trained step (forward, backward, optimizer
step), where all compiling happens; the goal is artifacts <= 1.3x warm (medians). The table also gives torch's cache
counters, the C++ compiler runs (kernel libraries and precompiled headers) and the seconds the backend spent
recording its compiles' files (`compiled_files.recording`, outside the compile itself, and the graph's key).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL = 1.3


class _Builds:
    """C++ compiler runs in this process, by what they made: kernel libraries (.so), precompiled headers, others."""

    def __init__(self) -> None:
        from torch._inductor import cpp_builder

        self.counts = {"so": 0, "gch": 0, "other": 0}
        build = cpp_builder.CppBuilder.build

        def counted(builder, *args, **kwargs):
            target = builder.get_target_file_path()
            kind = "so" if target.endswith(".so") else "gch" if target.endswith((".gch", ".pch")) else "other"
            self.counts[kind] += 1
            return build(builder, *args, **kwargs)

        cpp_builder.CppBuilder.build = counted


def _timed_recording() -> list[float]:
    """Makes `compiled_files.recording` add its own seconds (the capture, not the compile inside) to the list, and
    the graph's key (`rank_check.STORE.key`, which a single rank computes only to record)."""
    from fsdp_graph.compiler import compiled_files
    from fsdp_graph.compiler.rank_check import STORE

    spent = [0.0]
    recording, key = compiled_files.recording, STORE.key

    def timed_key(*args, **kwargs):
        began = time.perf_counter()
        try:
            return key(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - began

    STORE.key = timed_key

    @contextlib.contextmanager
    def timed():
        began = time.perf_counter()
        inside = 0.0
        with recording() as files:
            entered = time.perf_counter()
            try:
                yield files
            finally:
                inside = time.perf_counter() - entered
        spent[0] += time.perf_counter() - began - inside

    compiled_files.recording = timed
    return spent


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (torch's probes, g++), user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _rank(rank: int, world: int, argv: list[str], checkpoint: str, kind: str) -> dict:
    cpu_began = _cpu_s()
    began = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401  (a restarted process imports it at its first compile)

    imported = time.perf_counter() - began
    import torch
    from torch._dynamo.utils import counters

    import fsdp_graph
    from fsdp_graph.train import job
    from fsdp_graph.train.corpus import batch_at, load_tokens
    from fsdp_graph.train.llama import llama_loss

    builds = _Builds()
    recorded_s = _timed_recording()
    args = job.parse_args(argv)
    backend = job._backend(args)
    _, model, opt, step_model, (dp, dp_rank) = job._build(args, world, torch.device("cpu"), backend)
    tokens = load_tokens()

    def step(n: int) -> float:
        start = time.perf_counter()
        llama_loss(step_model, batch_at(tokens, n, args.seed, args.batch, args.seq, dp_rank, dp)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    out: dict = {"import_s": imported, "load_s": 0.0}
    if kind == "cold":
        out["first_step_s"] = step(0)
        step(1)
        start = time.perf_counter()
        fsdp_graph.save_checkpoint(checkpoint + "_plain", model, opt)
        out["save_plain_s"] = time.perf_counter() - start
        start = time.perf_counter()
        fsdp_graph.save_checkpoint(checkpoint, model, opt, compiled=backend)
        out["save_s"] = time.perf_counter() - start
        compiled = Path(checkpoint, "compiled")
        out["artifact_bytes"] = sum(f.stat().st_size for f in compiled.rglob("*") if f.is_file())
        out["artifact_files"] = sum(1 for f in compiled.rglob("*") if f.is_file())
    else:
        start = time.perf_counter()
        fsdp_graph.load_checkpoint(checkpoint, model, opt, compiled=backend if kind == "artifacts" else None)
        out["load_s"] = time.perf_counter() - start
        out["first_step_s"] = step(2)
    out["restart_s"] = out["import_s"] + out["load_s"] + out["first_step_s"]
    out["cpu_s"] = _cpu_s() - cpu_began - (out.get("save_s", 0.0) + out.get("save_plain_s", 0.0))  # not the saves
    out["recording_s"] = recorded_s[0]
    out["restored"] = dict(backend.restored)
    out["aot"] = {k.removeprefix("autograd_cache_"): v for k, v in counters["aot_autograd"].items() if "cache" in k}
    out["fx"] = {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items() if "fxgraph" in k}
    out["builds"] = builds.counts
    return out


def _start(argv: list[str], world: int, checkpoint: str, kind: str, cache: str, tmp: str | None = None) -> dict:
    """One start of the ranks with `cache` as Inductor's cache directory (and `tmp` as TMPDIR: torch keeps its
    precompiled C++ headers under the temporary directory, not the cache directory)."""
    from fsdp_graph.train.launch import spawn

    saved = dict(os.environ)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the ranks inherit it: one cache, shared as on a node
    if tmp is not None:
        os.makedirs(tmp, exist_ok=True)
        os.environ["TMPDIR"] = tmp
    try:
        return spawn(_rank, world, (argv, checkpoint, kind), timeout_s=1800)[0]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def measure(argv: list[str], world: int, runs: int) -> list[tuple[str, dict]]:
    work = Path(tempfile.mkdtemp(prefix="fsdp_graph_restart_"))
    checkpoint, warm_cache = str(work / "ckpt"), str(work / "cache_warm")
    try:
        results = [("cold", _start(argv, world, checkpoint, "cold", warm_cache))]
        for i in range(runs):  # interleaved, so a change in the machine's load touches both kinds alike
            results.append((f"warm {i + 1}", _start(argv, world, checkpoint, "warm", warm_cache)))
            empty, tmp = str(work / f"cache_empty_{i}"), str(work / f"tmp_empty_{i}")  # a new machine's
            results.append((f"artifacts {i + 1}", _start(argv, world, checkpoint, "artifacts", empty, tmp)))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(world: int, results: list[tuple[str, dict]]) -> dict:
    print(f"\n{world} rank(s), rank 0 (seconds)")
    header = f"{'run':12s} {'import':>7s} {'load':>6s} {'step 1':>7s} {'restart':>8s} {'CPU s':>6s} {'record':>7s}"
    print(f"{header}  caches, C++ runs")
    for name, r in results:
        print(
            f"{name:12s} {r['import_s']:7.2f} {r['load_s']:6.2f} {r['first_step_s']:7.2f} {r['restart_s']:8.2f} "
            f"{r['cpu_s']:6.2f} {r['recording_s']:7.3f}  aot {r['aot']} fx {r['fx']} builds {r['builds']} "
            f"restored {r['restored']}"
        )
    cold = results[0][1]

    def median(kind: str, figure: str) -> float:
        return statistics.median(r[figure] for n, r in results if n.startswith(kind))

    warm, artifacts = median("warm", "restart_s"), median("artifacts", "restart_s")
    ratio = artifacts / warm
    verdict = "met" if ratio <= GOAL else "missed"
    print(
        f"cold start {cold['restart_s']:.2f} s; warm restart {warm:.2f} s; empty cache + artifacts {artifacts:.2f} s: "
        f"{ratio:.2f}x warm (goal <= {GOAL}x: {verdict}); CPU seconds {median('warm', 'cpu_s'):.2f} warm, "
        f"{median('artifacts', 'cpu_s'):.2f} with artifacts"
    )
    print(
        f"save: {cold['save_s']:.2f} s with artifacts ({cold['artifact_files']} files, "
        f"{cold['artifact_bytes'] / 2**20:.2f} MiB), {cold['save_plain_s']:.2f} s without"
    )
    return {"world": world, "runs": dict(results), "warm_s": warm, "artifacts_s": artifacts, "ratio": ratio}


def main(cli: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=2, help="restarts of each kind (warm, artifacts)")
    parser.add_argument("--json", help="write every run's figures to this file")
    args = parser.parse_args(cli)
    job_argv = ["--preset", args.preset, "--batch", "8"]
    print(f"main job's model ({' '.join(job_argv)}, Inductor), load average {os.getloadavg()[0]:.1f} at the start")
    summaries = [report(world, measure(job_argv, world, args.runs)) for world in args.worlds]
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
