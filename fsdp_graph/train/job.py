"""The main job: train a Llama-style model with `fully_shard` + the fsdp_graph compiler on the shipped corpus.

    python -m fsdp_graph train [--preset tiny] [--steps 40] [--strategy FULL_SHARD] [--mixed-precision none] ...
    torchrun --nproc-per-node 8 -m fsdp_graph train --preset 1b     # NCCL on GPUs, gloo on CPUs

Outside torchrun it starts `--world` gloo ranks on this machine's CPUs. Rank 0 shows a progress bar and prints a
summary table at the end; the loss curve goes to a PNG. A rank that fails (raises, is killed, or hangs past
`--timeout`) ends every rank, and the error names it.

Exit codes (`fsdp-graph train`): 0 done; 1 failed (a rank raised, died or hung; a non-finite run stopped; a save
failed); 2 bad options or an unusable --checkpoint-dir (before any rank starts); 75 (EX_TEMPFAIL) stopped by
SIGTERM or SIGUSR1 after saving a checkpoint (`--resume` continues it); 130 Ctrl-C (the last safe checkpoint named).

Test hooks, FSDP_GRAPH_FAIL_AT_STEP="RANK:STEP[:MODE]" (STEP 0-based): before step STEP that rank raises (no
MODE), SIGKILLs itself (kill), hangs in a Python loop (hang) or SIGSTOPs itself (stop); between its backward and its
optimizer step it sends SIGTERM to the launcher (term), SIGUSR1 to itself alone (usr1) or SIGINT to the launcher as
Ctrl-C would (int), or puts a NaN into one of its gradients (nan). While saving the checkpoint of step STEP (1-based,
the checkpoint's number) it SIGKILLs itself after writing its shard files (save), or sends SIGTERM to the launcher
(termsave).
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
from fsdp_graph.state.directory import CheckpointDirError
from fsdp_graph.train import checkpoints, layout, progress
from fsdp_graph.train.corpus import batch_at, load_tokens
from fsdp_graph.train.flags import _under_torchrun, build_parser  # noqa: F401  (build_parser: the CLI's options)
from fsdp_graph.train.flags import parse_args as _parse_args
from fsdp_graph.train.launch import RankFailedError, spawn
from fsdp_graph.train.llama import PRESETS, Llama, llama_loss, preset, tp_plan
from fsdp_graph.train.pipeline import build_pipeline
from fsdp_graph.train.pipeline import check_args as check_pipeline_args
from fsdp_graph.train.report import RunStats, describe, gather_per_rank, local_peak_memory, summarise

EXIT_FAILED, EXIT_USAGE, EXIT_PREEMPTED, EXIT_INTERRUPTED = 1, 2, 75, 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked options (fsdp_graph.train.flags); argparse's usage error (exit 2) when one is wrong."""
    return _parse_args(argv, __doc__)


