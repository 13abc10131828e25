"""The main job: train a Llama-style model with `fully_shard` + the fsdp_graph compiler on the shipped corpus.

    python -m fsdp_graph train [--preset tiny] [--steps 40] [--strategy FULL_SHARD] [--mixed-precision none] ...
    torchrun --nproc-per-node 8 -m fsdp_graph train --preset 1b     # NCCL on GPUs, gloo on CPUs

Outside torchrun it starts `--world` gloo ranks on this machine's CPUs. Rank 0 shows a progress bar and prints a
summary table at the end; the loss curve goes to a PNG. A rank that fails (raises, is killed, or hangs past
`--timeout`) ends every rank, and the error names it.

Test hook: FSDP_GRAPH_FAIL_AT_STEP="RANK:STEP" makes that rank raise before step STEP (0-based);
"RANK:STEP:kill" makes it SIGKILL itself instead, "RANK:STEP:hang" makes it stop (its peers then time out), and
"RANK:STEP:save" makes it SIGKILL itself in the middle of saving the checkpoint of step STEP (its shard files written,
the checkpoint's .metadata not yet).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import threading
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from fsdp_graph.runtime.devices import collective_device
from fsdp_graph.train import checkpoints, layout
from fsdp_graph.train.corpus import batch_at, load_tokens
from fsdp_graph.train.launch import RankFailedError, spawn
from fsdp_graph.train.llama import PRESETS, Llama, check_tp, llama_loss, preset, tp_plan
from fsdp_graph.train.pipeline import SCHEDULES, build_pipeline
from fsdp_graph.train.pipeline import check_args as check_pipeline_args
from fsdp_graph.train.report import (
    RunStats,
    describe,
    gather_per_rank,
    load_history,
    local_peak_memory,
    summarise,
)

_DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3}  # larger presets: 3e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp-graph train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
    layout.add_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint_dir and args.resume in (None, "latest"):
        parser.error("--checkpoint-every needs --checkpoint-dir")
    if args.resume == "latest" and not args.checkpoint_dir:
        parser.error("--resume without a PATH needs --checkpoint-dir")
    if args.resume not in (None, "latest"):
        if checkpoints.step_of(args.resume) is None:
            parser.error(
                f"--resume {args.resume}: not a checkpoint of this job (DIR/step_NNNNNN with a .metadata file)"
            )
        args.checkpoint_dir = args.checkpoint_dir or os.path.dirname(os.path.abspath(args.resume))
    if args.pp < 1:
        parser.error(f"--pp must be at least 1, got {args.pp}")
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


def main(argv: list[str] | None = None) -> dict | None:
    """Run the job; returns rank 0's summary (None on other torchrun ranks). Raises `RankFailedError` naming the
    rank that failed first when ranks were started here (torchrun reports failures itself)."""
    args = parse_args(argv)
    if args.plan or args.layout == "auto":
        result = layout.plan_job(args, layout.planned_world(args), log=lambda line: print(line, file=sys.stderr))
        print(result.to_text(), flush=True)
        if args.plan:
            return None
        if result.best is None:
            raise SystemExit("fsdp-graph train --layout auto: no layout fits (the plan above says why)")
        layout.apply_layout(args, result.best.layout)
    if _under_torchrun():
        return _torchrun_rank(args)
    if torch.cuda.is_available():
        print(
            f"note: starting {args.world} CPU (gloo) ranks here; for GPUs run "
            "`torchrun --nproc-per-node NGPUS -m fsdp_graph train ...`",
            file=sys.stderr,
        )
    return spawn(train_rank, args.world, (args,), timeout_s=args.timeout)[0]


def cli(argv: list[str] | None = None) -> int:
    """`fsdp-graph train`: main() with failures printed as one clear message instead of a launcher traceback."""
    try:
        main(argv)
    except RankFailedError as e:
        print(f"\nfsdp-graph train FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def process_group_setup(cuda_available: bool, env: Mapping[str, str]) -> tuple[str, int | None]:
    """(init_process_group backend, CUDA device index to make current or None) for a torchrun rank.

    With CUDA: NCCL for CUDA tensors and gloo for CPU ones (`cpu:gloo,cuda:nccl`, as torchtitan), so a collective
    on a CPU tensor outside the compiled graph (a flag, CPU-offloaded gradients) still has a backend; the device is
    LOCAL_RANK's, so each rank's NCCL communicator and allocations land on its own GPU."""
    if not cuda_available:
        return "gloo", None
    local_rank = env.get("LOCAL_RANK", "0")
    if not local_rank.isdigit():
        raise ValueError(f"fsdp_graph train: LOCAL_RANK must be a GPU index, got {local_rank!r} (set by torchrun).")
    return "cpu:gloo,cuda:nccl", int(local_rank)


def _torchrun_rank(args: argparse.Namespace) -> dict | None:
    from torch.distributed.elastic.multiprocessing.errors import record

    backend, cuda_index = process_group_setup(torch.cuda.is_available(), os.environ)
    if cuda_index is not None:
        torch.cuda.set_device(cuda_index)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        # record(): torchrun prints the failing rank's traceback when it ends the others.
        return record(train_rank)(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _native_stderr_muted():
    """The profiler (kineto) writes 'profiler_start/stop' lines straight to fd 2, and no setting turns them off."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _mesh(strategy: fsdp_graph.ShardingStrategy, world: int, device: torch.device):
    if not strategy.is_hybrid:
        return None
    if world < 4 or world % 2:
        raise ValueError(f"{strategy.name} needs an even world of at least 4 ranks (2 replicas), got {world}")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (2, world // 2))


def _shard_kwargs(args: argparse.Namespace) -> dict:
    """fully_shard's options from the command line (strategy, precision, offload)."""
    mp = None
    if args.mixed_precision == "bf16":
        mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "strategy": fsdp_graph.ShardingStrategy[args.strategy],
        "mixed_precision": mp,
        "cpu_offload": fsdp_graph.CPUOffload(offload_params=True) if args.cpu_offload else None,
        "reuse_blocks": args.reuse_blocks,
    }


