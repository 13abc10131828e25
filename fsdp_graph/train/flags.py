"""The main job's command line: its options, and every check that can run before a rank starts (numeric ranges,
the corpus length, option combinations), so a bad flag fails at once with the allowed range instead of after
minutes of compiling or as a stack trace."""

from __future__ import annotations

import argparse
import math
import os

import fsdp_graph
from fsdp_graph.api.guard import MODES as NONFINITE_MODES
from fsdp_graph.train import checkpoints, layout
from fsdp_graph.train.corpus import load_tokens
from fsdp_graph.train.llama import PRESETS, check_tp
from fsdp_graph.train.pipeline import SCHEDULES
from fsdp_graph.train.pipeline import check_args as check_pipeline_args

_DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3}  # larger presets: 3e-4


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp-graph train", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model size (default: tiny, 0.8 M)")
    p.add_argument(
        "--strategy",
        choices=[s.name for s in fsdp_graph.ShardingStrategy],
        default="FULL_SHARD",
        help="sharding strategy (default: FULL_SHARD; hybrid ones need 4+ ranks)",
    )
    p.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="bf16: bf16 gathers and compute, fp32 master weights and gradient reduction (default: none)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep shards, gradients and optimizer state in CPU memory; gather and compute on the device",
    )
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default: 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's, tiny 128)")
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps, resumed ones included")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 3e-3 tiny, 1e-3 small)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the model")
    p.add_argument(
        "--backend-mode",
        choices=["inductor", "aot"],
        default="inductor",
        help="inductor (default), or aot: the same passes with eager kernels, fast to compile",
    )
    p.add_argument("--checkpoint-dir", default=None, help="save DCP checkpoints to DIR/step_NNNNNN")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH",
        help="continue from the latest checkpoint in --checkpoint-dir, or from PATH (a DIR/step_NNNNNN)",
    )
    p.add_argument("--keep", type=int, default=1, help="checkpoints kept in --checkpoint-dir (default: the newest 1)")
    p.add_argument("--dump-dir", default=None, help="write each compile stage's graph as code here")
    p.add_argument(
        "--compress",
        default=None,
        help="quantized gathers and gradient all-to-alls (fsdp_graph.Compression.parse): 'int8', or e.g. "
        "'weights=int8,grads=int4,block=256' (default: off)",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="loss curve PNG (default: CHECKPOINT_DIR/loss.png, else ./loss.png; 'none': no plot)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: a (pp, world/pp) mesh, each stage sharded over its dp group (default: 1, none)",
    )
    p.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default: 1f1b)")
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per step with --pp (default: --pp); divides --batch",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel degree: a (world/tp, tp) mesh, the blocks split by torchtitan's plan over tp and "
        "sharded over dp (default: 1, none)",
    )
    p.add_argument(
        "--reuse-blocks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile one block body for every layer, so compile time stays about flat in depth. Default: where "
        "eligible (fully_shard(reuse_blocks=None); off with --tp, whose tensor-parallel blocks cannot share one); "
        "--reuse-blocks: everywhere or an error (reuse_blocks=True; not with --tp); --no-reuse-blocks: off",
    )
    p.add_argument("--world", type=int, default=2, help="ranks to start when not under torchrun (default: 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds (default: 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init and of the data order")
    p.add_argument(
        "--nonfinite",
        choices=NONFINITE_MODES,
        default="skip",
        help="a step whose loss or gradient norm is NaN or Inf: skip it (the optimizer untouched; default), stop "
        "the job, or off (train on it; saving such a model still fails)",
    )
    p.add_argument(
        "--nonfinite-skips",
        type=int,
        default=3,
        help="with --nonfinite skip: non-finite steps in a row skipped before the job stops (default: 3)",
    )
    p.add_argument(
        "--foreign",
        action="store_true",
        help="--resume PATH is a checkpoint written by torch's DCP (no checksums.json): only its file sizes are checked",
    )
    layout.add_arguments(p)
    return p


# flag: (least, greatest or None, what it counts); integers unless the default is a float
_INT_RANGES = {
    "world": (1, None, "ranks"),
    "batch": (1, None, "sequences per rank"),
    "seq": (1, None, "tokens per sequence"),
    "steps": (1, None, "steps"),
    "checkpoint_every": (0, None, "steps; 0: only at the end"),
    "keep": (1, None, "checkpoints"),
    "pp": (1, None, "pipeline stages"),
    "tp": (1, None, "tensor-parallel ranks"),
    "microbatches": (1, None, "microbatches"),
    "seed": (0, 2**32 - 1, ""),
    "nonfinite_skips": (0, None, "steps"),
}
# flag: (whether 0 is allowed, what it is)
_FLOAT_RANGES = {"lr": (False, "learning rate"), "clip": (True, "gradient norm; 0: off"), "timeout": (False, "seconds")}


