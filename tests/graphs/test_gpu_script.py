"""benchmarks/gpu.py on a machine without a GPU: its command line, trace parsing, overlap, picture and report,
the clear exit without CUDA, and its measuring children run on the CPU with small models."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu
from benchmarks.gpu_report import (
    OUT_DIR_ENV,
    draw_timeline,
    gpu_preset,
    headline,
    intersection,
    kernel_intervals,
    length,
    overlap_fraction,
    parse_args,
    render_markdown,
    union,
)

# Under torch 2.11 too (.ci/run): the children are what the GPU machines (torch 2.11) run.
pytestmark = pytest.mark.oldest_torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_args_defaults_and_quick(monkeypatch):
    monkeypatch.delenv(OUT_DIR_ENV, raising=False)
    full = parse_args([])
    assert (full.steps, full.plan_seq, full.budget, full.quick) == (30, 2048, 470.0, False)
    assert full.out == "docs/benchmarks-gpu.md"
    monkeypatch.setenv(OUT_DIR_ENV, "/tmp/device-out")  # the folder the report, JSON and picture go to
    assert parse_args([]).out == "/tmp/device-out/benchmarks-gpu.md"
    assert parse_args(["--out", "r.md"]).out == "r.md"
    assert full.only == ["train", "plan", "offload", "overlap", "hybrid", "compress", "job1b"]
    quick = parse_args(["--quick", "--only", "plan", "overlap"])
    assert (quick.steps, quick.plan_seq, quick.budget, quick.only) == (8, 512, 360.0, ["plan", "overlap"])
    assert parse_args(["--quick", "--steps", "5"]).steps == 5
    with pytest.raises(SystemExit):
        parse_args(["--steps", "2"])


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_trace_to_intervals_and_overlap():
    trace = {
        "traceEvents": [
            _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 10),
            _kernel("ncclKernel_ReduceScatter_RING_LL_Sum_float", 20, 10),
            _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 5, 10),
            _kernel("triton_poi_fused_add_0", 12, 13),
            _kernel("Memcpy HtoD (Pinned -> Device)", 0, 40, cat="gpu_memcpy"),
            _kernel("cudaLaunchKernel", 0, 40, cat="cuda_runtime"),
            {"ph": "i", "cat": "kernel", "name": "ncclDevKernel_marker", "ts": 50},
        ]
    }
    comm, compute = kernel_intervals(trace)
    assert comm == [(0.0, 10.0), (20.0, 30.0)]
    assert compute == [(5.0, 15.0), (12.0, 25.0)]
    assert union(compute) == [(5.0, 25.0)] and length(compute) == 20.0
    assert intersection(comm, compute) == [(5.0, 10.0), (20.0, 25.0)]
    assert overlap_fraction(comm, compute) == 0.5
    assert overlap_fraction([], compute) is None
    assert overlap_fraction(comm, []) == 0.0
    assert kernel_intervals(trace["traceEvents"]) == (comm, compute)  # a bare event list works too


def test_gpu_preset_names_the_planner_preset_of_a_device():
    assert [gpu_preset(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4")] == [
        "h200",
        "h100",
        "a100",
        "nvlink",
    ]


def test_draw_timeline_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    assert draw_timeline([(0.0, 10.0)], [(5.0, 15.0), (20.0, 30.0)], str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_META = {"command": "python benchmarks/gpu.py", "date": "2030-01-01", "elapsed_s": 400, "quick": False,
         "device": "1 x NVIDIA H100", "torch": "2.13.0 (CUDA 12.8)"}  # fmt: skip


def _run(step_s: float, peak: int) -> dict:
    return {"median_step_s": step_s, "peak_bytes": peak, "compile_s": 40.0, "first_loss": 5.5, "last_loss": 3.25,
            "reserved_bytes": peak + 2**28, "batch": 4, "seq": 2048, "tokens_per_step": 8192}  # fmt: skip


def _plan(step_s: float, peak: int, persistent: int, sent: dict | None = None) -> dict:
    return {"params": 1.24e9, "seq": 2048, "batch": 1, "compile_s": 95.0, "step_s": step_s, "peak_bytes": peak,
            "persistent_bytes": persistent, "predicted_peak_bytes": 8400 * 2**20, "sent_bytes": sent or {},
            "predicted_persistent_bytes": 690 * 2**20, "predicted_step_s": 0.25, "predicted_compute_s": 0.18}  # fmt: skip


def test_render_markdown_reports_ratios_errors_and_missing_sections():
    mib = 2**20
    results = {
        "train": {"ours": _run(0.05, 900 * mib), "plain": _run(0.04, 1200 * mib)},
        "plan": _plan(0.2, 8000 * mib, 700 * mib),
        "offload": {"off": _run(0.05, 900 * mib), "on": _run(0.1, 300 * mib)},
        "overlap": {"world": 2, "comm_ms": 10.0, "compute_ms": 40.0, "overlap_fraction": 0.75, "png": "t.png"},
        "hybrid": {
            "FULL_SHARD": _plan(0.2, 8000 * mib, 700 * mib, {"all_gather": 200 * mib, "reduce_scatter": 400 * mib}),
            "HYBRID_SHARD": _plan(0.3, 9000 * mib, 1400 * mib, {"all_gather": 150 * mib, "reduce_scatter": 300 * mib,
                                                                 "all_reduce": 50 * mib}),
        },
        "compress": {
            "off": _plan(0.2, 8000 * mib, 700 * mib, {"all_gather": 200 * mib, "reduce_scatter": 400 * mib}),
            "on": _plan(0.24, 7000 * mib, 700 * mib, {"all_gather": 100 * mib, "all_to_all": 100 * mib}),
        },
        "job1b": {"ours": _run(0.128, 20000 * mib), "plain": _run(0.1024, 30000 * mib)},
    }  # fmt: skip
    text = render_markdown(results, _META)
    assert "| fsdp_graph (ours) | 50.0 ms | 1.25x | 900 MiB | 0.75x | 40.0 s | 5.500 -> 3.250 |" in text
    assert "| peak memory above the step's start | 8,000 MiB | 8,400 MiB | +5.0% |" in text
    assert "Saved: 600 MiB (66.7% of the peak), for 2.00x the step time." in text
    assert "75% of the NCCL time" in text and "![kernel timeline of one step](t.png)" in text
    assert (
        "| HYBRID_SHARD | 300.0 ms | 1.50x | 9,000 MiB | 1,400 MiB | 150 MiB | 350 MiB | 8,400 MiB | 250.0 ms |" in text
    )
    assert "| uncompressed | 200.0 ms | 1.00x | 8,000 MiB | 200 MiB | 400 MiB | 250.0 ms |" in text
    assert "| int8 weights and gradients | 240.0 ms | 1.20x | 7,000 MiB | 100 MiB | 100 MiB | 250.0 ms |" in text

    assert "| fsdp_graph (ours) | 128.0 ms | 1.25x | 64,000 | 20,000 MiB | 20,256 MiB | 40.0 s |" in text
    assert "| plain torch.compile | 102.4 ms | 1.00x | 80,000 | 30,000 MiB | 30,256 MiB |" in text

    failed = render_markdown({"train": {"error": "Traceback ...\nRuntimeError: boom"}}, _META)
    assert "**Failed**" in failed and "RuntimeError: boom" in failed
    assert "Not run (`--only` left out plan)" in failed and "Not run (`--only` left out overlap)" in failed
    assert "Not run (`--only` left out hybrid)" in failed and "Not run (`--only` left out compress)" in failed
    single = dict(results, overlap={"world": 1, "comm_ms": 0.0, "compute_ms": 40.0, "overlap_fraction": None,
                                    "png": None})  # fmt: skip
    assert "no NCCL kernel ran" in render_markdown(single, _META)
    assert "no NCCL kernel ran (needs 2+ GPUs)" in headline("overlap", single["overlap"])
    cut_short = render_markdown({"train": results["train"]}, {**_META, "pending": ["offload", "plan"]})
    assert "1 section(s)" not in cut_short and "2 section(s) still to run" in cut_short
    assert cut_short.count("Not measured yet: the run ended (or was cut short) before this section.") == 2
    assert "Not run (`--only` left out overlap)" in cut_short and "| fsdp_graph (ours) | 50.0 ms |" in cut_short

    # The line each section prints as soon as it ends.
    assert headline("train", results["train"]) == (
        "[train] step 50.0 ms against plain torch.compile's 40.0 ms (1.25x); peak 900 MiB against 1,200 MiB (0.75x)"
    )
    assert (
        headline("offload", results["offload"])
        == "[offload] peak 900 MiB -> 300 MiB: saves 600 MiB (66.7%), step 2.00x"
    )
    assert (
        headline("plan", results["plan"])
        == "[plan] 1b: step 200.0 ms, peak 8,000 MiB against explain()'s 8,400 MiB (+5.0%)"
    )
    assert headline("overlap", results["overlap"]) == "[overlap] world 2: compute hides 75% of 10.0 ms of NCCL kernels"
    assert headline("hybrid", results["hybrid"]).count("against explain()'s") == 2
    assert headline("job1b", results["job1b"]).startswith("[job1b] step 128.0 ms against plain torch.compile's 102.4 ms")
    assert headline("train", {"error": "Traceback ...\nRuntimeError: boom"}) == "[train] FAILED: RuntimeError: boom"


def test_main_without_cuda_exits_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.md"
    assert gpu.main(["--quick", "--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not out.exists()


def test_main_runs_the_hybrid_and_compress_children(tmp_path, monkeypatch):
    """`--only hybrid compress`: the children each section needs (CUDA and the children replaced; their own code runs
    in test_children_run_on_cpu), and a report and JSON with both sections, in the folder $FSDP_GRAPH_GPU_OUT
    names, written after each section."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "test GPU")
    asked = []
    seen_on_disk = []  # what the JSON held when each child started: a run cut short keeps the sections before it

    def run_child(kind, params, deadline, cache, cap=None):
        asked.append((kind, params.get("preset"), params.get("strategy"), params.get("compress")))
        seen_on_disk.append(json.loads(figures.read_text())["meta"]["pending"])
        return _plan(0.2, 2**30, 2**28)

    monkeypatch.setattr(gpu, "_run_child", run_child)
    monkeypatch.setenv(OUT_DIR_ENV, str(tmp_path / "device-out"))
    out, figures = tmp_path / "device-out" / "benchmarks-gpu.md", tmp_path / "device-out" / "benchmarks-gpu.json"
    assert gpu.main(["--quick", "--only", "hybrid", "compress"]) == 0
    assert asked == [
        ("plan", "small", "FULL_SHARD", None),  # the baseline of both sections, run once
        ("plan", "small", "HYBRID_SHARD", None),
        ("plan", "small", "FULL_SHARD", "weights=int8,grads=int8"),
    ]
    assert seen_on_disk == [["hybrid", "compress"], ["hybrid", "compress"], ["compress"]]
    text = out.read_text()
    assert "| HYBRID_SHARD | 200.0 ms | 1.00x |" in text and "| int8 weights and gradients | 200.0 ms |" in text
    assert "Not run (`--only` left out train)" in text and "still to run" not in text
    saved = json.loads(figures.read_text())
    assert saved["meta"]["pending"] == [] and set(saved["results"]) == {"hybrid", "compress"}
    assert saved["results"]["hybrid"]["HYBRID_SHARD"]["step_s"] == 0.2
    assert sorted(p.name for p in out.parent.iterdir()) == ["benchmarks-gpu.json", "benchmarks-gpu.md"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_script_without_cuda_exits_with_status_2(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, os.path.join(_ROOT, "benchmarks", "gpu.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "needs a CUDA GPU" in done.stderr and not out.exists()


def test_children_run_on_cpu(monkeypatch):
    """The measuring code itself, on small models (eager kernels; memory figures are CUDA-only, so not checked)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # restored after the test: the train child sets torchrun's variables
    # Eager: what the child adds is its glue (torchrun's variables, --cpu-offload, the summary it reads back); the
    # job compiled is test_train_job.py's, offload compiled test_loop.py::test_cpu_offload_params'.
    extra = ["--preset", "tiny", "--no-compile", "--batch", "2", "--seq", "32"]
    train = gpu._train_child({"steps": 3, "extra": extra, "offload": True})
    assert train["median_step_s"] > 0 and train["last_loss"] < train["first_loss"], train
    tiny = {"seq": 32, "batch": 1, "repeats": 1, "preset": "tiny", "device": "cpu", "inductor": False}
    plan = gpu._plan_child(tiny)
    assert plan["step_s"] > 0 and plan["predicted_peak_bytes"] > 0, plan
    assert 0 < plan["predicted_compute_s"] < plan["predicted_step_s"], plan
    assert set(plan["sent_bytes"]) == {"all_gather", "reduce_scatter"}, plan["sent_bytes"]
    # One child covers both sections' parameters: HYBRID_SHARD with int8 gathers (weights only, so the replica
    # all-reduce stays one collective to count; the compress section's FULL_SHARD run passes its scheme the same way).
    hybrid = gpu._plan_child({**tiny, **gpu._HYBRID, "compress": "weights=int8"})
    assert hybrid["step_s"] > 0 and (hybrid["strategy"], hybrid["compress"]) == ("HYBRID_SHARD", "weights=int8")
    # Rank 0 of (2 replicas, 4 shards) holds twice FULL_SHARD's 1/8 (the rest, buffers and batch, is alike).
    assert 1.5 < hybrid["predicted_persistent_bytes"] / plan["predicted_persistent_bytes"] < 2.0, (plan, hybrid)
    sent, packed = plan["sent_bytes"], hybrid["sent_bytes"]
    assert set(packed) == {"all_gather", "reduce_scatter", "all_reduce"} and packed["all_reduce"] > 0, packed
    # Uncompressed, gathers over 4 ranks of twice the shard send 6/7 of FULL_SHARD's over 8; int8 codes and block
    # scales send about half of that.
    assert packed["all_gather"] < sent["all_gather"] / 1.8, (sent, packed)


def test_train_cpu_offload_flag(fake_pg):
    """Section 3 runs the main job with --cpu-offload: the flag reaches fully_shard."""
    from fsdp_graph.train import job as train

    for flag, expected in (([], None), (["--cpu-offload"], torch.device("cpu"))):
        args = train.parse_args(["--preset", "tiny", "--no-compile", *flag])
        _, model, _, _, _ = train._build(args, 4, torch.device("cpu"), train._backend(args))
        assert {s.compute_device for s in model._fsdp_root.flat_params} == {expected}, flag


def test_main_runs_the_main_job_at_1b_against_plain_compile(tmp_path, monkeypatch):
    """`--only job1b`: section 1's two children at the 1b preset (10 steps, 4 x 2048 tokens), and their section."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "test GPU")
    asked = []

    def run_child(kind, params, deadline, cache, cap=None):
        asked.append((kind, params["steps"], params["extra"]))
        return _run(0.1, 2**34)

    monkeypatch.setattr(gpu, "_run_child", run_child)
    out = tmp_path / "benchmarks-gpu.md"
    assert gpu.main(["--only", "job1b", "--out", str(out)]) == 0
    extra = ["--preset", "1b", "--batch", "4", "--seq", "2048"]
    assert asked == [("train", 10, extra), ("plain", 10, extra)]
    assert "| fsdp_graph (ours) | 100.0 ms | 1.00x | 81,920 | 16,384 MiB | 16,640 MiB |" in out.read_text()
