"""The GPU presets against published training measurements: fitted on some rows, tested on the others (issue 37).

    python benchmarks/calibration.py            # plan every row (cached), fit, print, rewrite docs/planning.md's table
    python benchmarks/calibration.py kernels    # the per-kernel overhead, fitted to XLA's published H100 matmuls
    python benchmarks/calibration.py --retrace  # plan every row again instead of reading the cache

Each `Row` is one published figure (tokens per second per GPU, and peak memory per GPU where given) with its
source, the configuration it was measured at, and its part: "fit" rows set the one number each GPU preset fits,
`compute_efficiency` (the sustained fraction of its published matmul and attention rates), "test" rows only check
it. Errors are reported on the test rows. Every row is planned as `plan()` plans a layout: `explain_by_depth` of
its Llama at depths 3 and 4 (4 and 6, whole periods, where every second block is checkpointed) on the meta device
with a fake process group of its world size (`fsdp_graph.planning.profiles`), then `layouts.evaluate`; the traced
figures are re-timed at each efficiency of `EFFICIENCIES` and cached in benchmarks/data/calibration.json, so
regenerating the table traces nothing.

Held back and never read: torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (issue 37 keeps it to judge
the result); kept out with it, as its configuration: the Llama 3 8B runs on 8 GPUs in torchtitan's commit messages.
Not used: rows with float8 (not modelled; torchtitan's Trainy H200 benchmark), block-level selective checkpointing of
an unpublished fraction (fms-fsdp's "Selective AC"), tensor parallelism with sequence parallelism (KempnerForge's
TP rows, TT_165's 2D rows: plan()'s TP has none), a single-GPU row whose memory cannot hold fp32 master weights
(KempnerForge's first), the config validation report's TP rows (sequence parallelism, as above), its pipeline rows
(their schedule not checked against plan()'s 1F1B) and its two small models, TT_165's FSDP1 runs
(flat parameters freed through recordStream), its compiled run without buffer reuse (an Inductor option plan()
does not model) and its two runs at the device's limit (88.2 and 90.3 of 95.0 GiB reserved, where the allocator
empties its cache and retries), torchtune's README (LoRA, or full finetunes of bf16 parameters on unpacked samples
of varying length), accelerate's benchmarks/fsdp2 (Qwen2, plots only) and Lightning's FSDP guide (an fp32
nn.Transformer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_graph.planning.layouts import PLAIN_LOOP, Layout, TrainingLoop, evaluate  # noqa: E402
from fsdp_graph.planning.profiles import Profile, ProfileKey, Profiles, figures, trace  # noqa: E402
from fsdp_graph.train.llama import LLAMA3_VOCAB, LlamaConfig, preset  # noqa: E402
from passes.hardware import GIB, GPUS, Hardware, nic_bytes_per_s  # noqa: E402

CACHE = ROOT / "benchmarks" / "data" / "calibration.json"
XLA_TABLE = ROOT / "benchmarks" / "data" / "xla_sm90_matmul.csv"
DOC = ROOT / "docs" / "planning.md"
EFFICIENCIES = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DEPTHS = (3, 4)
LAYER_DEPTHS = (4, 6)  # checkpointing every second block: whole periods of two, as plan() samples it

TT_2024 = "https://github.com/pytorch/torchtitan/blob/3faaa1a0dee68ce028400e3dafd1735d152cb4f8/docs/performance.md"
TT_NET = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
FMS = "https://github.com/foundation-model-stack/fms-fsdp/blob/ed74fd5/README.md"
FMS_OLD = "https://github.com/foundation-model-stack/fms-fsdp/blob/0d319983c4b3b7f7b3b5e2c5e7f746746b6f73a9/README.md"
KF = "https://github.com/KempnerInstitute/KempnerForge/blob/abbbac3/benchmarks/mfu_scaling/mfu_scaling.md"
KF_VALIDATION = (
    "https://github.com/KempnerInstitute/KempnerForge/blob/abbbac3/benchmarks/config_validation/config_validation.md"
)
# torchtitan's per-parameter FSDP commit (pull request 165); its message is the pull request's description.
TT_165 = "https://github.com/pytorch/torchtitan/commit/83c879f18763611bda68586c45f0082fd568d646"
H100_HBM2E_GIB = 95.0396  # the GPU memory TT_165's percentages are of

LLAMA2_7B = LlamaConfig(vocab=32000, dim=4096, layers=32, heads=32, kv_heads=32, hidden=11008, seq=4096, tied=False)
LLAMA2_13B = LlamaConfig(vocab=32000, dim=5120, layers=40, heads=40, kv_heads=40, hidden=13824, seq=4096, tied=False)
LLAMA2_70B = LlamaConfig(vocab=32000, dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, seq=4096, tied=False)
LLAMA3_8B = preset("8b", vocab=LLAMA3_VOCAB, seq=8192)
LLAMA3_70B = preset("70b", vocab=LLAMA3_VOCAB, seq=8192)
LLAMA3_405B = preset("405b", vocab=LLAMA3_VOCAB, seq=8192)
KF_7B = preset("8b", vocab=LLAMA3_VOCAB, seq=4096)  # dim 4096, 32 layers, kv 8, ffn 14336 (1.3x, multiple of 1024)
# KempnerForge's trainer at KF's commit: scripts/train.py casts the model to its param_dtype (bf16) before FSDP2
# (kempnerforge/distributed/parallel.py) and steps micro-batches under `maybe_no_sync` (training/grad.py:
# set_requires_gradient_sync(False) on all but the last). Its loss, `F.cross_entropy` on the bf16 logits it holds
# through the backward, is planned as the profile's fp32 log-softmax: about 4 bytes a logit too many on these rows
# (docs/planning.md).
KF_LOOP = TrainingLoop(bf16_model=True, sync_each_microbatch=False)
KF_13B = LlamaConfig(vocab=LLAMA3_VOCAB, dim=5120, layers=40, heads=40, kv_heads=8, hidden=17920, seq=4096, tied=False)


@dataclass(frozen=True)
class Row:
    """One published measurement. `layout`'s micro-batch and micro-batches are the source's local batch and
    gradient accumulation; `nic_gbps`: the network per GPU (Gb/s) the source states (or assumed, `note`);
    `tokens_per_s` None: a second memory figure of a run whose throughput another row carries;
    `expandable_segments`: the source ran PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved memory)."""

    name: str
    part: str  # "fit" or "test"
    source: str
    gpu: str  # a preset of passes.hardware.GPUS
    config: LlamaConfig
    layout: Layout
    seq: int
    compiled: bool
    tokens_per_s: float | None  # per GPU
    memory_gib: float | None = None
    memory_kind: str = "allocated"  # "allocated" (max_memory_allocated) or "reserved"
    optimizer: str = "adamw"
    nic_gbps: float | None = None
    ranks_per_node: int = 8
    bf16_reduce: bool = False  # gradients reduced in bf16 (FSDP1's bfSixteen policy), not fp32
    expandable_segments: bool = False
    loop: TrainingLoop = PLAIN_LOOP  # what the source's training loop does to memory
    note: str = ""

    def hardware(self, efficiency: float) -> Hardware:
        hw = GPUS[self.gpu]
        fields = {"compute_efficiency": efficiency, "ranks_per_node": self.ranks_per_node}
        if self.nic_gbps is not None:
            fields["inter_bytes_per_s"] = nic_bytes_per_s(self.nic_gbps)
        return dataclasses.replace(hw, **fields)


def _fsdp(world: int, ac: str, mb: int, accumulate: int = 1) -> Layout:
    return Layout(1, 1, world, 1, ac, mb, accumulate)


def _kf_row(
    name: str,
    part: str,
    source: str,
    config: LlamaConfig,
    layout: Layout,
    compiled: bool,
    tokens: float,
    memory: float,
    note: str = "",
) -> Row:
    """KempnerForge on H200s, 4 per node, 400 Gb/s per GPU, fused AdamW, seq 4096, its trainer's loop (KF_LOOP)."""
    return Row(
        name, part, source, "h200", config, layout, 4096, compiled, tokens, memory, optimizer="adamw-fused",
        nic_gbps=400, ranks_per_node=4, loop=KF_LOOP, note=note,
    )  # fmt: skip


