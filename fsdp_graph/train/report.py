"""What `python -m fsdp_graph train` reports: peak memory, collectives per step, the summary table, the loss curve,
and the loss history kept beside checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_graph.planning.measure import ExecutedCollectives
from fsdp_graph.runtime.devices import backend_for, collective_device
from fsdp_graph.train.corpus import VOCAB

_MIB = 2**20


def local_peak_memory(device: torch.device) -> tuple[int, str]:
    """This rank's peak memory so far in bytes, and what was measured: on CUDA the allocator's peak
    (`max_memory_allocated`), on CPU the process's maximum resident set size (`getrusage`), which also counts
    the Python interpreter, torch's libraries and compiled kernels, not tensors alone."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "max RSS of the process"


def gather_per_rank(value: int, device: torch.device) -> list[int]:
    """Every rank's `value` (collective)."""
    mine = torch.tensor([float(value)], dtype=torch.float64, device=collective_device(None, device))
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(v.item()) for v in out]


def collectives_line(executed: ExecutedCollectives | None) -> str:
    """'10 all_gather, 5 all_to_all; 1.23 MiB sent per rank' for one profiled step. The compiled step's own
    collectives (`_c10d_functional`) when there are any, else what the process group ran (the eager path)."""
    if executed is None:
        return "not measured (fewer than 3 steps)"
    if executed.counts:
        counts, sent = executed.counts, executed.total_wire_bytes
    else:
        counts, sent = executed.backend_counts, sum(executed.backend_wire_bytes.values())
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    return f"{kinds or 'none'}; {sent / _MIB:.2f} MiB sent per rank"


@dataclass
class RunStats:
    """Per-step measurements of one run (this process's steps only; `history` includes resumed ones)."""

    history: list[tuple[int, float]] = field(default_factory=list)  # (step number, 1-based; mean loss over ranks)
    step_s: list[float] = field(default_factory=list)  # wall time of each step of this run
    profiled: int | None = None  # index into step_s of the step run under the profiler (slower; not timed)
    skipped: list[int] = field(default_factory=list)  # steps not applied: non-finite loss or gradients

    def timed_steps(self) -> list[float]:
        """Step times without the first (compilation) and the profiled step, when enough remain."""
        rest = [t for i, t in enumerate(self.step_s) if i != 0 and i != self.profiled]
        return rest or self.step_s

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.timed_steps()) if self.step_s else float("nan")


def table(title: str, rows: list[tuple[str, str]]) -> str:
    """A two-column plain-text table."""
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    lines = [title, rule, *(f"{k.ljust(width)}  {v}" for k, v in rows), rule]
    return "\n".join(lines)


def history_bytes(history: list[tuple[int, float]]) -> bytes:
    """The loss history as JSON: [[step, loss], ...]."""
    return json.dumps([[step, loss] for step, loss in history]).encode()