def check_numbers(args: argparse.Namespace) -> str | None:
    """Why a numeric flag is out of range (None: all are in range), the range in the message. The corpus bounds
    --seq (a window of seq + 1 tokens must fit), checked here, before any model is built."""
    for name, (least, greatest, what) in _INT_RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        if value < least or (greatest is not None and value > greatest):
            bound = f"between {least} and {greatest:,}" if greatest is not None else f"at least {least}"
            return f"--{name.replace('_', '-')} {value}: must be {bound}" + (f" ({what})" if what else "")
    for name, (zero_ok, what) in _FLOAT_RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            return f"--{name} {value}: must be a finite number {'>= 0' if zero_ok else '> 0'} ({what})"
    corpus = load_tokens().numel()
    if args.seq is not None and args.seq > corpus - 2:
        return f"--seq {args.seq}: the corpus has {corpus:,} tokens, so --seq must be between 1 and {corpus - 2:,}"
    return None


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The options, checked (argparse's usage error and exit 2 otherwise)."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if why := check_numbers(args):
        parser.error(why)
    if args.checkpoint_every and not args.checkpoint_dir and args.resume in (None, "latest"):
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.resume == "latest" and not args.checkpoint_dir:
        parser.error("--resume without a PATH needs --checkpoint-dir")
    if args.resume not in (None, "latest"):
        if args.foreign and not os.path.exists(os.path.join(args.resume, ".metadata")):
            parser.error(f"--resume {args.resume} --foreign: not a DCP checkpoint (no .metadata file)")
        if not args.foreign and checkpoints.step_of(args.resume) is None:
            parser.error(
                f"--resume {args.resume}: not a checkpoint of this job (DIR/step_NNNNNN with a .metadata file)"
            )
        args.checkpoint_dir = args.checkpoint_dir or os.path.dirname(os.path.abspath(args.resume))
    if args.foreign and args.resume in (None, "latest"):
        parser.error("--foreign needs --resume PATH (the torch checkpoint to start from)")
    if args.compress is not None:
        if not args.compile:
            parser.error("--compress is a compiler pass: it needs --compile")
        try:
            args.compress = fsdp_graph.Compression.parse(args.compress)
        except (TypeError, ValueError) as error:
            parser.error(f"--compress {args.compress}: {error}")
    if args.ac != "none" and args.pp > 1:
        parser.error("--ac with --pp is not supported yet")
    if args.ac != "none":
        args.reuse_blocks = False  # a shared block body keeps every activation under checkpointing (issue 37)
    if args.microbatches is None:
        args.microbatches = args.pp
    if why := _check_tp_args(args):
        parser.error(why)
    if args.reuse_blocks and args.tp > 1:
        parser.error(
            "--reuse-blocks runs without --tp (fully_shard cannot share a block body across tensor-parallel units)"
        )
    if args.reuse_blocks is None and args.tp > 1:
        args.reuse_blocks = False  # said in the header: the default's fallback, without fully_shard's warning
    if args.pp > 1 and not _under_torchrun() and (why := check_pipeline_args(args, args.world)):
        parser.error(why)
    if args.seq is None:
        args.seq = PRESETS[args.preset].seq
    if args.lr is None:
        args.lr = _DEFAULT_LR.get(args.preset, 3e-4)
    if args.plot is None:
        args.plot = os.path.join(args.checkpoint_dir or ".", "loss.png")
    return args


def _check_tp_args(args: argparse.Namespace) -> str | None:
    """Why the --tp options cannot run (None: they can); the world size is checked when known (not under torchrun)."""
    if args.tp < 1:
        return f"--tp must be at least 1, got {args.tp}"
    if args.tp == 1:
        return None
    if args.pp > 1:
        return "--tp with --pp is not supported yet"
    if fsdp_graph.ShardingStrategy[args.strategy] is not fsdp_graph.ShardingStrategy.FULL_SHARD:
        return f"--tp runs with FULL_SHARD only (got {args.strategy})"
    if args.cpu_offload:
        return "--tp with --cpu-offload is not supported yet"
    if not _under_torchrun() and args.world % args.tp:
        return f"--tp {args.tp} does not divide the {args.world} ranks"
    return check_tp(PRESETS[args.preset], args.tp)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)
