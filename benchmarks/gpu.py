"""fsdp_graph on one GPU in one command (docs/gpus.md): writes benchmarks-gpu.md, its figures as benchmarks-gpu.json
and benchmarks-gpu-timeline.png into the folder $FSDP_GRAPH_GPU_OUT names (else docs/), rewriting both reports as each
section ends and printing each figure as soon as it is measured, so a run cut short keeps what it measured. Needs
only torch, numpy, tqdm and matplotlib, from a plain checkout (`PYTHONPATH=.`).

    python benchmarks/gpu.py [--quick] [--budget S] [--out FILE] [--only train plan offload overlap ...]

1. train: the main job (`python -m fsdp_graph train --preset small --mixed-precision bf16`) as one torchrun-style
   NCCL rank, against plain `torch.compile` of the same model without FSDP: step time and peak CUDA memory.
2. plan: Llama `1b` as rank 0 of a fake 8-rank process group on this GPU: compile time, step time and peak memory
   against `explain()`'s prediction.
3. offload: the main job again with `--cpu-offload`: the device memory it saves.
4. overlap: one training step under torch.profiler with CUDA activity: a timeline PNG of NCCL against compute
   kernels (next to the report) and the share of NCCL time that compute overlaps. NCCL kernels need 2+ GPUs (world
   1 has nothing to communicate); with one GPU the picture has the compute lane only, and the report says so.
5. hybrid: Llama `small` forward + backward as rank 0 of a fake 8-rank group, HYBRID_SHARD on a (2, 4) mesh against
   FULL_SHARD over 8: step time, memory and bytes sent on this GPU, and explain()'s prediction (`_small_params`
   says why a fake group and not a (1, 1) mesh on NCCL).
6. compress: the same FULL_SHARD run against `compress=weights=int8,grads=int8` (the job's `--compress`): step
   time (the cost of quantizing), memory, and the bytes each collective sends.
7. job1b: section 1's two runs at the `1b` preset (4 x 2048 tokens a step), where the GPU's compute and not the
   host's launch overhead sets the step time; adds the allocator's peak reserved memory.

Sections run in the order 1, 7, 3, 5, 6, 2, 4, so a spent budget leaves out the 1b plan and the overlap picture
first. Each measurement runs in a fresh child process (its own CUDA memory statistics, process group and Dynamo state);
all share one new Inductor cache. A section that fails or runs past the time budget is reported as such. Without
CUDA the script exits with status 2 and a message, and writes nothing. The parts that need no GPU live in
`benchmarks/gpu_report.py`.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_report import (  # noqa: E402
    ORDER,
    child_line,
    draw_timeline,
    gpu_preset,
    headline,
    kernel_intervals,
    length,
    overlap_fraction,
    parse_args,
    write_reports,
)

_TRAIN = ["--preset", "small", "--mixed-precision", "bf16", "--plot", "none", "--world", "1"]
_SECTION_CAP_S = {"train": 150.0, "plain": 150.0, "plan": 240.0, "overlap": 150.0}
_JOB1B = {"steps": 10, "extra": ["--preset", "1b", "--batch", "4", "--seq", "2048"]}  # 8,192 tokens a step
_HYBRID = {"strategy": "HYBRID_SHARD"}
_COMPRESSED = {"strategy": "FULL_SHARD", "compress": "weights=int8,grads=int8"}


def _small_params(quick: bool) -> dict:
    """The hybrid and compress sections' plan children: Llama `small` (the job's preset and batch) as rank 0 of a
    fake group of 8, each measured against the same FULL_SHARD run.

    Why a fake group: one GPU under NCCL is a world of 1, which sends nothing (the lowering emits no collective for
    one rank, so `--compress` has nothing to compress) and where a (1, 1) HYBRID mesh shards and replicates
    nothing: both would measure FULL_SHARD at world 1. As rank 0 of 8 the HYBRID model holds 1/4 of each
    parameter (2 replicas x 4 shards) against FULL_SHARD's 1/8 and runs its replica all-reduce, and compression
    quantizes every gather and gradient reduction; the collectives move no data, so communication is free and the
    memory, compute and bytes sent are real."""
    return {"preset": "small", "seq": 256, "batch": 8, "world": 8, "repeats": 3 if quick else 10}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child(args)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). Nothing was measured and "
            f"{args.out} was not written.",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    deadline = started + args.budget
    cache = tempfile.mkdtemp(prefix="fsdp_graph_gpu_bench_")
    out = Path(args.out)
    pending = [name for name in ORDER if name in args.only]
    meta = {
        "command": " ".join(["python benchmarks/gpu.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "elapsed_s": 0.0,
        "quick": args.quick,
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "pending": pending,
    }
    results: dict[str, dict] = {}

    def publish(section: str, result: dict) -> None:
        """Print the section's figure now and rewrite the report and its JSON with it."""
        results[section] = result
        pending.remove(section)
        meta["elapsed_s"] = time.perf_counter() - started
        print(headline(section, result), flush=True)
        write_reports(out, results, meta)

    def child(kind: str, cap: float | None = None, **params) -> dict:
        return _run_child(kind, {"steps": args.steps, **params}, deadline, cache, cap)

    print(f"fsdp_graph on {meta['device']}, torch {meta['torch']}: {', '.join(pending)}; writing {out}", flush=True)
    write_reports(out, results, meta)
    if {"train", "offload"} & set(args.only):
        ours = child("train", offload=False)
    if "train" in args.only:
        publish("train", _pair(ours=ours, plain=child("plain")))
    if "job1b" in args.only:
        publish("job1b", _pair(ours=child("train", cap=200.0, **_JOB1B), plain=child("plain", cap=200.0, **_JOB1B)))
    if "offload" in args.only:
        publish("offload", _pair(off=ours, on=child("train", offload=True)))
    small = _small_params(args.quick)
    if {"hybrid", "compress"} & set(args.only):
        full_shard = child("plan", cap=150.0, strategy="FULL_SHARD", **small)
    if "hybrid" in args.only:
        publish("hybrid", _pair(FULL_SHARD=full_shard, HYBRID_SHARD=child("plan", cap=150.0, **_HYBRID, **small)))
    if "compress" in args.only:
        publish("compress", _pair(off=full_shard, on=child("plan", cap=150.0, **_COMPRESSED, **small)))
    if "plan" in args.only:
        publish("plan", child("plan", seq=args.plan_seq, batch=1, repeats=2 if args.quick else 4))
    if "overlap" in args.only:
        publish("overlap", child("overlap", png=str(out.with_name(f"{out.stem}-timeline.png"))))
    report, figures = write_reports(out, results, meta)
    print(report.read_text())
    print(f"written: {report}, {figures}")
    return 0