# torchtitan at TT_165's runs: (row, checkpointing, compiled, tokens/s, memory GiB, memory kind, note); see ROWS.
def _tt_165_row(name: str, ac: str, compiled: bool, tokens: float | None, memory: float, kind: str, note: str) -> Row:
    layout, loop = _fsdp(8, ac, 8), TrainingLoop(holds_fp32_logits=True)
    return Row(
        name,
        "test",
        TT_165,
        "h100-hbm2e",
        LLAMA2_7B,
        layout,
        2048,
        compiled,
        tokens,
        memory,
        kind,
        loop=loop,
        note=note,
    )


_TT_165_RUNS = (
    ("tt-h100-l2-7b-full-eager", "full", False, 6200, 0.2392 * H100_HBM2E_GIB, "allocated",
     "peak active 23.92%; 6100-6300 tokens/s"),
    ("tt-h100-l2-7b-full-eager-reserved", "full", False, None, 0.3264 * H100_HBM2E_GIB, "reserved",
     "peak reserved 32.64% of the run above"),
    ("tt-h100-l2-7b-layer-eager", "layer", False, 6700, 0.5213 * H100_HBM2E_GIB, "allocated",
     "peak active 52.13%; 6600-6800 tokens/s"),
    ("tt-h100-l2-7b-layer-eager-reserved", "layer", False, None, 0.6251 * H100_HBM2E_GIB, "reserved",
     "peak reserved 62.51% of the run above"),
    # torch.compile of the whole model (Inductor buffer reuse enabled, its default): reserved only
    ("tt-h100-l2-7b-full-compiled", "full", True, 7350, 28.90, "reserved", "7200-7500 tokens/s"),
    ("tt-h100-l2-7b-layer-compiled", "layer", True, 8250, 53.83, "reserved", "8100-8400 tokens/s"),
)  # fmt: skip

