"""The parts of `benchmarks/gpu.py` that need no GPU (tested on CPU in tests/graphs/test_gpu_script.py): the
command line, a profiler trace's kernels as communication and compute intervals, their overlap, the timeline
picture, the one-line figures printed as each section ends, and the markdown and JSON reports."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

Interval = tuple[float, float]  # (start, end) in microseconds, as in a Chrome trace

SECTIONS = ("train", "plan", "offload", "overlap", "hybrid", "compress", "job1b")
ORDER = ("train", "job1b", "offload", "hybrid", "compress", "plan", "overlap")  # the order they run in
OUT_DIR_ENV = "FSDP_GRAPH_GPU_OUT"  # a folder: the report, its JSON and the timeline picture go there
_MIB = 2**20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line. `--steps`, `--plan-seq` and the section time limit default by `--quick`."""
    p = argparse.ArgumentParser(prog="benchmarks/gpu.py", description="fsdp_graph on one GPU: writes a markdown report")
    p.add_argument("--quick", action="store_true", help="a short run: 8 steps per run, 512-token sequences for 1b")
    p.add_argument(
        "--out",
        default=None,
        help=f"the report; its figures go beside it as .json, the timeline as -timeline.png (default: "
        f"benchmarks-gpu.md in the folder ${OUT_DIR_ENV} names, else docs/benchmarks-gpu.md)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: 30; --quick: 8)")
    p.add_argument("--plan-seq", type=int, default=None, help="tokens per sequence of the 1b run (2048; --quick: 512)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run only these sections")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for everything; a section past it is reported as not run "
        "(default: 470, under the 8 minutes promised; --quick: 360)",
    )
    p.add_argument("--child", choices=("train", "plain", "plan", "overlap"), help=argparse.SUPPRESS)
    p.add_argument("--params", default="{}", help=argparse.SUPPRESS)  # the child's parameters, JSON
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # where the child writes its result, JSON
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(os.environ.get(OUT_DIR_ENV) or "docs", "benchmarks-gpu.md")
    if args.steps is None:
        args.steps = 8 if args.quick else 30
    if args.steps < 3:
        p.error("--steps must be at least 3 (the first compiles, the last is profiled)")
    if args.plan_seq is None:
        args.plan_seq = 512 if args.quick else 2048
    if args.budget is None:
        args.budget = 360.0 if args.quick else 470.0
    return args


def gpu_preset(device_name: str) -> str:
    """The `passes.hardware.GPUS` preset `explain()` and `plan()` cost a CUDA device with ("NVIDIA H200" -> "h200";
    any H100 -> the SXM "h100"), else the generic flat "nvlink"."""
    name = device_name.lower()
    return next((preset for preset in ("h200", "h100", "b200", "a100") if preset in name), "nvlink")


def kernel_intervals(trace: dict | list) -> tuple[list[Interval], list[Interval]]:
    """(communication, compute) GPU kernel intervals of a Chrome trace (`torch.profiler`'s `export_chrome_trace`).
    Communication: NCCL's kernels (`ncclDevKernel_*`, `ncclKernel_*`). Compute: every other kernel. Memory copies
    and sets are neither (CPU offload's copies are not the communication this measures)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    comm, compute = [], []
    for event in events:
        if event.get("ph") != "X" or event.get("cat") != "kernel" or "dur" not in event:
            continue
        start = float(event["ts"])
        interval = (start, start + float(event["dur"]))
        (comm if "nccl" in event.get("name", "").lower() else compute).append(interval)
    return comm, compute


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by both `a` and `b`."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_fraction(comm: Sequence[Interval], compute: Sequence[Interval]) -> float | None:
    """The share of communication time during which some compute kernel runs too (None: no communication)."""
    total = length(comm)
    return length(intersection(comm, compute)) / total if total else None


def draw_timeline(comm: Sequence[Interval], compute: Sequence[Interval], path: str, title: str) -> bool:
    """A two-lane PNG (compute, communication) of the kernels, in ms from the first one. False without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    origin = min((s for s, _ in [*comm, *compute]), default=0.0)
    fig = Figure(figsize=(11, 2.6), layout="tight")
    ax = fig.add_subplot()
    for lane, (intervals, color) in enumerate(((compute, "tab:blue"), (comm, "tab:orange"))):
        spans = [((s - origin) / 1e3, (e - s) / 1e3) for s, e in union(intervals)]
        ax.broken_barh(spans, (lane - 0.4, 0.8), color=color)
    ax.set_yticks([0, 1], ["compute", "NCCL"])
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return True