def parse_history(data: bytes) -> list[tuple[int, float]]:
    """`history_bytes`' inverse; ValueError if `data` is not such a list (truncated, damaged)."""
    try:
        return [(int(s), float(v)) for s, v in json.loads(data)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a loss history ({type(e).__name__}: {e})") from None


def save_history(path: str, history: list[tuple[int, float]]) -> None:
    """Write the loss history as JSON, atomically (a crash leaves the previous file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(history_bytes(history))
    os.replace(tmp, path)


def load_history(path: str, upto_step: int) -> list[tuple[int, float]]:
    """The saved losses of steps 1..upto_step (a later crash may have saved more than the checkpoint holds)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        return [(s, v) for s, v in parse_history(f.read()) if s <= upto_step]


def plot_losses(path: str, history: list[tuple[int, float]], title: str) -> str:
    """Save the loss curve as a PNG at `path`. Returns a line for the summary: the path, or why not."""
    try:
        from matplotlib.figure import Figure  # optional: pip install "fsdp_graph[plot]"
    except ImportError:
        return "not drawn: matplotlib is not installed (pip install matplotlib)"
    if not history:
        return "not drawn: no steps"
    fig = Figure(figsize=(6.4, 4.0), layout="tight")
    ax = fig.add_subplot()
    ax.plot([s for s, _ in history], [v for _, v in history], linewidth=1.2)
    ax.set(xlabel="step", ylabel="loss (cross entropy, nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def describe(args: argparse.Namespace, world: int, device: torch.device) -> str:
    """One line: ranks, process group, device, strategy, precision, compile mode."""
    mode = f"compiled ({args.backend_mode})" if args.compile else "eager (not compiled)"
    precision = "bf16 params, fp32 reduce" if args.mixed_precision == "bf16" else "fp32"
    offload = ", CPU offload" if getattr(args, "cpu_offload", False) else ""
    pp = getattr(args, "pp", 1)
    pipeline = ""
    if pp > 1:
        pipeline = f" as pp={pp} x dp={world // pp} ({args.pp_schedule}, {args.microbatches} microbatches)"
    tp = getattr(args, "tp", 1)
    if tp > 1:
        pipeline = f" as dp={world // tp} x tp={tp}"
    ranks = f"{world} ranks ({backend_for(None, device)}, {device.type}){pipeline}"
    return f"{ranks}, {args.strategy}, {precision}{offload}, {mode}"


def _skipped_line(args, skipped: list[int]) -> str:
    mode = getattr(args, "nonfinite", "off")
    if mode == "off":
        return "not checked (--nonfinite off)"
    if not skipped:
        return "none"
    return f"{len(skipped)} skipped (steps {', '.join(map(str, skipped))}; --nonfinite {mode})"


def summarise(args, cfg, world, device, start, stats: RunStats, executed, memory, memory_what, checkpoint) -> dict:
    """Print the summary table and draw the loss curve (rank 0); returns the numbers as a dict."""
    if not stats.step_s:
        print(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}", flush=True)
        return {"steps_run": 0, "start_step": start}
    dp = world // getattr(args, "pp", 1) // getattr(args, "tp", 1)  # the stages or tp ranks of one see the same tokens
    tokens_per_step = args.batch * args.seq * dp
    median = stats.median_step_s
    compile_s = stats.step_s[0] - median if args.compile else None
    title = f"Llama {args.preset}\n{describe(args, world, device)}"
    plot = plot_losses(args.plot, stats.history, title) if args.plot.lower() != "none" else "off (--plot none)"
    (first_step, first), (last_step, last) = (stats.history[0], stats.history[-1]) if stats.history else ((0, 0.0),) * 2
    rows = [
        ("model", f"Llama {args.preset}: {cfg.num_params() / 1e6:.2f} M params, byte-level vocab {VOCAB}"),
        ("run", describe(args, world, device)),
        (
            "tokens per step",
            f"{tokens_per_step:,} ({args.batch}x{args.seq} per {'pipeline' if dp < world else 'rank'})",
        ),
        ("steps", f"{start + 1} -> {start + len(stats.step_s)} ({len(stats.step_s)} in this run)"),
        (
            "loss",
            f"{first:.4f} -> {last:.4f} (step {first_step} -> {last_step})" if stats.history else "no step applied",
        ),
        ("median step time", f"{median:.3f} s"),
        ("tokens/s", f"{tokens_per_step / median:,.0f} (all ranks)"),
        (
            "peak memory per rank",
            ", ".join(f"r{r} {b / 2**20:,.0f} MiB" for r, b in enumerate(memory)) + f" ({memory_what})",
        ),
        ("collectives per step", collectives_line(executed)),
        ("compile time", f"{compile_s:.1f} s (first step minus median)" if compile_s is not None else "none (eager)"),
        ("non-finite steps", _skipped_line(args, stats.skipped)),
        ("checkpoint", checkpoint or "none (no --checkpoint-dir)"),
        ("loss curve", plot),
    ]
    print(table("summary", rows), flush=True)
    return {
        "start_step": start,
        "steps_run": len(stats.step_s),
        "history": stats.history,
        "first_loss": first,
        "last_loss": last,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "peak_memory_bytes": memory,
        "collectives": dict(executed.counts) if executed else None,
        "compile_s": compile_s,
        "checkpoint": checkpoint,
        "skipped": stats.skipped,
        "plot": plot,
    }