def main(argv: list[str] | None = None) -> dict | None:
    """Run the job; returns rank 0's summary (None on other torchrun ranks; with "stopped" when a signal stopped
    it). Raises `RankFailedError` naming the rank that failed first when ranks were started here (torchrun reports
    failures itself), `CheckpointDirError` before any rank starts when --checkpoint-dir cannot be used."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> dict | None:
    """`main` on parsed options."""
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
    lock = checkpoints.prepare_dir(args)  # before any rank starts
    args.dir_prepared = True
    try:
        return spawn(train_rank, args.world, (args,), timeout_s=args.timeout)[0]
    finally:
        if lock is not None:
            lock.release()


def cli(argv: list[str] | None = None) -> int:
    """`fsdp-graph train`: main() with failures printed as one clear message instead of a traceback, and an exit
    code that says what happened (see the module docstring)."""
    args = parse_args(argv)
    try:
        result = run(args)
    except RankFailedError as e:
        print(f"\nfsdp-graph train FAILED: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except CheckpointDirError as e:
        print(f"fsdp-graph train: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        safe = checkpoints.last_safe(args.checkpoint_dir)
        where = (
            f"the last safe checkpoint is {safe} (continue with --resume)"
            if safe
            else "no checkpoint was saved" + ("" if args.checkpoint_dir else " (no --checkpoint-dir)")
        )
        print(
            f"\nfsdp-graph train: interrupted (Ctrl-C); every rank was stopped; {where}.", file=sys.stderr, flush=True
        )
        return EXIT_INTERRUPTED
    stopped = (result or {}).get("stopped")
    if stopped:
        saved = (
            f"checkpoint {stopped['checkpoint']} saved; continue with --resume"
            if stopped["checkpoint"]
            else "no checkpoint saved (no --checkpoint-dir)"
        )
        print(
            f"fsdp-graph train: stopped by {stopped['signal']} after step {stopped['step']} of {args.steps}; {saved} "
            f"(exit code {EXIT_PREEMPTED}).",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
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


def _build(args: argparse.Namespace, world: int, device: torch.device, backend: fsdp_graph.FSDPBackend | None):
    """The sharded model (built on meta, materialised one unit at a time), its optimizer, the model to call
    (compiled with `backend`, None: eager), and this rank's (data-parallel size, data-parallel rank).

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
    step_model = torch.compile(model, backend=backend, fullgraph=True) if backend else model
    return cfg, model, opt, step_model, (dp, dp_rank)