ROWS: tuple[Row, ...] = (
    # torchtitan, 64 A100 80GB, FSDP2 without torch.compile (the configs' default then), bf16 / fp32 reduce.
    Row("tt-a100-l3-8b-layer", "fit", TT_2024, "a100", LLAMA3_8B, _fsdp(64, "layer", 1), 8192, False, 2904),
    Row("tt-a100-l3-8b-op", "fit", TT_2024, "a100", LLAMA3_8B, _fsdp(64, "selective", 1), 8192, False, 2973),
    Row("tt-a100-l3-70b-full", "fit", TT_2024, "a100", LLAMA3_70B, _fsdp(64, "full", 1), 8192, False, 331),
    Row("tt-a100-l2-13b-none", "fit", TT_2024, "a100", LLAMA2_13B, _fsdp(64, "none", 2), 4096, False, 2162),
    Row("tt-a100-l2-13b-layer", "fit", TT_2024, "a100", LLAMA2_13B, _fsdp(64, "layer", 2), 4096, False, 1914),
    Row("tt-a100-l2-13b-op", "fit", TT_2024, "a100", LLAMA2_13B, _fsdp(64, "selective", 2), 4096, False, 1904),
    Row("tt-a100-l2-70b-op", "fit", TT_2024, "a100", LLAMA2_70B, _fsdp(64, "selective", 1), 4096, False, 355),
    Row("tt-a100-l2-70b-full", "fit", TT_2024, "a100", LLAMA2_70B, _fsdp(64, "full", 2), 4096, False, 353),
    # torchtitan, Llama 3.1 405B on 128 Grand Teton H100s (HBM2e, 500 W; 400 Gb/s per GPU, TT_NET), FSDP 16 x TP 8.
    Row(
        "tt-h100-405b-full",
        "test",
        TT_2024,
        "h100-hbm2e",
        LLAMA3_405B,
        Layout(8, 1, 16, 1, "full", 2, 1),
        8192,
        True,
        109,
        nic_gbps=400,
        note="the source's TP adds sequence parallelism; plan()'s has none",
    ),  # fmt: skip
    # fms-fsdp (IBM), Llama 2 at 4096 tokens, FSDP1 / HSDP (sharded in a node), no checkpointing, batch 2 per GPU,
    # bf16 parameters and reductions (fms_fsdp/policies/mixed_precision.py: bfSixteen).
    Row(
        "fms-h100-7b-hsdp-compiled",
        "fit",
        FMS,
        "h100",
        LLAMA2_7B,
        Layout(1, 1, 8, 12, "none", 2, 1),
        4096,
        True,
        9600,
        nic_gbps=100,
        bf16_reduce=True,
        note="96 GPUs, 800 Gb/s taken as per node",
    ),  # fmt: skip
    Row(
        "fms-a100-7b-hsdp-compiled",
        "test",
        FMS,
        "a100",
        LLAMA2_7B,
        Layout(1, 1, 8, 16, "none", 2, 1),
        4096,
        True,
        4550,
        nic_gbps=50,
        bf16_reduce=True,
        note="128 GPUs, 400 Gb/s taken as per node",
    ),  # fmt: skip
    Row(
        "fms-a100-7b-hsdp-eager",
        "test",
        FMS_OLD,
        "a100",
        LLAMA2_7B,
        Layout(1, 1, 8, 16, "none", 2, 1),
        4096,
        False,
        3760,
        nic_gbps=50,
        bf16_reduce=True,
        note="128 GPUs, 400 Gb/s taken as per node",
    ),  # fmt: skip
    Row(
        "fms-a100-13b-hsdp-eager",
        "test",
        FMS_OLD,
        "a100",
        LLAMA2_13B,
        Layout(1, 1, 8, 16, "none", 1, 1),
        4096,
        False,
        1700,
        nic_gbps=50,
        bf16_reduce=True,
        note="128 GPUs, 400 Gb/s taken as per node",
    ),  # fmt: skip
    # KempnerForge, H200 141 GB, 4 per node, InfiniBand (speed not stated: 400 Gb/s per GPU assumed), FSDP2, full
    # checkpointing, fused AdamW, clipping, seq 4096; memory is max_memory_allocated in GiB ("GB" in the table).
    _kf_row("kf-h200-7b-fsdp2", "fit", KF, KF_7B, _fsdp(2, "full", 2, 4), True, 18728 / 2, 62.4),
    _kf_row("kf-h200-7b-fsdp4", "test", KF, KF_7B, _fsdp(4, "full", 4, 2), True, 38983 / 4, 61.1),
    _kf_row(
        "kf-h200-13b-fsdp8-eager",
        "test",
        KF,
        KF_13B,
        _fsdp(8, "full", 4, 4),
        False,
        35405 / 8,
        88.5,
        "2 nodes; the source ran it uncompiled",
    ),
    # KempnerForge's config validation report (KF_VALIDATION, its commit 601aba9: the same model cast, `maybe_no_sync`
    # and memory figure), configs/train/7b.toml (one node, batch 8, 4 accumulated) and 7b_32gpu_fsdp.toml (8 nodes,
    # batch 4, 4 accumulated), both compiled with full checkpointing; steady-state tokens/s over all GPUs.
    _kf_row("kf-h200-7b-fsdp4-validation", "test", KF_VALIDATION, KF_7B, _fsdp(4, "full", 8, 4), True, 38858 / 4, 81.0),
    _kf_row(
        "kf-h200-7b-fsdp32-validation",
        "test",
        KF_VALIDATION,
        KF_7B,
        _fsdp(32, "full", 4, 4),
        True,
        297384 / 32,
        51.3,
        "8 nodes, NDR 400 Gb/s InfiniBand",
    ),
    # torchtitan at TT_165 (March 2024), one node of 8 Grand Teton H100s (95.04 GiB, HBM2e), FSDP2 over all 8, the
    # "7B" flavor of train_configs/llama_7b.toml (Llama 2 7B: dim 4096, 32 layers, 32 heads, ffn 11008, Llama 2
    # tokenizer, 32000), local batch 8, seq 2048, no accumulation, fp32 parameters with bf16 compute and fp32
    # reduce-scatter, AdamW (foreach) with clipping, fp32 logits and loss; every block resharded after forward but
    # the last. "AC" is full checkpointing, "SAC" the selective default then (option "2": every second block,
    # "layer" here). Memory: the source's peak active (torch's active_bytes peak: allocated plus blocks awaiting
    # another stream, which FSDP2 does not use) and peak reserved, as percentages of 95.0396 GiB for the eager
    # runs; the allocator's default segments (its run script sets no PYTORCH_CUDA_ALLOC_CONF). Tokens/s: the
    # middle of the range given.
    *(_tt_165_row(*run) for run in _TT_165_RUNS),
)


