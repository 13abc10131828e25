"""Plans of Llama 3 8B, 70B and 405B at real world sizes, from `explain()` on the meta device with the fake
process group: per-rank memory, communication, and the plan's own wall time, against the ZeRO-3 formula.

    python benchmarks/scale_plans.py                                   # every model x world x dtype -> docs/
    python benchmarks/scale_plans.py --models 8b --worlds 8 --dtypes bf16 --out -   # one plan, to stdout

Each plan: `Llama(preset(name, vocab=128256))` built on the meta device (no memory), `fully_shard` with the default
wrap (blocks, embedding, head) and FULL_SHARD, one sequence of 2048 tokens per rank, the loss written with
log_softmax (cross_entropy has no meta autograd kernel), `explain(hardware=...)`. bf16 is `MixedPrecision(bf16
params, fp32 reduce)` over fp32 master shards; fp32 is no mixed precision. One process per plan: Dynamo's caches
and the previous model's graphs would otherwise pile up over 24 plans.

A model deeper than 6 layers is planned with `fsdp_graph.explain_by_depth` from the same model at 4, 5 and 6
layers (every figure checked to be linear in depth, then extrapolated); where a figure is not linear yet at those
depths, at 8, 10 and 12 (the table says which); `--whole` plans every layer instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("8b", "70b", "405b")
WORLDS = (8, 64, 512, 1024)
DTYPES = ("bf16", "fp32")
DEPTH_SAMPLES = (4, 5, 6)  # explain_by_depth's depths for a deeper model (--whole: plan every layer)
LAYOUTS = ("rows", "flat")  # fully_shard(layout=...): row blocks with a copy-out, or the zero-copy flat views
BATCH, SEQ = 1, 2048
ADAM_STATE_PER_PARAM = 8  # AdamW's exp_avg and exp_avg_sq, fp32, per element of the rank's shard
GIB = 2**30


@dataclass(frozen=True)
class PlanRow:
    """One plan, bytes per rank. `peak_bytes` is explain's peak (shards, buffers, batch, the step's own
    allocations: gathered units, activations, gradients) plus the optimizer state explain does not model."""

    model: str
    world: int
    dtype: str
    layout: str
    params: int
    param_bytes: int  # this rank's fp32 master shards
    grad_bytes: int  # its fp32 gradient shards
    optim_bytes: int  # AdamW state of its shards
    largest_unit_bytes: int  # the largest gathered unit, in the gather's dtype
    activation_bytes: int  # the formula's activation estimate (`activation_estimate`)
    peak_bytes: int
    comm_bytes: float  # sent by this rank per step (ring algorithms)
    step_seconds: float  # explain's step time on `hardware`
    hardware: str
    plan_seconds: float  # build on meta + fully_shard + explain, on this machine (wall)
    plan_cpu_seconds: float  # the same, this process's CPU time (less sensitive to the shared machine's load)
    method: str = "whole"  # "whole": explain() of the model; "4,5,6": explain_by_depth from those depths

    @property
    def zero3_bytes(self) -> float:
        return zero3_formula(self.params, self.world, 2 * self.largest_unit_bytes, self.activation_bytes)


def zero3_formula(params: int, world: int, unsharded_bytes: float, activation_bytes: float) -> float:
    """ZeRO-3's per-rank model state with mixed-precision Adam, 16 bytes per parameter sharded over `world` ranks
    (fp32 master 4, gradient 4, Adam 8 here; ZeRO's paper: fp16 param 2 + grad 2 + fp32 master, m, v 12), plus
    the units gathered at once and the activations."""
    return 16 * params / world + unsharded_bytes + activation_bytes


def activation_estimate(dim: int, kv_dim: int, hidden: int, layers: int, vocab: int, tokens: int, elem: int) -> int:
    """Activations saved for backward without recomputation, per rank: per layer and token the two norm inputs
    and outputs, q, k, v, the attention output (7 x dim + 2 x kv_dim counting the residual sums) and SwiGLU's w1,
    w3, silu and product (4 x hidden), in the compute dtype; plus the logits in the compute dtype and their fp32
    log-softmax and its gradient."""
    per_token_layer = (7 * dim + 2 * kv_dim + 4 * hidden) * elem
    logits = tokens * vocab * (elem + 4 + 4)
    return layers * tokens * per_token_layer + logits


def hardware_for(world: int) -> str:
    """NVLink within one 8-GPU node; InfiniBand beyond (the ring's slowest link)."""
    return "nvlink" if world <= 8 else "infiniband"


def explain_llama(cfg, batch: int, hardware: str, mp=None, layout: str = LAYOUTS[0], reuse_blocks: bool = False):
    """`explain()` of the Llama `cfg` built on the meta device and sharded there (the process group is the
    caller's): one training step of `batch` sequences of `cfg.seq` tokens, the loss a log-softmax (cross_entropy has
    no meta autograd kernel)."""
    import torch

    import fsdp_graph
    from fsdp_graph.train.llama import Llama

    with torch.device("meta"):
        llama = Llama(cfg)
    fsdp_graph.fully_shard(
        llama,
        device="meta",
        param_init_fn=llama.init_module,
        mixed_precision=mp,
        layout=layout,
        reuse_blocks=reuse_blocks,
    )
    idx = torch.zeros(batch, cfg.seq, dtype=torch.long, device="meta")

    def lm_loss(logits: torch.Tensor) -> torch.Tensor:
        return -logits.float().log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

    return fsdp_graph.explain(llama, idx, loss_fn=lm_loss, hardware=hardware)


def plan(
    model: str,
    world: int,
    dtype: str,
    layout: str = LAYOUTS[0],
    batch: int = BATCH,
    seq: int = SEQ,
    vocab: int | None = None,
    samples: tuple[int, ...] | None = DEPTH_SAMPLES,
) -> PlanRow:
    """Plan one configuration in this process (it starts and ends a fake process group of `world` ranks): the
    whole model, or with `samples` (and a model deeper than them) `explain_by_depth` from plans at those depths."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_graph
    from fsdp_graph.planning.depth import figures_of
    from fsdp_graph.train.llama import LLAMA3_VOCAB, preset

    cfg = preset(model, vocab=vocab or LLAMA3_VOCAB, seq=seq)
    hw = hardware_for(world)
    mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" else None

    def explain_at(layers: int) -> fsdp_graph.ExplainReport:
        return explain_llama(replace(cfg, layers=layers), batch, hw, mp, layout)

    by_depth = samples is not None and cfg.layers > max(samples)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        if by_depth:
            try:
                figures = fsdp_graph.explain_by_depth(explain_at, cfg.layers, samples).figures
            except ValueError as bend:  # a figure is not linear yet at these depths: sample deeper
                samples = tuple(2 * n for n in samples)
                by_depth = cfg.layers > max(samples)
                print(f"{model} at {world} ranks ({dtype}): {bend}; sampling {samples}", file=sys.stderr)
                if by_depth:
                    figures = fsdp_graph.explain_by_depth(explain_at, cfg.layers, samples).figures
        if not by_depth:
            figures = figures_of(explain_at(cfg.layers))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        dist.destroy_process_group()
    shard_bytes = round(figures["shard_bytes"])
    elem = 2 if dtype == "bf16" else 4
    return PlanRow(
        model=model,
        world=world,
        dtype=dtype,
        layout=layout,
        params=round(figures["params"]),
        param_bytes=shard_bytes,
        grad_bytes=shard_bytes,
        optim_bytes=shard_bytes // 4 * ADAM_STATE_PER_PARAM,
        largest_unit_bytes=round(figures["largest_unit_bytes"]),
        activation_bytes=activation_estimate(
            cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.hidden, cfg.layers, cfg.vocab, batch * seq, elem
        ),
        peak_bytes=round(figures["peak_memory_bytes"]) + shard_bytes // 4 * ADAM_STATE_PER_PARAM,
        comm_bytes=figures["sent_bytes"],
        step_seconds=figures["step_time"],
        hardware=hw,
        plan_seconds=seconds,
        plan_cpu_seconds=cpu_seconds,
        method=",".join(map(str, samples)) if by_depth else "whole",
    )


def format_table(rows: Iterable[PlanRow]) -> str:
    """A Markdown table, GiB per rank."""
    header = (
        "| model | ranks | dtype | layout | params/rank | grads/rank | AdamW/rank | largest unit | predicted peak | "
        "ZeRO-3 formula | peak / formula | sent/rank/step | step (hardware) | planned from | plan time (CPU) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r.model} | {r.world} | {r.dtype} | {r.layout} | {r.param_bytes / GIB:.2f} | {r.grad_bytes / GIB:.2f} | "
            f"{r.optim_bytes / GIB:.2f} | {r.largest_unit_bytes / GIB:.2f} | {r.peak_bytes / GIB:.2f} | "
            f"{r.zero3_bytes / GIB:.2f} | {r.peak_bytes / r.zero3_bytes:.2f} | {r.comm_bytes / GIB:.1f} | "
            f"{r.step_seconds:.2f} s ({r.hardware}) | {_method(r)} | {r.plan_seconds:.0f} s ({r.plan_cpu_seconds:.0f} s) |"
        )
    return header + "\n".join(lines) + "\n"


def _method(row: PlanRow) -> str:
    return "every layer" if row.method == "whole" else f"{row.method} layers"


def _plan_in_subprocess(model: str, world: int, dtype: str, layout: str, whole: bool) -> PlanRow:
    args = [sys.executable, __file__, "--one", model, str(world), dtype, layout] + (["--whole"] if whole else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return PlanRow(**json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--layouts", nargs="+", default=[LAYOUTS[0]], choices=LAYOUTS)
    parser.add_argument(
        "--whole", action="store_true", help=f"plan every layer, not explain_by_depth from {DEPTH_SAMPLES} layers"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "scale-plans.md"), help="'-' for stdout")
    parser.add_argument("--one", nargs=4, metavar=("MODEL", "WORLD", "DTYPE", "LAYOUT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--fits",
        action="store_true",
        help="instead: does each plan fit an 80 GB H100, and if not, which layout plan() proposes (-> docs section)",
    )
    parser.add_argument("--fit-one", nargs=3, metavar=("MODEL", "WORLD", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_one:
        model, world, dtype = args.fit_one
        print(json.dumps(fit_row(model, int(world), dtype)))
        return
    if args.fits:
        _fits(args)
        return
    if args.one:
        model, world, dtype, layout = args.one
        samples = None if args.whole else DEPTH_SAMPLES
        print(json.dumps(asdict(plan(model, int(world), dtype, layout, samples=samples))))
        return
    rows = []
    for model in args.models:
        for world in args.worlds:
            for dtype in args.dtypes:
                for layout in args.layouts:
                    rows.append(_plan_in_subprocess(model, world, dtype, layout, args.whole))
                    print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    text = format_table(rows)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(_document(text))
        print(f"wrote {args.out}")


FIT_CHECKPOINT = ("selective", "full")  # what --fits searches beside plain FSDP (none is plain FSDP's own)


def fit_row(model: str, world: int, dtype: str) -> dict:
    """plan() of one scale-plans row on H100s: plain FSDP's memory (the row's layout, one 2048-token sequence per
    rank) and, when it does not fit, the best layout that does (checkpointing and tensor parallelism searched)."""
    import fsdp_graph
    from fsdp_graph.train.llama import LLAMA3_VOCAB, preset

    cfg = preset(model, vocab=LLAMA3_VOCAB, seq=SEQ)
    start = time.process_time()
    result = fsdp_graph.plan(
        cfg, world=world, hardware="h100", global_batch=world * BATCH, seq=SEQ, bf16=dtype == "bf16",
        checkpoint=FIT_CHECKPOINT + ("none",), top=1, pp=(1,), hsdp=False,
    )  # fmt: skip
    base, best = result.baseline, result.best
    state = 16 * cfg.num_params() / world
    return {
        "model": model,
        "world": world,
        "dtype": dtype,
        "baseline_reserved": base.reserved_bytes if base else None,
        "baseline_allocated": base.allocated_bytes if base else None,
        "baseline_fits": bool(base and base.fits),
        "best": best.layout.describe() if best else None,
        "best_reserved": best.reserved_bytes if best else None,
        "best_tokens": best.tokens_per_s_per_gpu if best else None,
        "state_bytes": state,
        "usable": result.usable_bytes,
        "cpu_seconds": time.process_time() - start,
    }


def _fits(args) -> None:
    rows = []
    for model in args.models:
        for world in args.worlds:
            for dtype in args.dtypes:
                cmd = [sys.executable, __file__, "--fit-one", model, str(world), dtype]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                print(rows[-1], flush=True)
    lines = [
        "| model | ranks | dtype | FSDP alone: allocated / reserved GiB | fits 77 GiB usable | layout plan() proposes "
        "| its reserved GiB | tokens/s/GPU | plan CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = (
            f"{r['baseline_allocated'] / GIB:.1f} / {r['baseline_reserved'] / GIB:.1f}"
            if r["baseline_reserved"]
            else "-"
        )
        if r["best"] is None:
            proposal = f"none fits: 16 B x params / ranks is {r['state_bytes'] / GIB:.1f} GiB of model state alone"
            cells = (proposal, "-", "-")
        else:
            cells = (r["best"], f"{r['best_reserved'] / GIB:.1f}", f"{r['best_tokens']:,.0f}")
        fits = "yes" if r["baseline_fits"] else "no"
        lines.append(
            f"| {r['model']} | {r['world']} | {r['dtype']} | {base} | {fits} | {' | '.join(cells)} | "
            f"{r['cpu_seconds']:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out != "-":
        path = Path(args.out)
        text = path.read_text()
        begin, end = "<!-- fits: scale_plans.py --fits -->", "<!-- end of fits -->"
        block = f"{begin}\n{table}{end}"
        text = (
            text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
            if begin in text
            else text + "\n" + block + "\n"
        )
        path.write_text(text)
        print(f"wrote {args.out}")


def _document(table: str) -> str:
    return f"""# Plans at real scale: Llama 3 8B, 70B, 405B

Written by `python benchmarks/scale_plans.py` (see its docstring for the setup): `explain()` on the meta device
with the fake process group, FULL_SHARD, the default wrap (a unit per block, the embedding and the head), one
sequence of {SEQ} tokens per rank ({BATCH} x {SEQ}), vocabulary 128256, untied. GiB per rank.

- params / grads / AdamW: this rank's fp32 master shards, their fp32 gradients, AdamW's two fp32 states.
- largest unit: the largest gathered flat parameter (bf16 or fp32).
- predicted peak: explain's peak (shards, buffers, batch, and what the step allocates: gathered units, saved
  activations, gradients) plus the AdamW state, which explain does not model.
- ZeRO-3 formula: 16 Psi / N + 2 x largest unit (one in use, one prefetched) + activations, the activations
  estimated without recomputation (`activation_estimate`: per layer and token 7 dim + 2 kv_dim + 4 ffn values,
  plus the logits and their fp32 log-softmax and gradient).
- sent/rank/step: what this rank sends per step under ring algorithms, (N-1)/N of each gather's and
  reduce-scatter's payload.
- attention: planned as the fused memory-efficient kernel a GPU runs (`explain(fused_attention=True)`), not the
  math fallback the meta device would trace (an fp32 heads x seq x seq score matrix kept per layer).
- step: explain's two-lane replay, eager-kernel roofline, NVLink at 8 ranks, InfiniBand beyond.
- planned from: the depths `fsdp_graph.explain_by_depth` planned (each figure checked to be linear over them,
  then extrapolated to the model's layers; 8, 10, 12 where 4, 5, 6 were not linear yet), or every layer.
- plan time: building on meta, `fully_shard` and `explain` at each sampled depth, on the shared 2-core
  development machine: wall time, and in brackets the process's CPU time (less sensitive to what else the
  machine runs).

{table}"""


if __name__ == "__main__":
    main()