def train_rank(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """One rank of the job (spawned, or under torchrun). Returns the summary on rank 0 (and {"stopped": ...} on the
    others when a signal stopped the job). SIGTERM and SIGUSR1 make every rank finish its step, save and return."""
    with fsdp_graph.StopSignal() as stop:
        lock = None if getattr(args, "dir_prepared", False) else checkpoints.prepare_dir_on_rank0(args)
        try:
            return _train(rank, world, args, stop)
        finally:
            if lock is not None:
                lock.release()


def _train(rank: int, world: int, args: argparse.Namespace, stop: fsdp_graph.StopSignal) -> dict | None:
    from tqdm import tqdm

    device = collective_device()  # the accelerator of an NCCL (or mixed) group, else the CPU
    pipeline = None
    backend = _backend(args)
    # Inductor's compiled code travels with the checkpoints: a resume on an empty cache loads it (issue 36)
    compiled = backend if backend is not None and backend.keeps_compiled else None
    if args.pp > 1:
        if why := check_pipeline_args(args, world):
            raise ValueError(why)
        cfg, pipeline, opt = build_pipeline(
            args, world, device, _shard_kwargs(args), lambda m: _optimizer(args, m), backend
        )
        model = pipeline.model
        dp, dp_rank = pipeline.dp, pipeline.dp_rank  # data-parallel pipelines
    else:
        cfg, model, opt, step_model, (dp, dp_rank) = _build(args, world, device, backend)
    tokens = load_tokens()
    start, history = 0, []
    if found := checkpoints.resume(args, model, opt, rank, compiled):
        _, start, history = found
        history = [(s, v) for s, v in history if s <= start]
    if rank == 0:
        _print_header(args, cfg, world, device, start)
    losses_summed = dp * args.tp  # the guard's all-reduce adds one loss per pipeline, per tp rank
    guard = fsdp_graph.StepGuard(model, nonfinite=args.nonfinite, max_skips=args.nonfinite_skips, stop=stop)

    def step_fn(batch, step: int) -> fsdp_graph.StepCheck:
        if pipeline is not None:
            loss = pipeline.step(batch)  # the last stage's mean loss, 0 on the others
        else:
            loss = llama_loss(step_model, batch)
            loss.backward()
        checkpoints.mid_step_if_asked(rank, step, model, stop)
        norm = None
        if args.clip > 0:
            norm = fsdp_graph.clip_grad_norm_(model, args.clip, pp_group=pipeline.pp_group if pipeline else None)
        # One all-reduce: the loss the bar shows, the gradients' finiteness (the clip norm, or each rank's local
        # gradient norms) and the stop flag; every rank decides alike whether to apply the step and to stop.
        check = guard.check(step + 1, loss, grad_norm=norm, loss_ranks=losses_summed)
        if check.apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return check

    stats = RunStats(history=history)
    ar_group = 2 if fsdp_graph.ShardingStrategy[args.strategy].is_hybrid else args.tp if args.tp > 1 else world
    # The last step counts the collectives under the profiler: not the first (compiling) one, and late, because
    # the profiler's bookkeeping takes memory (up to 1 GB on the small preset) that the peak must not include.
    profile_at = args.steps - 1 if args.steps - start >= 3 else None
    executed, checkpoint, peak, stopped = None, None, None, None
    tokens_per_step = args.batch * args.seq * dp
    # A thread lock, not tqdm's default multiprocessing one: spawned ranks leave with os._exit, which would leak
    # its semaphore (a resource_tracker warning at the end of every run).
    tqdm.set_lock(threading.RLock())
    bar = tqdm(total=args.steps, initial=start, disable=rank != 0, desc="train", unit="step", dynamic_ncols=True)
    try:
        for step in range(start, args.steps):
            checkpoints.fail_if_asked(rank, step)
            progress.record(step + 1)
            ticker = compile_ticker(bar, rank == 0 and step == start and args.compile)
            batch = tuple(t.to(device) for t in batch_at(tokens, step, args.seed, args.batch, args.seq, dp_rank, dp))
            began = time.perf_counter()
            if step == profile_at:
                peak = local_peak_memory(device)
                out: list[fsdp_graph.StepCheck] = []
                with _native_stderr_muted():
                    executed = executed_collectives(
                        lambda b=batch, o=out, s=step: o.append(step_fn(b, s)), group_size_of_all_reduce=ar_group
                    )
                check = out[0]
                stats.profiled = len(stats.step_s)
            else:
                with ticker:
                    check = step_fn(batch, step)
            stats.step_s.append(time.perf_counter() - began)
            if check.apply:
                stats.history.append((step + 1, check.loss))
            else:
                stats.skipped.append(step + 1)
                if rank == 0:
                    bar.write(
                        f"step {step + 1} skipped: {check.what} ({check.skipped_in_a_row} in a row, up to "
                        f"{args.nonfinite_skips} allowed; the optimizer and its state untouched)"
                    )
            bar.set_postfix(loss=f"{check.loss:.3f}", tok_s=f"{tokens_per_step / stats.step_s[-1]:,.0f}", refresh=False)
            bar.update()
            if args.checkpoint_dir and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                checkpoint = checkpoints.save(args, model, opt, step + 1, stats.history, rank, stop, compiled)
            if check.stop:
                name = stop.signal_name or f"a signal that reached {check.stop_ranks} of the {world} ranks"
                stopped = {"signal": name, "step": step + 1, "checkpoint": None}
                break
    except Exception as e:
        if not getattr(e, "fsdp_graph_brief", False) and (late := progress.behind(e)) is not None:
            raise late from e
        raise
    finally:
        bar.close()
    last = stopped["step"] if stopped else args.steps
    if args.checkpoint_dir and last > start and checkpoint != checkpoints.checkpoint_path(args, last):
        checkpoint = checkpoints.save(args, model, opt, last, stats.history, rank, stop, compiled)
    if stopped:
        stopped["checkpoint"] = checkpoint
    mine, memory_what = peak or local_peak_memory(device)
    if peak:
        memory_what += ", before the profiled last step"
    memory = gather_per_rank(mine, device)
    if rank != 0:
        return {"stopped": stopped} if stopped else None
    summary = summarise(args, cfg, world, device, start, stats, executed, memory, memory_what, checkpoint)
    return {**summary, "stopped": stopped}


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
