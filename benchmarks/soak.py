"""Soak run: many training steps on 2 gloo ranks, to find what 5-step parity tests cannot (crashes in native code,
leaks, recompiles).

    python benchmarks/soak.py                         # 1000 steps, eager kernels, prefetch on
    python benchmarks/soak.py --mode inductor --steps 1000 --runs 20
    python benchmarks/soak.py --reduce-scatter native --no-prefetch
    python benchmarks/soak.py --tp 2 --steps 200      # 4 ranks: (dp=2, tp=2), each block's MLP tensor-parallel

The model is a small GPT with a tied embedding/head and widths no world size divides (3 blocks, dim 36, 3 heads,
vocab 97, 11 tokens, 4 sequences per rank), FULL_SHARD, `torch.compile(fullgraph=True)`, SGD with momentum. Every
`--eval-every` steps one eval-mode forward runs without gradients (a second graph). Each run prints steps/s, the
resident-memory growth from step 10 to the end, the graphs Dynamo compiled after the warm-up, and the first and
last loss. `--tp N` runs on 2 x N ranks as (dp=2, tp=N): each block's MLP split by `parallelize_module` (fc
Colwise, out Rowwise; the fused qkv projection and 3 heads leave attention whole), fully_shard over dp; the tp ranks
of a dp group share its batch. A run whose rank dies (a signal, an exception, a hang) is reported with the launcher's message and counts
as failed; the exit status is the number of failed runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fsdp_graph
from fsdp_graph.train.gpt import GPT, GPTConfig
from fsdp_graph.train.launch import RankFailedError, spawn

_WARMUP = 10  # steps before memory and recompiles are counted (the train and eval graphs compile in these)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def soak_rank(rank: int, world: int, options: dict) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=97, dim=options["dim"], heads=3, layers=options["layers"], seq=11, tied=True)
    model = GPT(cfg)
    dp, dp_rank = world, rank
    if options["tp"] > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // options["tp"], options["tp"]), mesh_dim_names=("dp", "tp"))
        plan = {f"blocks.{i}.fc": ColwiseParallel() for i in range(cfg.layers)}
        plan.update({f"blocks.{i}.out": RowwiseParallel() for i in range(cfg.layers)})
        parallelize_module(model, mesh["tp"], plan)
        fsdp_graph.fully_shard(model, mesh["dp"])
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    else:
        fsdp_graph.fully_shard(model)
    backend = fsdp_graph.make_backend(
        inductor=options["mode"] == "inductor",
        prefetch=options["prefetch"],
        reduce_scatter=options["reduce_scatter"],
        max_inflight_bytes=options["max_inflight_bytes"],
    )
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1234)  # the same stream on every rank: a learnable task
    tokens = torch.randint(0, cfg.vocab, (64, cfg.seq + 1), generator=generator)
    losses, graphs_after_warmup, rss_start, start = [], 0, 0.0, 0.0
    for step in range(options["steps"]):
        rows = torch.arange(4) + (step * 4 * dp + dp_rank * 4) % 60
        x, y = tokens[rows, :-1], tokens[rows, 1:]
        if step == _WARMUP:
            graphs_after_warmup, rss_start, start = backend.dynamo_graphs, _rss_mib(), time.perf_counter()
        logits = compiled(x)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if options["eval_every"] and step % options["eval_every"] == 0:  # step 0: the eval graph compiles in warm-up
            model.eval()
            with torch.no_grad():
                compiled(x)
            model.train()
    seconds = time.perf_counter() - start
    return {
        "steps_per_s": (options["steps"] - _WARMUP) / seconds,
        "rss_growth_mib": _rss_mib() - rss_start,
        "recompiles": backend.dynamo_graphs - graphs_after_warmup,
        "first_loss": statistics.fmean(losses[:10]),
        "last_loss": statistics.fmean(losses[-10:]),
    }


def run_once(options: dict, timeout_s: float) -> dict:
    """One soak run on 2 (x tp) ranks: rank 0's figures (and the worst memory growth / recompiles of all), or the
    error."""
    try:
        results = spawn(soak_rank, 2 * options["tp"], (options,), timeout_s=timeout_s)
    except RankFailedError as error:
        text = error.failures[0][2].strip().splitlines()
        return {
            "ok": False,
            "error": f"rank {error.rank} ({error.signal or 'raised'}): {text[-1] if text else ''}",
            "traceback": "\n".join(text[-40:]),  # the root cause's own end, for the report: a last line rarely says
        }
    summary = dict(results[0])
    summary["rss_growth_mib"] = max(r["rss_growth_mib"] for r in results)
    summary["recompiles"] = max(r["recompiles"] for r in results)
    return {"ok": True, **summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--mode", choices=("aot", "inductor"), default="aot", help="aot: make_backend(inductor=False)")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false")
    parser.add_argument("--reduce-scatter", choices=("auto", "native"), default="auto")
    parser.add_argument("--max-inflight-bytes", type=int, default=None, help="schedule budget (None: the default)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dim", type=int, default=36)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: 2 x N ranks as (dp=2, tp=N)")
    parser.add_argument("--eval-every", type=int, default=100, help="an eval-mode forward every N steps (0: none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--json", help="write every run's figures to this file")
    args = parser.parse_args(argv)
    options = {k: getattr(args, k) for k in ("steps", "mode", "prefetch", "reduce_scatter", "layers", "dim", "tp")}
    options.update(max_inflight_bytes=args.max_inflight_bytes, eval_every=args.eval_every)
    print(f"soak: {options}, {args.runs} run(s)", flush=True)
    runs = []
    for index in range(args.runs):
        result = run_once(options, args.timeout)
        runs.append(result)
        if result["ok"]:
            print(
                f"run {index + 1}: ok  {result['steps_per_s']:.1f} steps/s  rss {result['rss_growth_mib']:+.1f} MiB  "
                f"recompiles {result['recompiles']}  loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}",
                flush=True,
            )
        else:
            print(f"run {index + 1}: FAILED  {result['error']}\n{result.get('traceback', '')}", flush=True)
    failed = sum(not r["ok"] for r in runs)
    print(f"{len(runs) - failed} of {len(runs)} runs passed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": options, "runs": runs}, f, indent=1)
    return failed


if __name__ == "__main__":
    sys.exit(main())