def _optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def _backend(args: argparse.Namespace):
    if not args.compile:
        return None
    return fsdp_graph.make_backend(
        inductor=args.backend_mode == "inductor", dump_dir=args.dump_dir, compress=args.compress
    )


def _build(args: argparse.Namespace, world: int, device: torch.device):
    """The sharded model (built on meta, materialised one unit at a time), its optimizer, the model to call, and
    this rank's (data-parallel size, data-parallel rank).

    With --tp: a (world / tp, tp) mesh ("dp", "tp"); the meta-device model is split by `tp_plan` over tp, then
    fully_shard over dp materialises it a unit at a time, each tp parameter initialised whole and cut to this
    rank's piece (so it starts from the values the job without --tp starts from)."""
    cfg = preset(args.preset, seq=max(args.seq, PRESETS[args.preset].seq), checkpoint=args.ac)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = Llama(cfg)
    kwargs = _shard_kwargs(args)
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if world % args.tp:
            raise ValueError(f"--tp {args.tp} does not divide the {world} ranks")
        mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(cfg))
        fsdp_graph.fully_shard(model, mesh["dp"], param_init_fn=model.init_module, device=device, **kwargs)
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    else:
        fsdp_graph.fully_shard(
            model,
            _mesh(kwargs["strategy"], world, device),
            param_init_fn=model.init_module,
            device=device,
            **kwargs,
        )
        dp, dp_rank = world, dist.get_rank()
    opt = _optimizer(args, model)
    backend = _backend(args)
    step_model = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    return cfg, model, opt, step_model, (dp, dp_rank)


