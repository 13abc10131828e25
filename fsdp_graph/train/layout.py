"""The main job's `--plan` and `--layout auto`: `fsdp_graph.plan()` for the job's model, world and batch, and the
job's options set from the layout it proposes."""

from __future__ import annotations

import argparse
import os

from passes.hardware import GPUS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print fsdp_graph.plan()'s layouts for this preset, world and global batch (--batch x world sequences) "
        "on --hardware, and exit without training",
    )
    parser.add_argument(
        "--layout",
        choices=["manual", "auto"],
        default="manual",
        help="auto: train with the layout plan() ranks first (sets --tp, --pp, --microbatches, --batch per "
        "data-parallel rank, --strategy, --ac, --compress); manual (default): as the flags say",
    )
    parser.add_argument(
        "--hardware",
        default="h100",
        choices=sorted(GPUS),
        help="the GPU --plan and --layout auto plan for (default: h100; 8 per node)",
    )
    parser.add_argument(
        "--ac",
        choices=["none", "selective", "layer", "full"],
        default="none",
        help="activation checkpointing of the blocks (LlamaConfig.checkpoint; default none; turns block reuse off)",
    )


def planned_world(args: argparse.Namespace) -> int:
    return int(os.environ.get("WORLD_SIZE", args.world))


def plan_job(args: argparse.Namespace, world: int, log=None):
    """plan() for the job: its preset at its sequence length, `args.batch` sequences per rank over `world` ranks,
    AdamW with the job's clipping, bf16 when asked, only layouts the job runs (`plan(job=True)`)."""
    import fsdp_graph
    from fsdp_graph.train.llama import PRESETS, preset

    cfg = preset(args.preset, seq=max(args.seq, PRESETS[args.preset].seq))
    return fsdp_graph.plan(
        cfg,
        world=world,
        hardware=args.hardware,
        global_batch=args.batch * world,
        seq=args.seq,
        clip_grad=args.clip > 0,
        bf16=args.mixed_precision == "bf16",
        compression=(None,) if args.compress is None else (None, "int8"),
        job=True,
        log=log,
    )


def apply_layout(args: argparse.Namespace, layout) -> None:
    """Set the job's options to `layout` (a `fsdp_graph.planning.layouts.Layout` plan(job=True) proposed)."""
    import fsdp_graph

    args.tp, args.pp = layout.tp, layout.pp
    args.batch = layout.micro_batch * layout.microbatches
    args.microbatches = layout.microbatches if layout.pp > 1 else layout.pp
    if layout.dp_replicate > 1:
        args.strategy = "HYBRID_SHARD"
    elif not layout.reshard_after_forward:
        args.strategy = "SHARD_GRAD_OP"
    else:
        args.strategy = "FULL_SHARD"
    args.compress = fsdp_graph.Compression.parse(layout.compression) if layout.compression else None
    args.ac = layout.checkpoint
    if layout.checkpoint != "none" or layout.tp > 1:
        args.reuse_blocks = False
