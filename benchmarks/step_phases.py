"""Where the main job's step spends its time, phase by phase: ours against plain torch.compile, one rank.

    python benchmarks/step_phases.py [--preset small] [--batch 8] [--seq 256] [--peers ours plain] [--out DIR]

Each peer runs in a fresh process as one rank (NCCL on a GPU, gloo on CPU). "ours" is the job's own model, optimizer,
clip and step guard (`fsdp_graph.train.job._build`, bf16); "ours-no-reuse" the same with `--no-reuse-blocks`;
"plain" the same Llama, AdamW and clip with plain `torch.compile` under bf16 autocast, the loss read with `.item()`
where ours runs its guard. After warm-up steps, each step's phases (forward + backward, clip, guard, optimizer step
with zero_grad) are timed with a device sync after each: on a GPU whose step the host sets (a small model), each
phase's time is its host time. Then steps without syncs (the step as the job runs it), then one step under
torch.profiler's CPU activity: its table by self time (`host_<peer>.txt`) and trace (`host_<peer>.json`) go to
`--out`. Prints each phase's median per peer and its ratio to the first peer's; the GPU figures are in docs/gpus.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("forward + backward", "clip", "guard", "optimizer", "synced step", "step")
PEERS = ("ours", "ours-no-reuse", "plain")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=["ours", "plain"])
    p.add_argument("--out", default=None, help="folder for the profiler tables and traces (default: none written)")
    p.add_argument("--child", choices=PEERS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _peer(args: argparse.Namespace, device: torch.device):
    """(forward + backward, clip, guard, optimizer) for `args.child`, each returning what the next one takes."""
    from fsdp_graph.train import job
    from fsdp_graph.train.llama import PRESETS, Llama, llama_loss

    targs = job.parse_args(["--preset", args.preset, "--mixed-precision", "bf16", "--world", "1"])
    targs.batch, targs.seq = args.batch, args.seq
    if args.child != "plain":
        import fsdp_graph

        targs.reuse_blocks = False if args.child == "ours-no-reuse" else targs.reuse_blocks
        _, model, opt, step_model, _ = job._build(targs, 1, device, job._backend(targs))
        guard = fsdp_graph.StepGuard(model)

        def forward_backward(batch):
            loss = llama_loss(step_model, batch)
            loss.backward()
            return loss

        def clip():
            return fsdp_graph.clip_grad_norm_(model, targs.clip)

        def check(loss, norm):
            return guard.check(1, loss, grad_norm=norm, loss_ranks=1)
    else:
        torch.manual_seed(targs.seed)
        model = Llama(PRESETS[args.preset]).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        compiled = torch.compile(model, fullgraph=True)

        def forward_backward(batch):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = llama_loss(compiled, batch)
            loss.backward()
            return loss

        def clip():
            return torch.nn.utils.clip_grad_norm_(model.parameters(), targs.clip)

        def check(loss, norm):
            return loss.item()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, clip, check, step


def _child(args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu import _device, _torchrun_env
    from fsdp_graph.train.corpus import batch_at, load_tokens

    cuda = torch.cuda.is_available()
    device = _device({"device": "cuda" if cuda else "cpu"})
    _torchrun_env()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, **({"device_id": device} if cuda else {}))
    try:
        forward_backward, clip, check, step = _peer(args, device)
        tokens = load_tokens()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        batches = itertools.count()

        def batch():
            return tuple(t.to(device) for t in batch_at(tokens, next(batches), 0, args.batch, args.seq))

        for i in range(args.warmup + args.steps):
            b = batch()
            sync()
            marks = [time.perf_counter()]
            loss = forward_backward(b)
            sync()
            marks.append(time.perf_counter())
            norm = clip()
            sync()
            marks.append(time.perf_counter())
            check(loss, norm)
            sync()
            marks.append(time.perf_counter())
            step()
            sync()
            marks.append(time.perf_counter())
            if i >= args.warmup:
                spans = [b - a for a, b in zip(marks, marks[1:])]
                for phase, span in zip(PHASES, spans):
                    times[phase].append(span)
                times["synced step"].append(marks[-1] - marks[0])
        for _ in range(args.steps):
            b = batch()
            began = time.perf_counter()
            loss = forward_backward(b)
            check(loss, clip())
            step()
            sync()
            times["step"].append(time.perf_counter() - began)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = forward_backward(batch())
            check(loss, clip())
            step()
            sync()
    finally:
        dist.destroy_process_group()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90)
        (out / f"host_{args.child}.txt").write_text(table)
        prof.export_chrome_trace(str(out / f"host_{args.child}.json"))
    return {phase: statistics.median(spans) for phase, spans in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.child:
        Path(args.result).write_text(json.dumps(_child(args)))
        return 0
    results = {}
    for peer in args.peers:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        forwarded = list(argv if argv is not None else sys.argv[1:])
        subprocess.run([sys.executable, __file__, *forwarded, "--child", peer, "--result", path], check=True)
        results[peer] = json.loads(Path(path).read_text())
        os.unlink(path)
    base = args.peers[0]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"\nLlama {args.preset}, {args.batch} x {args.seq} tokens, bf16, one rank on {device}: median ms")
    print(f"{'phase':<20}" + "".join(f"{peer:>16}" for peer in args.peers) + f"   ratio to {base}")
    for phase in PHASES:
        row = [results[peer][phase] for peer in args.peers]
        ratios = " ".join(f"{v / row[0]:.2f}x" if row[0] else "-" for v in row[1:])
        print(f"{phase:<20}" + "".join(f"{v * 1e3:>16.2f}" for v in row) + f"   {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