def train_rank(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """One rank of the job (spawned, or under torchrun). Returns the summary on rank 0."""
    from tqdm import tqdm

    device = collective_device()  # the accelerator of an NCCL (or mixed) group, else the CPU
    pipeline = None
    if args.pp > 1:
        if why := check_pipeline_args(args, world):
            raise ValueError(why)
        cfg, pipeline, opt = build_pipeline(
            args, world, device, _shard_kwargs(args), lambda m: _optimizer(args, m), _backend(args)
        )
        model = pipeline.model
        dp, dp_rank = pipeline.dp, pipeline.dp_rank  # data-parallel pipelines
    else:
        cfg, model, opt, step_model, (dp, dp_rank) = _build(args, world, device)
    tokens = load_tokens()
    start, history = 0, []
    if found := checkpoints.resume(args, model, opt, rank):
        path, start = found
        history = load_history(os.path.join(os.path.dirname(os.path.abspath(path)), "history.json"), start)
    if rank == 0:
        _print_header(args, cfg, world, device, start)

    def step_fn(batch) -> torch.Tensor:
        if pipeline is not None:
            loss = pipeline.step(batch)  # the last stage's mean loss, 0 on the others
        else:
            loss = llama_loss(step_model, batch)
            loss.backward()
        if args.clip > 0:
            fsdp_graph.clip_grad_norm_(model, args.clip, pp_group=pipeline.pp_group if pipeline else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    stats = RunStats(history=history)
    ar_group = 2 if fsdp_graph.ShardingStrategy[args.strategy].is_hybrid else args.tp if args.tp > 1 else world
    losses_summed = dp * args.tp  # the all-reduce below adds one loss per pipeline, per tp rank
    # The last step counts the collectives under the profiler: not the first (compiling) one, and late, because
    # the profiler's bookkeeping takes memory (up to 1 GB on the small preset) that the peak must not include.
    profile_at = args.steps - 1 if args.steps - start >= 3 else None
    executed, checkpoint, peak = None, None, None
    tokens_per_step = args.batch * args.seq * dp
    # A thread lock, not tqdm's default multiprocessing one: spawned ranks leave with os._exit, which would leak
    # its semaphore (a resource_tracker warning at the end of every run).
    tqdm.set_lock(threading.RLock())
    bar = tqdm(total=args.steps, initial=start, disable=rank != 0, desc="train", unit="step", dynamic_ncols=True)
    for step in range(start, args.steps):
        checkpoints.fail_if_asked(rank, step)
        ticker = compile_ticker(bar, rank == 0 and step == start and args.compile)
        batch = tuple(t.to(device) for t in batch_at(tokens, step, args.seed, args.batch, args.seq, dp_rank, dp))
        began = time.perf_counter()
        if step == profile_at:
            peak = local_peak_memory(device)
            out: list[torch.Tensor] = []
            with _native_stderr_muted():
                executed = executed_collectives(
                    lambda b=batch, o=out: o.append(step_fn(b)), group_size_of_all_reduce=ar_group
                )
            loss = out[0]
            stats.profiled = len(stats.step_s)
        else:
            with ticker:
                loss = step_fn(batch)
        dist.all_reduce(loss)
        value = loss.item() / losses_summed  # one loss per pipeline (all ranks without --pp), tp ranks' alike
        stats.step_s.append(time.perf_counter() - began)
        stats.history.append((step + 1, value))
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens_per_step / stats.step_s[-1]:,.0f}", refresh=False)
        bar.update()
        if args.checkpoint_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            checkpoint = checkpoints.save(args, model, opt, step + 1, stats.history, rank)
    bar.close()
    if args.checkpoint_dir and args.steps > start and checkpoint != checkpoints.checkpoint_path(args, args.steps):
        checkpoint = checkpoints.save(args, model, opt, args.steps, stats.history, rank)
    mine, memory_what = peak or local_peak_memory(device)
    if peak:
        memory_what += ", before the profiled last step"
    memory = gather_per_rank(mine, device)
    if rank != 0:
        return None
    return summarise(args, cfg, world, device, start, stats, executed, memory, memory_what, checkpoint)


def _print_header(args, cfg, world: int, device: torch.device, start: int) -> None:
    resumed = f", resuming at step {start}" if start else ""
    print(
        f"fsdp_graph train: Llama {args.preset} ({cfg.num_params() / 1e6:.2f} M params), {describe(args, world, device)}"
        f", batch {args.batch}x{args.seq} per {'pipeline' if args.pp > 1 else 'rank'}, {args.steps} steps{resumed}",
        flush=True,
    )
    if args.compile:
        what = "each stage into one graph" if args.pp > 1 else "the model into one graph"
        print(f"The first step compiles {what}: {expected_compile_wait(args)}.", flush=True)
        if args.tp > 1 and args.reuse_blocks is False:
            print("Block reuse is off with --tp: tensor-parallel blocks are traced layer by layer.", flush=True)


def expected_compile_wait(args: argparse.Namespace) -> str:
    """What a newcomer should expect the first step to take (measured on the tiny preset, 2 ranks, 2 CPU cores)."""
    if args.backend_mode == "aot":
        return "seconds rather than tens of seconds (--backend-mode aot: eager kernels, no code generation)"
    return (
        "expect 30-50 s on a 2-core CPU with an empty Inductor cache (tiny preset; larger presets take longer), "
        "about 5 s when the cache is warm (one block body compiled for every layer; --no-reuse-blocks: one per layer)"
    )


@contextlib.contextmanager
def compile_ticker(bar, active: bool, every_s: float = 1.0):
    """While the first step compiles, the progress bar says so and counts the seconds: a cold compile takes tens of
    seconds on a small machine, and a bar standing at 0 looks hung."""
    if not active:
        yield
        return
    began, stop = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            bar.set_description_str(f"compiling {time.perf_counter() - began:.0f} s", refresh=True)

    thread = threading.Thread(target=tick, name="compile-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.set_description_str("train", refresh=False)