def _pair(**runs: dict) -> dict:
    """The runs of a section, or one error naming each run that failed."""
    failed = [f"{name}: {run['error']}" for name, run in runs.items() if "error" in run]
    return {"error": "\n".join(failed)} if failed else runs


def _run_child(kind: str, params: dict, deadline: float, cache: str, cap: float | None = None) -> dict:
    """Run `gpu.py --child kind` in a new session (so a timeout ends its workers too) and return its result; `cap`
    replaces the kind's time limit."""
    timeout = min(cap or _SECTION_CAP_S[kind], deadline - time.perf_counter())
    if timeout < 20:
        return {"error": "not run: the time budget (--budget) was spent by the sections before it"}
    fd, result_path = tempfile.mkstemp(prefix=f"gpu_{kind}_", suffix=".json")
    os.close(fd)
    command = [sys.executable, __file__, "--child", kind, "--params", json.dumps(params), "--result", result_path]
    print(f"\n== {kind} {params} (limit {timeout:.0f} s)", flush=True)
    began = time.perf_counter()
    proc = subprocess.Popen(command, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"== {kind} timed out after {timeout:.0f} s", flush=True)
        return {"error": f"timed out after {timeout:.0f} s"}
    text = Path(result_path).read_text()
    os.unlink(result_path)
    if not text:
        result = {"error": f"the child process exited with status {code} without a result (see its output above)"}
    else:
        result = json.loads(text)
    print(f"== {kind} done in {time.perf_counter() - began:.0f} s: {child_line(kind, result)}", flush=True)
    return result


def _child(args) -> int:
    params = json.loads(args.params)
    runs = {"train": _train_child, "plain": _plain_child, "plan": _plan_child, "overlap": _overlap_child}
    try:
        result = runs[args.child](params)
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(args.result).write_text(json.dumps(result))
    return 1 if "error" in result else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_env(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or _free_port()),
    )