def _mib(value: float) -> str:
    return f"{value / _MIB:,.0f} MiB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


_PENDING = "pending"  # a section `render_markdown` is told is still to run


def _error(name: str, result: dict | None) -> list[str] | None:
    if result is _PENDING:
        return ["Not measured yet: the run ended (or was cut short) before this section."]
    if result is None:
        return [f"Not run (`--only` left out {name})."]
    if "error" in result:
        return ["**Failed**, so nothing was measured:", "", "```", str(result["error"]).strip()[-3000:], "```"]
    return None


def _train_section(result: dict | None) -> list[str]:
    lines = ["## 1. The main job: `fsdp_graph train`, Llama `small`, bf16, world 1 (NCCL)", ""]
    failed = _error("train", result)
    if failed:
        return lines + failed
    ours, plain = result["ours"], result["plain"]
    lines += [
        "Ours: `python -m fsdp_graph train --preset small --mixed-precision bf16` as one torchrun rank (NCCL), i.e.",
        "`fully_shard` + `torch.compile(backend=fsdp_backend)`. Plain: the same model, data, AdamW and clipping with",
        "plain `torch.compile` and no FSDP, bf16 by `torch.autocast` over fp32 weights (ours keeps fp32 master",
        "shards and computes with bf16 copies). Step time: median after the compiling first step (the job's own",
        "measure); peak: `torch.cuda.max_memory_allocated` over the run.",
        "",
        "| run | median step | vs plain | peak CUDA memory | vs plain | compile | loss first -> last |",
        "|---|---|---|---|---|---|---|",
    ]
    return lines + _pair_rows(
        ours, plain, lambda r: f"{_mib(r['peak_bytes'])} | {_ratio(r['peak_bytes'], plain['peak_bytes'])}"
    )


def _pair_rows(ours: dict, plain: dict, middle) -> list[str]:
    """A row each for ours and plain: the run, its step and ratio to plain's, `middle(run)`'s cells, compile, loss."""
    return [
        f"| {name} | {r['median_step_s'] * 1e3:.1f} ms | {_ratio(r['median_step_s'], plain['median_step_s'])} "
        f"| {middle(r)} | {r['compile_s']:.1f} s | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |"
        for name, r in (("fsdp_graph (ours)", ours), ("plain torch.compile", plain))
    ]


def _job1b_section(result: dict | None) -> list[str]:
    lines = ["## 7. The main job at Llama `1b`: bf16, world 1 (NCCL), against plain `torch.compile`", ""]
    failed = _error("job1b", result)
    if failed:
        return lines + failed
    ours, plain = result["ours"], result["plain"]
    tokens = ours["tokens_per_step"]
    lines += [
        f"Section 1's two runs with `--preset 1b --batch {ours['batch']} --seq {ours['seq']}` ({tokens:,} tokens a "
        "step, AdamW, clipping): a size where the GPU's",
        "compute, not the host's launch overhead, sets the step time. Reserved: `torch.cuda.max_memory_reserved`, the",
        "caching allocator's segments (what a published table of GPU memory reports).",
        "",
        "| run | median step | vs plain | tokens/s | peak allocated | peak reserved | compile | loss first -> last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return lines + _pair_rows(
        ours,
        plain,
        lambda r: f"{tokens / r['median_step_s']:,.0f} | {_mib(r['peak_bytes'])} | {_mib(r['reserved_bytes'])}",
    )


