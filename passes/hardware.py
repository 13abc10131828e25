"""What the cost model charges: a device's kernel rates and the links between devices, and the presets.

A `Hardware` describes one accelerator and its node: the rates kernels run at (`passes.kernels` turns them into a
kernel's time) and a two-level topology, `ranks_per_node` ranks joined by the intra-node link and nodes joined
by the network (`collective_seconds` costs a collective by which of the two its group crosses). Fields left at
None fall back to the flat model the first presets used: one rate for every flop, one link for every group.

The GPU presets' numbers are published measurements, cited where they are set; `calibration` says which fields a
preset's calibration fitted (benchmarks/calibration.py, docs/planning.md) and what they came out as.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """Throughputs the simulator charges.

    Compute: a kernel takes max(flops / rate, bytes read and written / memory_bytes_per_s), plus
    `kernel_overhead_s` per kernel (`passes.kernels.kernel_seconds`). The rate is `matmul_flops_per_s` for matmuls
    (`fp32_matmul_flops_per_s` for fp32 ones), `attention_flops_per_s` for fused attention, and `flops_per_s` for
    anything else with flops (and for all three where they are None). `compute_efficiency` scales every rate
    (a sustained fraction, e.g. a power-limited part); `memory_efficiency` scales the memory bandwidth.

    Communication: a collective over a group inside one node runs on the intra-node link, `link_bytes_per_s`
    (NCCL's bus bandwidth per rank on large messages) with `link_latency_s` per ring step. A group spanning
    several nodes also crosses the network (`inter_bytes_per_s` per rank, `inter_latency_s` per step), see
    `collective_seconds`. Without `ranks_per_node` every group is taken to sit inside one node (the flat model).
    """

    name: str
    flops_per_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    link_latency_s: float
    matmul_flops_per_s: float | None = None
    fp32_matmul_flops_per_s: float | None = None
    attention_flops_per_s: float | None = None
    kernel_overhead_s: float = 0.0
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    ranks_per_node: int | None = None
    inter_bytes_per_s: float | None = None
    inter_latency_s: float | None = None
    memory_capacity_bytes: int | None = None  # the device's memory, for `plan()`'s fit check
    calibration: tuple[tuple[str, float], ...] = field(default=(), compare=False)  # fitted fields and values

    def matmul_rate(self, fp32: bool = False) -> float:
        """Flops per second of a matmul in low precision (bf16/fp16), or in fp32."""
        rate = self.fp32_matmul_flops_per_s if fp32 else self.matmul_flops_per_s
        return (rate or self.flops_per_s) * self.compute_efficiency

    def attention_rate(self) -> float:
        return (self.attention_flops_per_s or self.matmul_flops_per_s or self.flops_per_s) * self.compute_efficiency

    def vector_rate(self) -> float:
        return self.flops_per_s * self.compute_efficiency

    def memory_rate(self) -> float:
        return self.memory_bytes_per_s * self.memory_efficiency

    def with_fields(self, **fields) -> Hardware:
        return replace(self, **fields)


def span(ranks: Sequence[int], ranks_per_node: int | None) -> tuple[int, int]:
    """(nodes the ranks sit on, the most ranks of them on one node). Ranks are numbered node by node (torchrun's
    layout: rank // ranks_per_node is the node)."""
    if not ranks_per_node:
        return 1, len(ranks)
    per_node: dict[int, int] = {}
    for rank in ranks:
        per_node[rank // ranks_per_node] = per_node.get(rank // ranks_per_node, 0) + 1
    return len(per_node), max(per_node.values())


def collective_seconds(
    kind: str, payload: float, n: int, hardware: Hardware, nodes: int = 1, per_node: int | None = None
) -> float:
    """Seconds of one collective of `kind` over a group of `n` ranks on `nodes` nodes (`per_node` ranks on each,
    default n / nodes), moving `payload` bytes (the unsharded side: a gather's output, a reduce-scatter's input,
    an all-reduce's tensor, an all-to-all's input).

    Inside one node: a ring over the intra-node link, (n - 1) steps of `link_latency_s` plus the bytes each rank
    sends, (n - 1) / n of the payload, at `link_bytes_per_s`. Across nodes: NCCL's hierarchical schedule, where
    each rank moves (g - 1) / g of the payload over NVLink and (k - 1) / k of its 1 / g share over its own network
    interface (g ranks per node, k nodes), the node's interfaces all busy at once; the two phases pipeline, so the
    slower one sets the time (the model stas00/ml-engineering's network chapter checks against 4-node B200
    all-reduces, "Inter-node speed depends on intra-node speed"). An all-reduce is a reduce-scatter plus an
    all-gather: twice the time. An all-to-all sends (n - 1) / n of its input once, by the same rule.
    """
    if n <= 1:
        return 0.0
    rounds = 2 if kind == "all_reduce" else 1
    g = per_node or max(n // max(nodes, 1), 1)
    if nodes <= 1 or hardware.inter_bytes_per_s is None:
        seconds = (n - 1) * hardware.link_latency_s + (n - 1) / n * payload / hardware.link_bytes_per_s
        return rounds * seconds
    k = nodes
    inter_latency = hardware.inter_latency_s if hardware.inter_latency_s is not None else hardware.link_latency_s
    intra = (g - 1) * hardware.link_latency_s + (g - 1) / g * payload / hardware.link_bytes_per_s
    inter = (k - 1) * inter_latency + (k - 1) / k * (payload / g) / hardware.inter_bytes_per_s
    return rounds * max(intra, inter)


# Network interfaces per GPU, as bytes per second per rank at NCCL's large-message efficiency: a 400 Gb/s NIC is
# 50 GB/s; stas00/ml-engineering network/README.md ("Inter-node speed depends on intra-node speed") measures
# 36.95 GB/s per accelerator (74% of 50 GB/s) for 16 GiB all-reduces over 4 nodes of 8 B200 with 8 x 400 Gb/s EFA.
NIC_EFFICIENCY = 36.95 / 50.0


def nic_bytes_per_s(gigabits: float) -> float:
    """Achieved bytes per second of one rank's `gigabits` Gb/s network interface (`NIC_EFFICIENCY` of its spec)."""
    return gigabits / 8 * 1e9 * NIC_EFFICIENCY


def _gpu(
    name: str,
    *,
    peak: float,
    mamf: float,
    attention: float,
    hbm: float,
    nvlink: float,
    nic_gbps: float,
    memory_gib: float,
    fp32_matmul: float,
    fitted_efficiency: float | None = None,
) -> Hardware:
    """A GPU preset. `flops_per_s` is the dense bf16 peak (kernels with flops that are not matmuls or attention
    run far below it and are charged by their bytes anyway); ring steps cost 10 us inside a node (NCCL's ring
    latency on NVLink is single-digit microseconds per step) and 20 us across nodes. `fitted_efficiency`: the
    `compute_efficiency` benchmarks/calibration.py fitted on published step times (None: not calibrated, 1.0)."""
    fitted = () if fitted_efficiency is None else (("compute_efficiency", fitted_efficiency),)
    return Hardware(
        name,
        flops_per_s=peak,
        memory_bytes_per_s=hbm,
        link_bytes_per_s=nvlink,
        link_latency_s=10e-6,
        matmul_flops_per_s=mamf,
        fp32_matmul_flops_per_s=fp32_matmul,
        attention_flops_per_s=attention,
        kernel_overhead_s=KERNEL_OVERHEAD_S,
        ranks_per_node=8,
        inter_bytes_per_s=nic_bytes_per_s(nic_gbps),
        inter_latency_s=20e-6,
        memory_capacity_bytes=int(memory_gib * GIB),
        compute_efficiency=1.0 if fitted_efficiency is None else fitted_efficiency,
        calibration=fitted,
    )


# Fixed time per kernel: fitted to XLA's published H100 matmul table (tensorflow/tensorflow,
# third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h, key "sm_90"): time = flops / 783 TFLOP/s + t0
# fits its bf16 entries from 256^3 to 4096^3 (26 shapes, benchmarks/data/xla_sm90_matmul.csv) best at 775 TFLOP/s
# and t0 = 6.25 us, 11% RMS error (`python benchmarks/calibration.py kernels`).
KERNEL_OVERHEAD_S = 6.25e-6

# Rough, order-of-magnitude presets kept from the first cost model, flat (one rate, one link for every group);
# every field is settable (dataclasses.replace, `Hardware.with_fields`, or a Hardware of your own).
HARDWARE: dict[str, Hardware] = {
    # This repository's test machine: 2 cores measured ~35 GFLOP/s fp32 matmul and a few GB/s for elementwise
    # kernels; gloo over loopback TCP moves ~1 GB/s with ~100 us per message.
    "cpu-gloo": Hardware("cpu-gloo", 30e9, 5e9, 1e9, 100e-6),
    # H100 SXM, flat: ~400 TFLOP/s effective, ~3 TB/s of HBM3, 200 GB/s bus bandwidth, ~10 us per ring step.
    "nvlink": Hardware("nvlink", 400e12, 3e12, 200e9, 10e-6),
    # The same GPU with every group on the network: one 200 Gb/s HDR InfiniBand link per GPU, ~20 us per step.
    "infiniband": Hardware("infiniband", 400e12, 3e12, 25e9, 20e-6),
}

# GPU presets, 8 GPUs per node. Sources:
# - peak: NVIDIA's dense (no sparsity) bf16 tensor-core figures, as tabulated in stas00/ml-engineering
#   compute/accelerator/README.md ("Theory" column); HBM bandwidth and capacity: NVIDIA's datasheets.
# - mamf: the same file's "Maximum Achievable Matmul FLOPS comparison table" (BF16): A100 SXM 271.2, H100 SXM
#   794.5 ("H200 is the same"), B200 SXM 1745.0 TFLOP/s.
# - attention: FlashAttention-2's forward + backward rate (arXiv 2307.08691: 50-73% of A100's peak; the
#   FlashAttention-3 paper, arXiv 2407.08608, measures FlashAttention-2 at about 35% of H100's peak, ~350
#   TFLOP/s): PyTorch's SDPA runs FlashAttention-2 kernels. B200 is taken at H100's fraction of its peak.
# - nvlink: NCCL ring all-gather bus bandwidth measured on 8 GPUs, stas00/ml-engineering network/README.md:
#   361.4 GB/s on 8 x H200 (NVLink 4, 80% of 450 GB/s); A100 235 GB/s (the same file's all-reduce case study,
#   80% of NVLink 3's 300 GB/s); B200 at the same 82% of NVLink 5's 900 GB/s.
# - nic_gbps: the network interface per GPU of each platform's reference node (DGX A100: 200 Gb/s HDR; DGX
#   H100/H200: 400 Gb/s NDR; B200: 400 Gb/s), at NIC_EFFICIENCY. A calibration row whose cluster differs
#   overrides it (benchmarks/calibration.py).
# - fp32_matmul: the fp32 (non-tensor-core) peak, 19.5 / 67 / 67 / 80 TFLOP/s.
# - fitted_efficiency: the sustained fraction of those rates in a training step, fitted on published step times
#   (benchmarks/calibration.py's "fit" rows, docs/planning.md); the HBM2e H100 carries the H100's. The B200 has no
#   published row here: not calibrated.
GPUS: dict[str, Hardware] = {
    "a100": _gpu(
        "a100",
        peak=312e12,
        mamf=271.2e12,
        attention=0.6 * 312e12,
        hbm=2.039e12,
        nvlink=235e9,
        nic_gbps=200,
        memory_gib=80,
        fp32_matmul=19.5e12,
        fitted_efficiency=0.86,
    ),
    "h100": _gpu(
        "h100",
        peak=989e12,
        mamf=794.5e12,
        attention=350e12,
        hbm=3.35e12,
        nvlink=361.4e9,
        nic_gbps=400,
        memory_gib=80,
        fp32_matmul=67e12,
        fitted_efficiency=0.72,
    ),
    # Meta's Grand Teton H100s (torchtitan's tables): 96 GB of HBM2e at 2.4 TB/s (95 GiB visible), 500 W.
    "h100-hbm2e": _gpu(
        "h100-hbm2e",
        peak=989e12,
        mamf=794.5e12,
        attention=350e12,
        hbm=2.4e12,
        nvlink=361.4e9,
        nic_gbps=400,
        memory_gib=95,
        fp32_matmul=67e12,
        fitted_efficiency=0.72,
    ),
    "h200": _gpu(
        "h200",
        peak=989e12,
        mamf=794.5e12,
        attention=350e12,
        hbm=4.8e12,
        nvlink=361.4e9,
        nic_gbps=400,
        memory_gib=141,
        fp32_matmul=67e12,
        fitted_efficiency=0.92,
    ),
    "b200": _gpu(
        "b200",
        peak=2250e12,
        mamf=1745e12,
        attention=0.35 * 2250e12,
        hbm=8e12,
        nvlink=0.82 * 900e9,
        nic_gbps=400,
        memory_gib=180,
        fp32_matmul=80e12,
    ),
}
HARDWARE.update(GPUS)