def _train_child(params: dict) -> dict:
    """The main job itself, as torchrun would start its one rank."""
    from fsdp_graph.train import job as train

    _torchrun_env()
    argv = [*_TRAIN, "--steps", str(params["steps"]), *(["--cpu-offload"] if params.get("offload") else [])]
    argv += params.get("extra", [])  # later options win: a CPU smoke run passes a smaller preset
    targs = train.parse_args(argv)
    summary = train.main(argv)
    return {
        "median_step_s": summary["median_step_s"],
        "peak_bytes": summary["peak_memory_bytes"][0],
        "reserved_bytes": _reserved(torch.device("cuda" if torch.cuda.is_available() else "cpu")),  # the job's
        "batch": targs.batch,
        "seq": targs.seq,
        "tokens_per_step": targs.batch * targs.seq,
        "compile_s": summary["compile_s"],
        "first_loss": summary["first_loss"],
        "last_loss": summary["last_loss"],
    }


def _plain_child(params: dict) -> dict:
    """The job's model, data, optimizer and clipping with plain torch.compile, no FSDP, bf16 autocast; measured as
    the job measures itself (wall time of each step up to the loss's `.item()`, median after the first)."""
    from fsdp_graph.train.corpus import batch_at, load_tokens
    from fsdp_graph.train.job import parse_args as train_args
    from fsdp_graph.train.llama import PRESETS, Llama, llama_loss

    targs = train_args([*_TRAIN, "--steps", str(params["steps"]), *params.get("extra", [])])
    device = _device(params)
    torch.manual_seed(targs.seed)
    model = Llama(PRESETS[targs.preset]).to(device)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=targs.lr, betas=(0.9, 0.95))
    compiled = torch.compile(model, fullgraph=True, backend=params.get("compile_backend", "inductor"))
    tokens = load_tokens()
    times, losses = [], []
    for step in range(targs.steps):
        batch = tuple(t.to(device) for t in batch_at(tokens, step, targs.seed, targs.batch, targs.seq))
        began = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = llama_loss(compiled, batch)
        loss.backward()
        if targs.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), targs.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - began)
    median = statistics.median(times[1:])
    return {
        "median_step_s": median,
        "peak_bytes": _peak(device),
        "reserved_bytes": _reserved(device),
        "batch": targs.batch,
        "seq": targs.seq,
        "tokens_per_step": targs.batch * targs.seq,
        "compile_s": times[0] - median,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def _device(params: dict) -> torch.device:
    """The GPU (a CPU smoke run of the children passes "cpu": the memory figures are then 0)."""
    device = torch.device(params.get("device", "cuda"))
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    return device


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def _reserved(device: torch.device) -> int:
    """The caching allocator's peak of reserved segments (0 off CUDA)."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def _loss_of(model, loss_fn, inputs):
    return loss_fn(model(*inputs))


def _plan_child(params: dict) -> dict:
    """Llama 1b (or `preset`), FULL_SHARD (or `strategy`; a hybrid one on a (2, world / 2) mesh) as rank 0 of a fake
    group of 8 (or `world`) on this GPU: explain()'s plan, then the same forward + backward compiled with Inductor
    and measured as tests/workers/explaining.py measures on CPU (peak above the step's start)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_graph
    from fsdp_graph.train.corpus import batch_at, load_tokens
    from fsdp_graph.train.llama import Llama, preset

    device = _device(params)
    world = params.get("world", 8)
    strategy = fsdp_graph.ShardingStrategy[params.get("strategy", "FULL_SHARD")]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        cfg = preset(params.get("preset", "1b"), seq=params["seq"])
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Llama(cfg)
        mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh(device.type, (2, world // 2)) if strategy.is_hybrid else None
        fsdp_graph.fully_shard(
            model, mesh, strategy=strategy, mixed_precision=mp, param_init_fn=model.init_module, device=device
        )
        inputs, targets = (t.to(device) for t in batch_at(load_tokens(), 0, 0, params["batch"], params["seq"]))

        def loss_fn(logits):
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

        compress = fsdp_graph.Compression.parse(params["compress"]) if params.get("compress") else None
        hardware = gpu_preset(torch.cuda.get_device_name(device)) if device.type == "cuda" else "nvlink"
        report = fsdp_graph.explain(model, inputs, loss_fn=loss_fn, hardware=hardware, compress=compress)
        free_comm = report.with_hardware(hardware, link_bytes_per_s=1e30, link_latency_s=0.0)  # 8 ranks: one node
        backend = fsdp_graph.make_backend(inductor=params.get("inductor", True), compress=compress)
        compiled = torch.compile(_loss_of, backend=backend, fullgraph=True)
        times, peaks, persistent = [], [], None
        for _ in range(1 + params["repeats"]):
            for p in model.parameters():
                p.grad = None
            start = _allocated(device)
            persistent = start if persistent is None else persistent
            _reset_peak(device)
            began = time.perf_counter()
            compiled(model, loss_fn, (inputs,)).backward()
            peak = _peak(device)  # synchronises
            times.append(time.perf_counter() - began)
            peaks.append(peak - start)
        sent = _bytes_sent(model, compiled, loss_fn, inputs, 2 if strategy.is_hybrid else None)
    finally:
        dist.destroy_process_group()
    step = statistics.median(times[1:])
    return {
        "strategy": strategy.name,
        "hardware": hardware,
        "compress": params.get("compress"),
        "sent_bytes": sent,
        "params": cfg.num_params(),
        "seq": params["seq"],
        "batch": params["batch"],
        "compile_s": times[0] - step,
        "step_s": step,
        "peak_bytes": statistics.median(peaks[1:]),
        "persistent_bytes": persistent,
        "predicted_peak_bytes": report.memory.peak_bytes,
        "predicted_persistent_bytes": report.memory.persistent_bytes,
        "predicted_step_s": report.step_time,
        "predicted_compute_s": free_comm.step_time,
    }


def _bytes_sent(model, compiled, loss_fn, inputs, replicas: int | None) -> dict[str, float]:
    """Per collective kind, the bytes this rank sends in one more forward + backward (ring algorithms, counted from
    the executed ops' shapes by `executed_collectives`: real for the world size even on a fake group)."""
    from fsdp_graph.planning.measure import executed_collectives

    for p in model.parameters():
        p.grad = None
    counted = executed_collectives(
        lambda: compiled(model, loss_fn, (inputs,)).backward(), group_size_of_all_reduce=replicas
    )
    return dict(counted.wire_bytes)


def _overlap_child(params: dict) -> dict:
    """The job's model on min(2, GPUs) NCCL ranks, one step profiled on rank 0."""
    world = min(2, torch.cuda.device_count())
    port = _free_port()
    if world == 1:
        return _overlap_rank(0, 1, port, params)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    torch.multiprocessing.spawn(_overlap_rank_to_file, args=(world, port, params, path), nprocs=world)
    return json.loads(Path(path).read_text())


def _overlap_rank_to_file(rank: int, world: int, port: int, params: dict, path: str) -> None:
    result = _overlap_rank(rank, world, port, params)
    if rank == 0:
        Path(path).write_text(json.dumps(result))


def _overlap_rank(rank: int, world: int, port: int, params: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from fsdp_graph.train import job as train
    from fsdp_graph.train.corpus import batch_at, load_tokens
    from fsdp_graph.train.llama import llama_loss

    _torchrun_env(rank, world, port)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        targs = train.parse_args([*_TRAIN, "--steps", "4"])
        _, model, opt, step_model, _ = train._build(targs, world, device, train._backend(targs))
        tokens = load_tokens()

        def step(i: int) -> None:
            batch = tuple(t.to(device) for t in batch_at(tokens, i, targs.seed, targs.batch, targs.seq, rank, world))
            llama_loss(step_model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for i in range(3):  # compiles, then warms the allocator
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(3)
            torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return {}
    fd, trace_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(trace_path)
    comm, compute = kernel_intervals(json.loads(Path(trace_path).read_text()))
    os.unlink(trace_path)
    title = f"one training step, Llama small bf16, world {world} (NCCL), rank 0"
    drawn = draw_timeline(comm, compute, params["png"], title)
    return {
        "world": world,
        "comm_ms": length(comm) / 1e3,
        "compute_ms": length(compute) / 1e3,
        "overlap_fraction": overlap_fraction(comm, compute),
        "png": Path(params["png"]).name if drawn else None,
    }


if __name__ == "__main__":
    sys.exit(main())
