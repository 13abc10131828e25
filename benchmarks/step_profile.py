"""Where one training step's time goes: fsdp_graph (Inductor) against DDP, from torch.profiler on every rank.

    python benchmarks/step_profile.py [--steps 3] [--warmup 3] [--world 2] [--batch 8] [--no-unscheduled] [--json P]

The benchmark Llama of benchmarks/workload.py on gloo ranks on this machine, AdamW, each peer set up exactly as
benchmarks/suite.py sets it up: fsdp_graph with Inductor, fsdp_graph without scheduling (no prefetch, native
reduce-scatter), and DDP (eager). One peer at a time, from a fresh Dynamo state: warm-up steps (the compile), then
`--steps` unprofiled steps (their median: the step time without the profiler's overhead), then `--steps` steps
under `torch.profiler` (CPU activity). Inductor's C++ kernels are compiled with `cpp.enable_kernel_profile`, so each
appears as a named event (`graph_<id>_cpp_fused_...`).

Each profiled step's time on the main thread is split by the SELF time of every event in it, so the categories add
up to the step: everything under `Optimizer.step`/`zero_grad` is "optimizer"; then matmul, SDPA, Inductor kernels
(data movement only, or compute, from the ops their names list), copies, collective issue and wait (the main thread
blocked on communication nothing hid), other aten ops, the backward call's own self time (autograd engine; DDP's
bucket waits have no event of their own and land there), and wrappers' self time. Also: waits by collective kind,
phases, gloo's threads' busy time (all of the communication), top ops. `--json` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.suite import OURS, PEERS, _Peer  # noqa: E402
from benchmarks.workload import batches, bench_model, llama_loss  # noqa: E402
from fsdp_graph.train.launch import spawn  # noqa: E402

UNSCHEDULED = "fsdp_graph, no scheduling"
STEP = "step_profile::step"
CATEGORIES = (
    "matmul", "attention (SDPA)", "Inductor kernels, data movement only", "Inductor kernels, compute", "copies",
    "collective issue", "collective wait", "optimizer", "other aten ops", "backward, outside any op",
    "framework (wrappers' self time)",
)  # fmt: skip
PHASES = {f"step_profile::{p}": p for p in ("forward", "backward", "optimizer")}
# Inductor kernel names list the ATen ops fused into them: a kernel made of these only moves data.
_MOVES = {"clone", "slice", "view", "unsafe", "cat", "squeeze", "unsqueeze", "transpose", "permute", "expand", "split"}
_KINDS = (("all_gather", "allgather"), ("all_to_all", "alltoall"), ("all_reduce", "allreduce"), ("reduce_scatter",))
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::baddbmm", "aten::_mkl")
_COPIES = (
    "aten::copy_", "aten::cat", "aten::clone", "aten::slice_scatter", "aten::_to_copy", "aten::contiguous",
    "aten::zero_", "aten::fill_", "aten::index", "aten::index_put", "aten::_index_put", "aten::index_select",
    "aten::as_strided_scatter", "aten::select_scatter", "aten::split_with_sizes_copy", "aten::narrow_copy",
    "aten::new_zeros", "aten::zeros", "aten::zeros_like", "aten::stack", "aten::_foreach_copy_", "aten::to",
    "aten::embedding_dense_backward", "aten::scatter", "aten::gather",
)  # fmt: skip
_OPTIMIZER = ("Optimizer.step", "Optimizer.zero_grad")


def categorise(name: str, under_optimizer: bool = False) -> str:
    """The category of one event's self time (`name`: the profiler's event name)."""
    if under_optimizer or name.startswith(_OPTIMIZER):
        return "optimizer"
    lowered = name.lower()
    if "wait" in lowered and ("c10d" in lowered or "work" in lowered or "tensor" in lowered):
        return "collective wait"
    if name.startswith(("_c10d_functional::", "c10d::", "gloo:", "c10d_functional")) or "all_reduce" in lowered:
        return "collective issue"
    if "cpp_fused" in name:
        ops = set(name.split("cpp_fused_", 1)[1].strip("_").split("_")[:-1]) - {""}
        return "Inductor kernels, data movement only" if ops and ops <= _MOVES else "Inductor kernels, compute"
    if name == "step_profile::backward":
        return "backward, outside any op"
    if name.startswith(_MATMUL):
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention (SDPA)"
    if name.startswith(_COPIES):
        return "copies"
    if name.startswith("aten::"):
        return "other aten ops"
    return "framework (wrappers' self time)"


def _kind(name: str) -> str | None:
    return next((spellings[0] for spellings in _KINDS if any(k in name for k in spellings)), None)


def attribute(events) -> dict:
    """Split the profiled steps (`STEP` record_functions) of `events` (torch.profiler FunctionEvents) by category,
    by op and by phase, in microseconds summed over the steps. Each wait is put under the kind of the last
    collective issued before it, and under whether any computation ran between that issue and the wait. Also: what
    other threads (gloo's workers) were busy with during the steps."""
    # One event per step: the profiler can list a record_function twice (seen for the first peer profiled with
    # Inductor's kernel profiling on), which would halve every per-step figure.
    steps = list({(e.thread, e.time_range.start): e for e in events if e.name == STEP}.values())
    by_category: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    waits: dict[str, float] = defaultdict(float)
    last = {"kind": "none", "compute": False}

    def walk(event, under_optimizer: bool) -> None:
        under_optimizer = under_optimizer or event.name.startswith(_OPTIMIZER)
        category = categorise(event.name, under_optimizer)
        by_category[category] += event.self_cpu_time_total
        by_op[f"{category}\t{event.name}"] += event.self_cpu_time_total
        if event.name in PHASES:
            phases[PHASES[event.name]] += event.cpu_time_total
        if category == "collective wait":
            waits[f"{last['kind']}, {'after compute' if last['compute'] else 'right after its issue'}"] += (
                event.cpu_time_total
            )
        elif category == "collective issue" and _kind(event.name):
            last.update(kind=_kind(event.name), compute=False)
        elif category.startswith(("matmul", "attention", "Inductor", "copies", "other aten")):
            last["compute"] = True
        for child in sorted(event.cpu_children, key=lambda e: e.time_range.start):
            walk(child, under_optimizer)

    for step in steps:
        walk(step, False)
    main = {step.thread for step in steps}
    spans = [(s.time_range.start, s.time_range.end) for s in steps]
    other_threads: dict[str, float] = defaultdict(float)
    for event in events:  # top-level events of other threads, clipped to the steps
        if event.thread in main or event.cpu_parent is not None:
            continue
        for start, end in spans:
            overlap = min(end, event.time_range.end) - max(start, event.time_range.start)
            if overlap > 0:
                other_threads[event.name] += overlap
    return {
        "step_us": sum(s.cpu_time_total for s in steps),
        "steps": len(steps),
        "categories": dict(by_category),
        "ops": dict(by_op),
        "phases": dict(phases),
        "waits": dict(waits),
        "other_threads": dict(other_threads),
    }


class _PhasedPeer(_Peer):
    """suite.py's peer, its step's three phases marked for the profiler (these peers' loss divisor is 1)."""

    def step(self) -> torch.Tensor:
        with record_function("step_profile::forward"):
            loss = llama_loss(self.model, next(self.data))
        with record_function("step_profile::backward"):
            loss.backward()
        with record_function("step_profile::optimizer"):
            self.opt.step()
            self.opt.zero_grad()
        return loss.detach()


def profile_peers(rank: int, world: int, args: argparse.Namespace, names: list[str]) -> dict:
    torch._inductor.config.cpp.enable_kernel_profile = True
    torch.manual_seed(0)
    base = bench_model()
    out = {}
    for name in names:
        torch._dynamo.reset()
        peer = _PhasedPeer(PEERS[name], base, batches(args.batch, rank, world, seed=1), distributed=True)
        peer.timed(args.warmup)
        plain = statistics.median(peer.timed(args.steps)[0])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                dist.barrier()
                with record_function(STEP):
                    peer.step()
        out[name] = {"plain_step_s": plain, **attribute(prof.events())}
        if rank == 0:
            print(f"profiled {name} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        del peer
    return out


def _mean_over_ranks(ranks: list[dict]) -> dict:
    """Per peer: ms per step of each figure, the mean over ranks."""
    merged = {}
    for name in ranks[0]:
        per = [r[name] for r in ranks]

        def ms(key: str, per=per) -> dict[str, float]:
            keys = {k for p in per for k in p[key]}
            return {k: statistics.mean(p[key].get(k, 0.0) / p["steps"] / 1e3 for p in per) for k in keys}

        merged[name] = {
            "step_ms": statistics.mean(p["step_us"] / p["steps"] / 1e3 for p in per),
            "plain_step_ms": statistics.mean(p["plain_step_s"] * 1e3 for p in per),
            "categories": ms("categories"),
            "ops": ms("ops"),
            "other_threads": ms("other_threads"),
            "phases": ms("phases"),
            "waits": ms("waits"),
        }
    return merged


def table(merged: dict, top: int) -> list[str]:
    names = list(merged)

    def row(label: str, values: list[float], share: bool = True) -> str:
        cells = [
            f"{v:.1f} ms" + (f" ({100 * v / merged[n]['step_ms']:.0f}%)" if share else "")
            for n, v in zip(names, values)
        ]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = ["| main thread, self time per step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [row(c, [merged[n]["categories"].get(c, 0.0) for n in names]) for c in CATEGORIES]
    lines.append(row("**profiled step**", [merged[n]["step_ms"] for n in names], share=False))
    lines.append(row("step without profiler (median)", [merged[n]["plain_step_ms"] for n in names], share=False))
    lines.append(
        row("gloo's threads busy (all of the communication)", [sum(merged[n]["other_threads"].values()) for n in names])
    )
    lines += [row(f"phase: {p}", [merged[n]["phases"].get(p, 0.0) for n in names]) for p in PHASES.values()]
    kinds = sorted({k for n in names for k in merged[n]["waits"]})
    lines += [row(f"waits: {k}", [merged[n]["waits"].get(k, 0.0) for n in names]) for k in kinds]
    for name in names:
        ops = sorted(merged[name]["ops"].items(), key=lambda kv: -kv[1])[:top]
        lines += ["", f"Top {top} ops by self time, {name} (ms/step, mean over ranks):", ""]
        lines += ["| op | category | ms/step |", "|---|---|---:|"]
        lines += [f"| `{key.split(chr(9))[1]}` | {key.split(chr(9))[0]} | {value:.2f} |" for key, value in ops]
        threads = sorted(merged[name]["other_threads"].items(), key=lambda kv: -kv[1])[:5]
        lines += ["", "Other threads: " + ", ".join(f"`{op}` {value:.1f} ms" for op, value in threads)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (and unprofiled steps) per peer")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (the first compiles)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--top", type=int, default=15, help="ops listed per peer")
    parser.add_argument("--no-unscheduled", action="store_true", help=f"skip the '{UNSCHEDULED}' peer")
    parser.add_argument("--json", help="write the raw numbers (every rank) here")
    args = parser.parse_args()
    names = [OURS, *([] if args.no_unscheduled else [UNSCHEDULED]), "DDP"]
    load_before = os.getloadavg()
    ranks = spawn(profile_peers, args.world, (args, names), timeout_s=1800)
    load_after = os.getloadavg()
    merged = _mean_over_ranks(ranks)
    command = " ".join(["python benchmarks/step_profile.py", *sys.argv[1:]])
    loads = [" / ".join(f"{x:.1f}" for x in load) for load in (load_before, load_after)]
    lines = [
        f"`{command}` on {datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"{args.world} gloo ranks, batch {args.batch} per rank, {args.steps} profiled steps per peer. Load average "
        f"(1/5/15 min) {loads[0]} before, {loads[1]} after.",
        "",
        *table(merged, args.top),
    ]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": ranks, "mean": merged}, indent=1))


if __name__ == "__main__":
    main()