def _plan_section(result: dict | None) -> list[str]:
    lines = ["## 2. Llama `1b` as rank 0 of 8 (fake process group) on this GPU, against `explain()`", ""]
    failed = _error("plan", result)
    if failed:
        return lines + failed
    r = result
    error = r["predicted_peak_bytes"] / r["peak_bytes"] - 1 if r["peak_bytes"] else float("nan")
    lines += [
        f"Llama 1b ({r['params'] / 1e9:.2f} B params), FULL_SHARD over a fake group of 8 (collectives move no data,",
        "so memory and compute are rank 0's of a real 8-GPU run, communication is free), bf16 mixed precision,",
        f"batch {r['batch']} x {r['seq']} tokens, Inductor. One forward + backward (the optimizer is not in the",
        "plan): measured peak above the step's start (`max_memory_allocated`, median of the timed steps) against",
        f"`explain(..., hardware='{r.get('hardware', 'nvlink')}').memory.peak_bytes`.",
        "",
        "| quantity | measured | explain() | error |",
        "|---|---|---|---|",
        f"| peak memory above the step's start | {_mib(r['peak_bytes'])} | {_mib(r['predicted_peak_bytes'])} "
        f"| {100 * error:+.1f}% |",
        f"| persistent (shards, buffers, batch) | {_mib(r['persistent_bytes'])} "
        f"| {_mib(r['predicted_persistent_bytes'])} | |",
        f"| forward + backward time | {r['step_s'] * 1e3:.1f} ms | {r['predicted_compute_s'] * 1e3:.1f} ms "
        f"(compute only) | {_ratio(r['predicted_compute_s'], r['step_s'])} |",
        f"| with NVLink communication | not measurable here | {r['predicted_step_s'] * 1e3:.1f} ms | |",
        f"| compile (first step minus median) | {r['compile_s']:.1f} s | | |",
    ]
    return lines


def _offload_section(result: dict | None) -> list[str]:
    lines = ["## 3. CPU offload: device memory saved", ""]
    failed = _error("offload", result)
    if failed:
        return lines + failed
    base, on = result["off"], result["on"]
    saved = base["peak_bytes"] - on["peak_bytes"]
    lines += [
        "Section 1's job without and with `--cpu-offload` (`CPUOffload(offload_params=True)`: fp32 shards, gradients",
        "and AdamW state in pinned CPU memory, gathers and compute on the GPU).",
        "",
        "| run | peak CUDA memory | median step |",
        "|---|---|---|",
        f"| without offload | {_mib(base['peak_bytes'])} | {base['median_step_s'] * 1e3:.1f} ms |",
        f"| `--cpu-offload` | {_mib(on['peak_bytes'])} | {on['median_step_s'] * 1e3:.1f} ms |",
        "",
        f"Saved: {_mib(saved)} ({100 * saved / base['peak_bytes']:.1f}% of the peak), for "
        f"{_ratio(on['median_step_s'], base['median_step_s'])} the step time.",
    ]
    return lines


def _overlap_section(result: dict | None) -> list[str]:
    lines = ["## 4. Communication / compute overlap (profiler trace)", ""]
    failed = _error("overlap", result)
    if failed:
        return lines + failed
    r = result
    if r["comm_ms"] == 0:
        lines.append(
            f"World {r['world']}: no NCCL kernel ran in the profiled step (a group of one has nothing to gather or "
            "reduce, and two ranks cannot share one GPU under NCCL), so overlap was not observable on this machine; "
            "it needs 2+ GPUs."
        )
    else:
        lines.append(
            f"World {r['world']} (NCCL), `small` preset, one profiled training step on rank 0: NCCL kernels "
            f"{r['comm_ms']:.1f} ms, compute kernels {r['compute_ms']:.1f} ms; {100 * r['overlap_fraction']:.0f}% of "
            "the NCCL time had a compute kernel running at the same time."
        )
    if r.get("png"):
        lines += ["", f"![kernel timeline of one step]({r['png']})"]
    return lines


def _sent(run: dict, *kinds: str) -> str:
    return _mib(sum(run["sent_bytes"].get(kind, 0) for kind in kinds))


_SMALL_RUNS = [
    "One GPU under NCCL is a world of 1, which sends nothing (no collective is emitted for one rank, so compression",
    "has nothing to compress) and where a (1, 1) HYBRID mesh shards and replicates nothing. So these runs are rank",
    "0 of a fake group of 8 on this GPU: collectives move no data, so the figures are one rank's memory, compute",
    "and bytes sent (ring algorithms, from the executed collectives' shapes) with communication free. Llama small,",
    "bf16, Inductor, forward + backward (no optimizer); step: median of the timed steps; peak: above the step's",
    "start; explain(): its plan of the same step, with this GPU's preset and NVLink inside one node.",
]