def _key(row: Row) -> ProfileKey:
    key = row.layout.profile_key(row.config, row.seq, True)
    return dataclasses.replace(key, compiled=row.compiled, bf16_reduce=row.bf16_reduce)


def trace_row(row: Row) -> dict:
    """The row's figures at each depth of `DEPTHS` and efficiency of `EFFICIENCIES` (traced once, re-timed)."""
    key = _key(row)
    profiles = Profiles(row.hardware(1.0), row.optimizer, True, row.expandable_segments)
    out: dict = {}
    for depth in LAYER_DEPTHS if row.layout.checkpoint == "layer" else DEPTHS:
        report = trace(key, depth, profiles)
        for efficiency in EFFICIENCIES:
            timed = report.with_hardware(row.hardware(efficiency))
            out.setdefault(str(efficiency), {})[str(depth)] = figures(timed)
    return out


def predict(row: Row, traced: dict, efficiency: float) -> tuple[float, float]:
    """(tokens/s per GPU, memory GiB) at `efficiency`, the step time interpolated in 1 / efficiency between the
    traced grid's neighbours (compute time scales with it; communication does not)."""
    below = max(e for e in EFFICIENCIES if e <= efficiency)
    above = min(e for e in EFFICIENCIES if e >= efficiency)
    results = [_evaluate(row, traced, e) for e in (below, above)]
    if above == below:
        weight = 0.0
    else:
        weight = (1 / below - 1 / efficiency) / (1 / below - 1 / above)
    step = results[0][0] * (1 - weight) + results[1][0] * weight
    tokens = row.layout.dp_shard * row.layout.dp_replicate * row.layout.micro_batch * row.layout.microbatches * row.seq
    return tokens / step / row.layout.world, results[0][1]


