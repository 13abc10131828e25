"""Convergence with compressed collectives (issue 26): the main job's tiny preset, uncompressed vs compressed.

    python benchmarks/convergence.py [--steps 1000] [--out docs] [--runs none int8 weights=fp8,grads=int4]

Each run is `python -m fsdp_graph train --preset tiny --steps N --seed S --compress ...` (2 gloo ranks, FULL_SHARD,
fp32, Inductor, AdamW: the job's defaults) in a fresh process, with its checkpoint directory in a temporary folder:
the loss curve is read from the job's own loss log there (`history.json`: step, mean loss over the ranks). Every run
sees the same seed, so the same initial weights and the same batches in the same order; the only difference is the
quantization. Writes OUT/convergence.md (final-loss ratios to the uncompressed run: the mean of the last 50 steps,
and the last step alone) OUT/convergence.png (the curves together, smoothed over 25 steps, raw ones faint) and OUT/convergence.json (each
run's loss history and wall seconds; `--keep` reuses the runs logged there instead of rerunning them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_graph.train.report import load_history  # noqa: E402

DEFAULT_RUNS = ("none", "int8", "weights=fp8,grads=int4")
TAIL = 50  # steps averaged for the denoised final loss
SMOOTH = 25


def train(
    compress: str, steps: int, seed: int, workdir: str, extra: list[str]
) -> tuple[list[tuple[int, float]], float]:
    """One run of the main job; its loss history and wall seconds."""
    ckpt = os.path.join(workdir, compress.replace(",", "_").replace("=", "-"))
    cmd = [sys.executable, "-m", "fsdp_graph", "train", "--preset", "tiny", "--steps", str(steps), "--seed", str(seed)]
    cmd += ["--checkpoint-dir", ckpt, "--checkpoint-every", "0", "--plot", "none", *extra]
    if compress != "none":
        cmd += ["--compress", compress]
    began = time.perf_counter()
    log = ckpt + ".log"
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"run {compress!r} failed ({done.returncode}): {Path(log).read_text()[-3000:]}")
    history = load_history(os.path.join(ckpt, "history.json"), steps)
    if len(history) != steps:
        raise RuntimeError(f"run {compress!r} logged {len(history)} steps, expected {steps}")
    return history, time.perf_counter() - began


def tail_mean(history: list[tuple[int, float]]) -> float:
    tail = [v for _, v in history[-TAIL:]]
    return sum(tail) / len(tail)


def smoothed(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - SMOOTH] if i >= SMOOTH else 0.0)
        out.append(total / min(i + 1, SMOOTH))
    return out


def plot(path: Path, curves: dict[str, list[tuple[int, float]]], title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), layout="tight")
    ax = fig.add_subplot()
    for i, (label, history) in enumerate(curves.items()):
        steps, values = [s for s, _ in history], [v for _, v in history]
        color = f"C{i}"
        ax.plot(steps, values, color=color, alpha=0.15, linewidth=0.6)
        ax.plot(steps, smoothed(values), color=color, linewidth=1.3, label=label)
    ax.set(xlabel="step", ylabel=f"loss (nats/byte; mean of {SMOOTH} steps)", title=title)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.savefig(path, dpi=110)


def label(compress: str) -> str:
    return "uncompressed (fp32)" if compress == "none" else f"--compress {compress}"


def report(curves: dict[str, list[tuple[int, float]]], seconds: dict[str, float], args) -> str:
    base = curves["none"]
    base_tail, base_last = tail_mean(base), base[-1][1]
    lines = [
        "# Convergence with compressed collectives",
        "",
        f"Written by `python benchmarks/convergence.py --steps {args.steps} --seed {args.seed}` (issue 26's goal: final "
        "loss within 1% of the uncompressed run's). The main job, `python -m fsdp_graph train --preset tiny` (2 gloo "
        "ranks, FULL_SHARD, fp32, Inductor, AdamW, batch 8 x 128 per rank), once per row, all with the same seed: "
        "the same initial weights and batches; only the quantization differs. Losses from the job's own log "
        f"(`history.json`). Final loss: the mean of the last {TAIL} steps (the per-step loss is noisy: each step is a "
        "different batch), and the last step alone.",
        "",
        f"| run | mean of last {TAIL} | ratio | last step | ratio | within 1% (mean, last) | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for compress, history in curves.items():
        t, last = tail_mean(history), history[-1][1]
        within = ", ".join("yes" if abs(r - 1) <= 0.01 else "no" for r in (t / base_tail, last / base_last))
        lines.append(
            f"| {label(compress)} | {t:.4f} | {t / base_tail:.4f} | {last:.4f} | {last / base_last:.4f} | {within} "
            f"| {seconds[compress]:.0f} |"
        )
    lines += ["", "![loss curves](convergence.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="folder for convergence.md and .png")
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="--compress texts ('none': off)")
    parser.add_argument(
        "--keep", action="store_true", help="reuse runs already in OUT/convergence.json (same steps, seed, extra)"
    )
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `train` flags, last")
    args = parser.parse_args()
    if "none" not in args.runs:
        args.runs.insert(0, "none")
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "convergence.json"
    key = f"steps={args.steps},seed={args.seed},extra={' '.join(args.extra)}"
    logged = json.loads(log_path.read_text()) if log_path.exists() else {}
    logged = logged if logged.get("key") == key else {"key": key, "runs": {}}
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="fsdp_graph_convergence_") as workdir:
        for compress in args.runs:
            if args.keep and compress in logged["runs"]:
                run = logged["runs"][compress]
                curves[compress], seconds[compress] = [tuple(x) for x in run["history"]], run["seconds"]
                continue
            curves[compress], seconds[compress] = train(compress, args.steps, args.seed, workdir, args.extra)
            logged["runs"][compress] = {"history": curves[compress], "seconds": seconds[compress]}
            log_path.write_text(json.dumps(logged))  # each finished run is kept, for --keep
            print(f"{label(compress)}: last {TAIL} mean {tail_mean(curves[compress]):.4f} ({seconds[compress]:.0f} s)")
    title = f"tiny preset, 2 gloo ranks, {args.steps} steps, seed {args.seed}"
    plot(args.out / "convergence.png", {label(c): h for c, h in curves.items()}, title)
    text = report(curves, seconds, args)
    (args.out / "convergence.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