def _hybrid_section(result: dict | None) -> list[str]:
    lines = ["## 5. HYBRID_SHARD against FULL_SHARD: Llama `small` as rank 0 of 8 (fake process group)", ""]
    failed = _error("hybrid", result)
    if failed:
        return lines + failed
    full, hybrid = result["FULL_SHARD"], result["HYBRID_SHARD"]
    lines += [
        *_SMALL_RUNS,
        "",
        "HYBRID_SHARD on a (2 replicas, 4 shards) mesh holds 1/4 of each parameter, FULL_SHARD over 8 ranks 1/8;",
        f"HYBRID adds an all-reduce of each gradient shard over the 2 replicas. Batch {full['batch']} x "
        f"{full['seq']} tokens.",
        "",
        "| strategy | forward + backward | vs FULL_SHARD | peak above start | persistent | sent: gathers "
        "| sent: reductions | explain() peak | explain() step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("FULL_SHARD", full), ("HYBRID_SHARD", hybrid)):
        lines.append(
            f"| {name} | {r['step_s'] * 1e3:.1f} ms | {_ratio(r['step_s'], full['step_s'])} | {_mib(r['peak_bytes'])} "
            f"| {_mib(r['persistent_bytes'])} | {_sent(r, 'all_gather')} "
            f"| {_sent(r, 'reduce_scatter', 'all_to_all', 'all_reduce')} | {_mib(r['predicted_peak_bytes'])} "
            f"| {r['predicted_step_s'] * 1e3:.1f} ms |"
        )
    return lines


def _compress_section(result: dict | None) -> list[str]:
    lines = ["## 6. Compressed collectives: `compress=weights=int8,grads=int8` (the job's `--compress`)", ""]
    failed = _error("compress", result)
    if failed:
        return lines + failed
    off, on = result["off"], result["on"]
    lines += [
        "Measured as section 5 (rank 0 of a fake group of 8 on this GPU: world 1 emits no collective, so there would",
        "be nothing to compress): its FULL_SHARD run without and with int8 weight gathers and int8 gradient",
        "all-to-alls (ZeRO++'s qwZ and qgZ). The step time is the cost of quantizing; the bandwidth saved is not",
        "measured here (explain() predicts it).",
        "",
        "| run | forward + backward | vs uncompressed | peak above start | sent: gathers | sent: gradients "
        "| explain() step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in (("uncompressed", off), ("int8 weights and gradients", on)):
        lines.append(
            f"| {name} | {r['step_s'] * 1e3:.1f} ms | {_ratio(r['step_s'], off['step_s'])} | {_mib(r['peak_bytes'])} "
            f"| {_sent(r, 'all_gather')} | {_sent(r, 'reduce_scatter', 'all_to_all')} "
            f"| {r['predicted_step_s'] * 1e3:.1f} ms |"
        )
    return lines


def render_markdown(results: dict, meta: dict) -> str:
    """The report. `results` maps a section name to its result (missing: not run; `{"error": ...}`: failed);
    `meta` has `date`, `device`, `torch`, `command`, `elapsed_s` and `quick`, and `pending`: the sections still
    to run (the report is rewritten after each section, so a run cut short leaves what it measured)."""
    pending = set(meta.get("pending", ()))
    sections = {name: _PENDING if name in pending else results.get(name) for name in SECTIONS}
    state = f", {len(pending)} section(s) still to run" if pending else ""
    lines = [
        "# fsdp_graph on a GPU",
        "",
        f"Written by `{meta['command']}` on {meta['date']} in {meta['elapsed_s']:.0f} s"
        f"{' (--quick: short runs)' if meta['quick'] else ''}{state}.",
        f"Device: {meta['device']}; torch {meta['torch']}.",
        "",
        *_train_section(sections["train"]),
        "",
        *_plan_section(sections["plan"]),
        "",
        *_offload_section(sections["offload"]),
        "",
        *_overlap_section(sections["overlap"]),
        "",
        *_hybrid_section(sections["hybrid"]),
        "",
        *_compress_section(sections["compress"]),
        "",
        *_job1b_section(sections["job1b"]),
    ]
    return "\n".join(lines) + "\n"


def write_reports(out: str | Path, results: dict, meta: dict) -> tuple[Path, Path]:
    """Write the markdown report to `out` and the figures, `{"meta": ..., "results": ...}`, beside it as `.json`
    (each replaced whole, so a reader never sees half a file). Returns both paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = out.with_suffix(".json")
    for path, text in (
        (out, render_markdown(results, meta)),
        (figures, json.dumps({"meta": meta, "results": results}, indent=1)),
    ):
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        os.replace(partial, path)
    return out, figures


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def child_line(kind: str, result: dict) -> str:
    """One measuring child's figures, printed as soon as it ends."""
    if "error" in result:
        return f"{kind}: failed: {str(result['error']).strip().splitlines()[-1][:300]}"
    if kind in ("train", "plain"):
        return (
            f"{kind}: median step {_ms(result['median_step_s'])}, peak {_mib(result['peak_bytes'])}, "
            f"compile {result['compile_s']:.1f} s, loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}"
        )
    if kind == "plan":
        return (
            f"plan ({result['strategy']}{', ' + result['compress'] if result.get('compress') else ''}, "
            f"{result['params'] / 1e6:.0f} M params): step {_ms(result['step_s'])}, peak {_mib(result['peak_bytes'])} "
            f"(explain() {_mib(result['predicted_peak_bytes'])}), compile {result['compile_s']:.1f} s"
        )
    if kind == "overlap":
        return (
            f"overlap: world {result['world']}, NCCL {result['comm_ms']:.1f} ms, compute {result['compute_ms']:.1f} ms"
        )
    return f"{kind}: {result}"


def headline(section: str, result: dict) -> str:
    """A section's figure in one line, printed as soon as the section ends."""
    if "error" in result:
        return f"[{section}] FAILED: {str(result['error']).strip().splitlines()[-1][:300]}"
    if section in ("train", "job1b"):
        ours, plain = result["ours"], result["plain"]
        return (
            f"[{section}] step {_ms(ours['median_step_s'])} against plain torch.compile's {_ms(plain['median_step_s'])} "
            f"({_ratio(ours['median_step_s'], plain['median_step_s'])}); peak {_mib(ours['peak_bytes'])} against "
            f"{_mib(plain['peak_bytes'])} ({_ratio(ours['peak_bytes'], plain['peak_bytes'])})"
        )
    if section == "offload":
        off, on = result["off"], result["on"]
        saved = off["peak_bytes"] - on["peak_bytes"]
        share = f" ({100 * saved / off['peak_bytes']:.1f}%)" if off["peak_bytes"] else ""
        return (
            f"[offload] peak {_mib(off['peak_bytes'])} -> {_mib(on['peak_bytes'])}: saves {_mib(saved)}{share}, "
            f"step {_ratio(on['median_step_s'], off['median_step_s'])}"
        )
    if section in ("plan", "hybrid", "compress"):
        runs = {"1b": result} if section == "plan" else result
        parts = []
        for name, r in runs.items():
            error = f" ({100 * (r['predicted_peak_bytes'] / r['peak_bytes'] - 1):+.1f}%)" if r["peak_bytes"] else ""
            parts.append(
                f"{name}: step {_ms(r['step_s'])}, peak {_mib(r['peak_bytes'])} against explain()'s "
                f"{_mib(r['predicted_peak_bytes'])}{error}"
            )
        return f"[{section}] " + "; ".join(parts)
    if section == "overlap":
        if not result["comm_ms"]:
            return f"[overlap] world {result['world']}: no NCCL kernel ran (needs 2+ GPUs), nothing to overlap"
        return (
            f"[overlap] world {result['world']}: compute hides {100 * result['overlap_fraction']:.0f}% of "
            f"{result['comm_ms']:.1f} ms of NCCL kernels"
        )
    return f"[{section}] {result}"