def _evaluate(row: Row, traced: dict, efficiency: float) -> tuple[float, float]:
    sampled = {int(depth): figs for depth, figs in traced[str(efficiency)].items()}
    profile = Profile(_key(row), tuple(sorted(sampled)), sampled, 0.0)  # the depths it was traced at
    e = evaluate(row.layout, profile, row.config, row.seq, row.hardware(efficiency), math.inf, row.loop)
    memory = e.reserved_bytes if row.memory_kind == "reserved" else e.allocated_bytes
    return e.step_time, memory / GIB


def fit(rows: list[Row], cache: dict) -> dict[str, float]:
    """Per GPU preset, the efficiency (on a 0.01 grid) with the least median |log error| over its fit rows."""
    fitted = {}
    for gpu in sorted({r.gpu for r in rows if r.part == "fit"}):
        mine = [r for r in rows if r.part == "fit" and r.gpu == gpu]
        grid = [e / 100 for e in range(40, 101)]
        fitted[gpu] = min(
            grid,
            key=lambda e: statistics.median(
                abs(math.log(predict(r, cache[r.name], e)[0] / r.tokens_per_s)) for r in mine
            ),
        )
    if "h100" in fitted:
        fitted.setdefault("h100-hbm2e", fitted["h100"])  # the same GPU, the one fitted number carried over
    return fitted


