"""Traced figures of one sharding of a Llama-style model at a few depths, their line in depth, cached.

`plan()` compares many layouts of one model. What a layout's step costs depends on the shapes each rank traces
(the tensor-parallel degree, activation checkpointing, the micro-batch, the data-parallel sharding), so each
distinct set of those is planned once here, on the meta device with a fake process group of the layout's size,
and reused by every layout that shares it (pipeline stages of another depth, a second call): `Profiles` keeps them
by `ProfileKey`, in memory and, with a cache directory, on disk as JSON. Tracing costs about 10 s of CPU whatever
the depth (Dynamo's and AOT autograd's fixed work), so a profile is one plan, at 4 blocks, plus what its middle
block adds (`block_figures`); `Profiles.extend` plans two more depths for the profiles that matter and checks the
three are on one line, as `explain_by_depth` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fsdp_graph.planning.depth import FIGURES, _check_linear
from fsdp_graph.train.llama import LlamaConfig
from passes.hardware import Hardware

CACHE_VERSION = 2  # bump when what a profile holds changes


@dataclass(frozen=True)
class ProfileKey:
    """One traced sharding: the model (its `layers` ignored: the depths are sampled), `tp` x `dp_replicate` x
    `dp_shard` ranks, `micro_batch` sequences of `seq` tokens per rank, and the options that change the graphs."""

    config: LlamaConfig
    tp: int
    dp_shard: int
    dp_replicate: int
    checkpoint: str
    micro_batch: int
    seq: int
    bf16: bool = True
    reshard_after_forward: bool = True
    compression: str | None = None
    compiled: bool = True  # Inductor (fused kernels); False: eager kernels, one per op
    bf16_reduce: bool = False  # with bf16: gradients reduced in bf16 too (FSDP1's bfSixteen), not fp32

    @property
    def world(self) -> int:
        return self.tp * self.dp_shard * self.dp_replicate

    def digest(self, hardware: Hardware, extras: tuple) -> str:
        """A cache key: what the traced figures depend on (the device's capacity and name do not)."""
        rates = dataclasses.replace(hardware, name="", memory_capacity_bytes=None, calibration=())
        text = repr((CACHE_VERSION, dataclasses.astuple(self), rates, extras, torch.__version__))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class Profile:
    """The figures of `key` at the sampled depths (`depth.figures_of`, plus reserved memory, the optimizer's time
    and the compute time), their line in depth, and how long tracing took (0 when it came from the cache)."""

    key: ProfileKey
    samples: tuple[int, ...]
    sampled: dict[int, dict[str, float]]
    trace_seconds: float
    cached: bool = False
    synthetic: bool = False  # the deeper sample is the first plus its middle blocks' share (one plan)
    linear: bool | None = None  # checked by `Profiles.extend` over three planned depths

    def at(self, layers: int) -> dict[str, float]:
        """Every figure at `layers` blocks, on the line through the two deepest samples."""
        a, b = self.samples[-2], self.samples[-1]
        return {
            name: self.sampled[b][name] + (self.sampled[b][name] - self.sampled[a][name]) / (b - a) * (layers - b)
            for name in self.sampled[b]
        }


class Profiles:
    """Traces and caches profiles for one hardware and optimizer setting. `cache_dir`: keep them on disk too."""

    def __init__(
        self,
        hardware: Hardware,
        optimizer: str | None = "adamw",
        clip_grad: bool = True,
        expandable_segments: bool = False,
        samples: tuple[int, ...] = (4,),
        cache_dir: str | Path | None = None,
        log=None,
    ):
        self.hardware, self.optimizer, self.clip_grad = hardware, optimizer, clip_grad
        self.expandable_segments, self.samples = expandable_segments, tuple(samples)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.profiles: dict[ProfileKey, Profile] = {}
        self.traced = 0  # profiles traced by this instance (not from a cache)
        self.log = log  # called with a line per traced profile

    def get(self, key: ProfileKey) -> Profile:
        if key in self.profiles:
            return self.profiles[key]
        profile = self._load(key) or self._trace(key)
        self.profiles[key] = profile
        return profile

    def _path(self, key: ProfileKey) -> Path | None:
        if self.cache_dir is None:
            return None
        extras = (self.optimizer, self.clip_grad, self.expandable_segments, self.samples)
        return self.cache_dir / f"{key.digest(self.hardware, extras)}.json"

    def _load(self, key: ProfileKey) -> Profile | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        data = json.loads(path.read_text())
        sampled = {int(depth): figures for depth, figures in data["sampled"].items()}
        return Profile(key, tuple(data["samples"]), sampled, 0.0, True, data["synthetic"], data["linear"])

    def _trace(self, key: ProfileKey) -> Profile:
        start = time.perf_counter()
        period = 2 if key.checkpoint == "layer" else 1  # blocks alternate: step by whole periods of two
        depth = self.samples[0] * period
        synthetic = key.config.layers > depth + period
        if not synthetic:  # no deeper than the samples: planned whole, a constant "line"
            whole = figures(trace(key, key.config.layers, self))
            samples = (key.config.layers, key.config.layers + 1)
            sampled = {samples[0]: whole, samples[1]: whole}
        else:  # one plan; the next depth is it plus its middle blocks' share (`block_figures`), checked by `extend`
            report = trace(key, depth, self)
            base = figures(report)
            block = block_figures(report, depth, period)
            samples = (depth, depth + period)
            sampled = {depth: base, depth + period: {name: base[name] + period * block[name] for name in base}}
        profile = Profile(key, samples, sampled, time.perf_counter() - start, synthetic=synthetic)
        self.traced += 1
        if self.log is not None:
            self.log(
                f"traced TP {key.tp} x DP {key.dp_replicate}x{key.dp_shard}, AC {key.checkpoint}, micro-batch "
                f"{key.micro_batch}, reshard {key.reshard_after_forward}, compression {key.compression} at depth "
                f"{samples[0]}: {profile.trace_seconds:.0f} s"
            )
        self._store(profile)
        return profile

    def extend(self, profile: Profile) -> bool:
        """Check a one-plan profile the way `explain_by_depth` checks: plan the two next depths too, require every
        figure of `FIGURES` on one line through the three (1e-3), and keep the line through the two deepest. When a
        figure bends, plan twice as deep (the line through those two, unchecked). True when the profile changed."""
        if not profile.synthetic:
            return False
        period = profile.samples[1] - profile.samples[0]
        depths = (profile.samples[0], profile.samples[0] + period, profile.samples[0] + 2 * period)
        if depths[-1] >= profile.key.config.layers:
            return False
        sampled = {depths[0]: profile.sampled[depths[0]]}
        for depth in depths[1:]:
            sampled[depth] = figures(trace(profile.key, depth, self))
        try:
            for name in FIGURES:
                _check_linear(name, depths, [sampled[n][name] for n in depths], 1e-3)
            profile.linear = True
        except ValueError:
            deeper = tuple(2 * n for n in depths[1:])
            sampled = {n: figures(trace(profile.key, n, self)) for n in deeper if n < profile.key.config.layers}
            depths = tuple(sampled) if len(sampled) == 2 else depths
            profile.linear = False
        profile.sampled, profile.samples, profile.synthetic = sampled, depths, False
        self._store(profile)
        return True

    def _plan(self, key: ProfileKey):
        return lambda layers: trace(key, layers, self)

    def _store(self, profile: Profile) -> None:
        path = self._path(profile.key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = {"samples": list(profile.samples), "sampled": profile.sampled, "synthetic": profile.synthetic}
            path.write_text(json.dumps(data | {"linear": profile.linear}))


def figures(report) -> dict[str, float]:
    """`depth.figures_of` plus what plan() reads: reserved memory, optimizer time and state, the step's compute
    (forward and backward kernels), the gradient shards and the transient peak above the persistent tensors."""
    from fsdp_graph.planning.depth import figures_of

    out = dict(figures_of(report))
    out.update(
        reserved_bytes=report.reserved_bytes,
        optimizer_time=report.optimizer_time,
        optimizer_state_bytes=report.optimizer_state_bytes,
        compute_time=report.forward.compute_time + (report.backward.compute_time if report.backward else 0.0),
        gradient_bytes=report.memory.outputs_bytes,
        transient_bytes=report.memory.peak_bytes,
        flops=report.forward.flops + (report.backward.flops if report.backward else 0.0),
    )
    return out


def block_figures(report, depth: int, period: int = 1) -> dict[str, float]:
    """What one more block adds to each of `figures`, read off the plan's middle `period` blocks (units
    "blocks.k"): their compute and exposed waits on the timeline, their collectives, their shards, gradients and
    share of the optimizer's state and time; and for memory, what a deep model's peak (at the backward's start)
    gains per block: the activations a block saves for the backward (every block's mean), its persistent shard and
    its optimizer state. A block whose own kernels run at the peak is passed over for its neighbour. Measured on
    Llama 3 8B at 64 ranks (2048 tokens), against a plan one block deeper: step time within 1%, communication
    exact."""
    from passes.cost import collective_cost, iter_collectives

    first = depth // 2 - period // 2
    if report.memory.peak.unit in {f"blocks.{k}" for k in range(first, first + period)}:
        first = first - period if first >= period else first + period
    middle = [f"blocks.{k}" for k in range(first, first + period)]
    rows = {row.unit: row for row in report.units}
    if any(unit not in rows for unit in middle):
        raise ValueError(f"plan(): the model's blocks are not units named {middle}; profiles need blocks.<k> units")
    events = [e for sim in (report.forward, report.backward) if sim is not None for e in sim.events]

    def owned(unit: str | None) -> float:  # a bucketed collective's label names every unit in it
        parts = (unit or "").split("+")
        return sum(1 / len(parts) for part in parts if part in middle)

    compute = sum((e.end - e.start) for e in events if e.kind == "compute" and e.unit in middle)
    exposed = sum((e.end - e.start) * owned(e.unit) for e in events if e.kind == "wait")
    comm = sum((e.end - e.start) * owned(e.unit) for e in events if e.lane == "comm")
    sent = 0.0
    for graph in report.graphs:
        for node, kind, unit in iter_collectives(graph.graph):
            if owned(unit):
                n, payload, _ = collective_cost(node, report.hardware, report.world, report.group_sizes)
                sent += owned(unit) * (payload * (n - 1) / n * (2 if kind == "all_reduce" else 1) if n > 1 else 0.0)
    # The partitioner does not save the same in every block (Llama 3 8B: 235 and 311 MB in turn), so the share of
    # activations is every block's mean; the persistent shard and optimizer state come with each block too.
    blocks = [unit for unit in rows if unit.startswith("blocks.")]
    saved = period * sum(report.memory.saved_by_unit.get(unit, 0) for unit in blocks) / max(len(blocks), 1)
    shard = sum(rows[unit].shard_bytes for unit in middle)
    total_shard = sum(row.shard_bytes for row in report.units) or 1
    state = report.optimizer_state_bytes * shard / total_shard
    total_compute = sum(s.compute_time for s in (report.forward, report.backward) if s is not None) or 1.0
    flops = sum(s.flops for s in (report.forward, report.backward) if s is not None)
    per_block = {
        "params": sum(rows[unit].params for unit in middle),
        "shard_bytes": shard,
        "largest_unit_bytes": 0.0,
        "gathers": sum(rows[unit].gathers for unit in middle),
        "reduce_scatters": sum(rows[unit].reduce_scatters for unit in middle),
        "peak_memory_bytes": saved + shard + state,
        "sent_bytes": sent,
        "step_time": compute + exposed + report.optimizer_time * shard / total_shard,
        "comm_time": comm,
        "exposed_comm": exposed,
        "reserved_bytes": saved + shard + state,
        "optimizer_time": report.optimizer_time * shard / total_shard,
        "optimizer_state_bytes": state,
        "compute_time": compute,
        "gradient_bytes": shard,
        "transient_bytes": saved,
        "flops": flops * compute / total_compute,
    }
    return {name: value / period for name, value in per_block.items()}


def trace(key: ProfileKey, layers: int, profiles: Profiles):
    """`explain()` of `key`'s model at `layers` blocks on a fake process group of `key.world` ranks (this process
    rank 0; any process group already initialised is an error)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plan(): a process group is already initialised; plan in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=key.world)
    try:
        return _explain(key, layers, profiles)
    finally:
        dist.destroy_process_group()


def _explain(key: ProfileKey, layers: int, profiles: Profiles):
    import fsdp_graph
    from fsdp_graph.train.llama import Llama, tp_plan

    cfg = replace(key.config, layers=layers, checkpoint=key.checkpoint, seq=max(key.seq, key.config.seq))
    with torch.device("meta"):
        model = Llama(cfg)
    reduce = torch.bfloat16 if key.bf16_reduce else torch.float32
    mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce) if key.bf16 else None
    strategy = fsdp_graph.ShardingStrategy.FULL_SHARD
    if not key.reshard_after_forward:
        strategy = fsdp_graph.ShardingStrategy.SHARD_GRAD_OP
    mesh = None
    if key.tp > 1 or key.dp_replicate > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = (key.dp_replicate, key.dp_shard, key.tp), ("replicate", "dp", "tp")
        world_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if key.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, world_mesh["tp"], tp_plan(cfg))
        if key.dp_replicate > 1:
            mesh = world_mesh["replicate", "dp"]
            strategy = fsdp_graph.ShardingStrategy.HYBRID_SHARD
        else:
            mesh = world_mesh["dp"]
    fsdp_graph.fully_shard(
        model,
        mesh,
        device="meta",
        param_init_fn=model.init_module,
        mixed_precision=mp,
        strategy=strategy,
        reuse_blocks=False,  # a shared block body saves everything under activation checkpointing (issue 37)
    )
    idx = torch.zeros(key.micro_batch, key.seq, dtype=torch.long, device="meta")

    def lm_loss(logits: torch.Tensor) -> torch.Tensor:
        return -logits.float().log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

    options = {"fusion": key.compiled}  # not compiled: PyTorch's eager kernels, one per op
    if key.compression is not None:
        options["compress"] = fsdp_graph.Compression.parse(key.compression)
    return fsdp_graph.explain(
        model,
        idx,
        loss_fn=lm_loss,
        hardware=profiles.hardware,
        optimizer=profiles.optimizer,
        clip_grad=profiles.clip_grad,
        expandable_segments=profiles.expandable_segments,
        **options,
    )