def presets_off_the_fit(fitted: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{GPU: (its preset's compute_efficiency, the fitted one)} where they differ: plan() uses the presets."""
    return {
        gpu: (GPUS[gpu].compute_efficiency, value)
        for gpu, value in fitted.items()
        if GPUS[gpu].compute_efficiency != value
    }


def table(rows: list[Row], cache: dict, fitted: dict[str, float]) -> str:
    lines = [
        "| row | part | GPU (efficiency) | model, layout | published tokens/s/GPU | predicted | error | "
        "published memory GiB | predicted | error | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        efficiency = fitted.get(r.gpu, 1.0)
        tokens, memory = predict(r, cache[r.name], efficiency)
        model = f"{r.config.num_params() / 1e9:.0f}B, {r.layout.describe()}, seq {r.seq}" + (
            "" if r.compiled else ", eager"
        )
        mem = ("", "", "")
        if r.memory_gib is not None:
            mem = (
                f"{r.memory_gib:.1f} ({r.memory_kind})",
                f"{memory:.1f}",
                f"{100 * (memory / r.memory_gib - 1):+.1f}%",
            )
        tput = ("", "", "")
        if r.tokens_per_s is not None:
            tput = (f"{r.tokens_per_s:,.0f}", f"{tokens:,.0f}", f"{100 * (tokens / r.tokens_per_s - 1):+.1f}%")
        lines.append(
            f"| {r.name} | {r.part} | {r.gpu} ({efficiency:.2f}) | {model} | {tput[0]} | {tput[1]} | {tput[2]} | "
            f"{mem[0]} | {mem[1]} | {mem[2]} | [link]({r.source}) |"
        )
    return "\n".join(lines) + "\n"


def goals(rows: list[Row], cache: dict, fitted: dict[str, float]) -> str:
    """The issue's goals on the test rows: median |error| within 10% over at least 6 rows, none worse than 20%.
    Nothing is fitted to memory, so every row with a published memory figure tests it."""
    out = []
    for what, index, published in (("tokens/s per GPU", 0, "tokens_per_s"), ("memory", 1, "memory_gib")):
        errors = []
        for r in rows:
            if getattr(r, published) is None or (r.part != "test" and published == "tokens_per_s"):
                continue
            value = predict(r, cache[r.name], fitted.get(r.gpu, 1.0))[index]
            errors.append(abs(value / getattr(r, published) - 1))
        if not errors:
            out.append(f"{what}: no test rows")
            continue
        median, worst = statistics.median(errors), max(errors)
        met = len(errors) >= 6 and median <= 0.10 and worst <= 0.20
        out.append(
            f"{what}: {len(errors)} test rows, median |error| {100 * median:.1f}%, worst {100 * worst:.1f}% -> "
            + ("goal met" if met else "goal NOT met (needs >= 6 rows, median <= 10%, worst <= 20%)")
        )
    return "\n".join(out)


def kernels() -> None:
    """Fit time = max(flops / rate, bytes / 3.35 TB/s) + t0 to XLA's H100 bf16 matmul entries."""
    entries = []
    for line in XLA_TABLE.read_text().splitlines():
        if line and not line.startswith(("#", "b,")):
            b, m, n, k, tflops = (float(x) for x in line.split(","))
            entries.append((2 * b * m * n * k, 2 * b * (m * k + k * n + m * n), tflops * 1e12))
    best = None
    for rate in (r * 1e12 for r in range(700, 901, 5)):
        for t0 in (t * 0.25e-6 for t in range(0, 61)):
            errs = [math.log(f / (max(f / rate, by / 3.35e12) + t0) / measured) for f, by, measured in entries]
            rms = math.sqrt(sum(e * e for e in errs) / len(errs))
            if best is None or rms < best[0]:
                best = (rms, rate, t0)
    rms, rate, t0 = best
    print(
        f"{len(entries)} shapes: rate {rate / 1e12:.0f} TFLOP/s, per-kernel overhead {t0 * 1e6:.2f} us, RMS error {100 * rms:.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=("rows", "kernels"), default="rows")
    parser.add_argument("--rows", nargs="+", help="only these rows")
    parser.add_argument("--retrace", action="store_true")
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/planning.md alone")
    args = parser.parse_args()
    if args.mode == "kernels":
        kernels()
        return
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    for row in rows:
        if args.retrace or row.name not in cache:
            print(f"planning {row.name} ...", flush=True)
            cache[row.name] = trace_row(row)
            CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True))
    fitted = fit(rows, cache)
    text = table(rows, cache, fitted)
    print(text)
    summary = goals(rows, cache, fitted)
    print(summary)
    if not args.rows and (stale := presets_off_the_fit(fitted)):
        print(f"passes/hardware.py's presets differ from this fit, set their fitted_efficiency: {stale}")
    if not args.no_doc and not args.rows:
        _write_doc(text, summary, fitted)


BEGIN, END = "<!-- calibration table: benchmarks/calibration.py -->", "<!-- end of calibration table -->"


def _write_doc(text: str, summary: str, fitted: dict[str, float]) -> None:
    doc = DOC.read_text()
    fits = ", ".join(f"{gpu} {value:.2f}" for gpu, value in sorted(fitted.items()))
    block = f"{BEGIN}\nFitted `compute_efficiency`: {fits}.\n\n{text}\n```\n{summary}\n```\n{END}"
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END) :]
    else:
        doc += "\n" + block + "\n"
    DOC.write_text(doc)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
