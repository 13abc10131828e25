"""Layouts `plan()` compares, what each costs, and the cheap bounds that decide which are worth tracing.

A `Layout` places `world` ranks as `pp` pipeline stages x `dp_replicate` x `dp_shard` data-parallel ranks x `tp`
tensor-parallel ranks (tp innermost, so a tensor-parallel group sits inside one node), and runs each step as
`microbatches` micro-batches of `micro_batch` sequences per data-parallel rank (gradient accumulation without
pipelining; the pipeline's micro-batches with it, 1F1B).

`evaluate` turns a traced `Profile` (the stage's blocks at the layout's shapes, `fsdp_graph.planning.profiles`)
into the layout's figures:
- one micro-batch's forward and backward, communication included, is the profile's step at the stage's depth
  (blocks / pp) without its optimizer step; a step runs `microbatches` of them, plus the pipeline's fill and drain
  (pp - 1 more micro-batch times, 1F1B) and the activations and gradients sent between stages, then one optimizer
  step;
- memory is the profile's peak (allocated), plus, under gradient accumulation, the gradients kept from the previous
  micro-batch, and under 1F1B the activations of the first stage's min(pp, microbatches) - 1 further micro-batches in
  flight; reserved memory adds the allocator's overhead over allocated the profile measured (`allocator_slack`:
  the largest at any sampled depth, not a line in depth);
- a `TrainingLoop` says what the loop around the model does that the traced step (fully_shard's defaults, the loss
  computed and dropped inside it) does not show: a model cast to bf16 before sharding halves every persistent
  byte the profile traced for fp32 (shards, gradients, optimizer state); accumulation with gradient sync off keeps
  every gradient unsharded in fp32 between micro-batches instead of its shard; a loop that holds the model's fp32
  logits (a local `pred`) keeps them through the backward, where a deep model's peak is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp_graph.planning.profiles import Profile, ProfileKey
from fsdp_graph.train.llama import LlamaConfig
from passes.hardware import GIB, Hardware, collective_seconds, span

AC_MODES = ("none", "selective", "full")  # what plan() searches; LlamaConfig also takes "layer"


@dataclass(frozen=True)
class Layout:
    """How `world = pp * dp_replicate * dp_shard * tp` ranks train one step of `global batch = dp_replicate *
    dp_shard * micro_batch * microbatches` sequences."""

    tp: int
    pp: int
    dp_shard: int
    dp_replicate: int
    checkpoint: str  # activation checkpointing: "none", "selective" or "full"
    micro_batch: int
    microbatches: int
    reshard_after_forward: bool = True
    compression: str | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp_shard * self.dp_replicate

    def describe(self) -> str:
        parts = [f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"FSDP {self.dp_shard}"]
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        text = " x ".join(parts) + f", AC {self.checkpoint}, micro-batch {self.micro_batch}"
        if self.microbatches > 1:
            text += f" x {self.microbatches}" + (" (1F1B)" if self.pp > 1 else " (accumulated)")
        if not self.reshard_after_forward:
            text += ", no reshard after forward"
        if self.compression:
            text += f", compressed {self.compression}"
        return text

    def profile_key(self, config: LlamaConfig, seq: int, bf16: bool) -> ProfileKey:
        return ProfileKey(
            config,
            self.tp,
            self.dp_shard,
            self.dp_replicate,
            self.checkpoint,
            self.micro_batch,
            seq,
            bf16,
            self.reshard_after_forward,
            self.compression,
        )


@dataclass(frozen=True)
class TrainingLoop:
    """What a training loop does around the model that changes its memory (see the module docstring). The default
    is plan()'s own loop, and the main job's: none of it. Each field is a habit of a published trainer
    (benchmarks/calibration.py names them)."""

    bf16_model: bool = False  # `model.to(torch.bfloat16)` before sharding: bf16 shards, gradients, optimizer state
    sync_each_microbatch: bool = True  # False: FSDP2's set_requires_gradient_sync(False) but on the last micro-batch
    holds_fp32_logits: bool = False  # the fp32 logits stay referenced through the backward (`pred = model(x)`)

    def describe(self) -> str:
        parts = ["bf16 model" if self.bf16_model else "", "" if self.sync_each_microbatch else "no gradient sync"]
        parts.append("fp32 logits held" if self.holds_fp32_logits else "")
        return ", ".join(p for p in parts if p)


PLAIN_LOOP = TrainingLoop()  # plan()'s own loop and the main job's


@dataclass
class Evaluation:
    """A layout's predicted step (seconds), its parts, and its memory per rank (bytes)."""

    layout: Layout
    step_time: float
    tokens_per_s_per_gpu: float
    allocated_bytes: float
    reserved_bytes: float
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds: compute, exposed, optimizer, pipeline
    memory_breakdown: dict[str, float] = field(default_factory=dict)  # bytes: states, activations and buffers
    fits: bool = True
    reason: str = ""


def model_flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """Training flops per token (forward and backward, 3x the forward's): 6 per matmul parameter (the embedding is
    a lookup, no matmul) plus causal attention's scores and values, 6 * 2 * layers * dim * seq / 2."""
    embedding = 0 if cfg.tied else cfg.vocab * cfg.dim  # tied: the one matrix is the head's matmul too
    matmul_params = cfg.num_params() - embedding - (2 * cfg.layers + 1) * cfg.dim
    return 6 * matmul_params + 6 * cfg.layers * cfg.dim * seq


def throughput_bound(cfg: LlamaConfig, seq: int, layout: Layout, hardware: Hardware, bf16: bool = True) -> float:
    """Tokens per second per GPU no plan of this layout beats: the step is at least its matmul flops at the matmul
    rate (full checkpointing runs the forward twice, 8/6 of the flops; a pipeline adds its fill and drain), and at
    least the time of the collectives on its busiest link, whose lane the cost model runs one after another
    (`comm_lower_bound`)."""
    flops = model_flops_per_token(cfg, seq) * (8 / 6 if layout.checkpoint == "full" else 1.0)
    tokens = layout.dp_shard * layout.dp_replicate * layout.micro_batch * layout.microbatches * seq
    compute = flops * tokens / layout.world / hardware.matmul_rate()
    compute *= (layout.microbatches + layout.pp - 1) / layout.microbatches
    return tokens / max(compute, comm_lower_bound(cfg, seq, layout, hardware, bf16)) / layout.world


def comm_lower_bound(cfg: LlamaConfig, seq: int, layout: Layout, hardware: Hardware, bf16: bool = True) -> float:
    """Seconds of the collectives one rank runs per step on its busiest link (`passes.hardware.collective_seconds`
    on the layout's groups: tp innermost, the FSDP group every tp-th rank; `passes.cost.simulate` runs each link's
    collectives one after another, the links beside each other): per block and micro-batch, FSDP's gathers (two,
    one without resharding after forward) in the compute dtype and its fp32 reduce-scatter, HSDP's replica
    all-reduce of the shard, and tensor parallelism's four activation all-reduces (six under full checkpointing,
    whose recomputed forward runs them again). The embedding and head are left out, so it is a lower bound."""
    elem = 2 if bf16 else 4
    block = (cfg.num_params() - cfg.vocab * cfg.dim * (1 if cfg.tied else 2)) / cfg.layers / layout.tp
    links: dict[str, float] = {}

    def add(ranks: tuple[int, ...], seconds_on: Callable[[int, int], float]) -> None:
        nodes, per_node = span(ranks, hardware.ranks_per_node)
        link = "network" if nodes > 1 else "node"
        links[link] = links.get(link, 0.0) + seconds_on(nodes, per_node)

    dp_ranks = tuple(i * layout.tp for i in range(layout.dp_shard))
    gathers = 2 if layout.reshard_after_forward else 1
    shard = layout.dp_shard

    add(
        dp_ranks,
        lambda nodes, per: gathers * collective_seconds("all_gather", block * elem, shard, hardware, nodes, per),
    )
    add(dp_ranks, lambda nodes, per: collective_seconds("reduce_scatter", block * 4, shard, hardware, nodes, per))
    if layout.dp_replicate > 1:
        replicas = layout.dp_replicate
        replica_ranks = tuple(i * layout.tp * layout.dp_shard for i in range(replicas))
        add(
            replica_ranks,
            lambda nodes, per: collective_seconds("all_reduce", block * 4 / shard, replicas, hardware, nodes, per),
        )
    if layout.tp > 1:
        activation = layout.micro_batch * seq * cfg.dim * 2
        count = 6 if layout.checkpoint == "full" else 4
        add(
            tuple(range(layout.tp)),
            lambda nodes, per: count * collective_seconds("all_reduce", activation, layout.tp, hardware, nodes, per),
        )
    return cfg.layers / layout.pp * layout.microbatches * max(links.values(), default=0.0)


def memory_lower_bound(
    cfg: LlamaConfig, seq: int, layout: Layout, bf16: bool = True, loop: TrainingLoop = PLAIN_LOOP
) -> float:
    """Bytes per rank no layout of these degrees can go below: the model state (fp32 master, gradient and AdamW's
    two moments, 16 bytes a parameter; 8 for a bf16 model) over the ranks holding it, one gathered block (every
    block of the stage without resharding after forward: they stay gathered for the backward), and per block and
    sequence the activations checkpointing keeps at least (the block's input; without checkpointing also the
    feed-forward's input and its three hidden-width values, split over tp)."""
    elem = 2 if bf16 else 4
    state = (8 if loop.bf16_model else 16) * cfg.num_params() / (layout.tp * layout.pp * layout.dp_shard)
    block = (cfg.num_params() - cfg.vocab * cfg.dim * (1 if cfg.tied else 2)) / cfg.layers
    gathered = block / layout.tp * elem * (1 if layout.reshard_after_forward else cfg.layers / layout.pp)
    per_token = cfg.dim if layout.checkpoint != "none" else cfg.dim * 2 + 3 * cfg.hidden / layout.tp
    in_flight = min(layout.pp, layout.microbatches) if layout.pp > 1 else 1
    activations = cfg.layers / layout.pp * layout.micro_batch * in_flight * seq * per_token * elem
    return state + gathered + activations


def _send_seconds(nbytes: float, hardware: Hardware) -> float:
    """One point-to-point send between nodes: a network step's latency plus the bytes at a rank's NIC rate."""
    latency = hardware.inter_latency_s if hardware.inter_latency_s is not None else hardware.link_latency_s
    return latency + nbytes / (hardware.inter_bytes_per_s or hardware.link_bytes_per_s)


def allocator_slack(profile: Profile) -> float:
    """The caching allocator's reserved bytes over its allocated peak, the largest at the profile's sampled depths,
    at any depth: the slack comes from the sizes of the blocks the allocator rounds, splits and keeps cached, which
    repeat block after block, and traced depths move it either way, so a line through them extrapolates noise
    (design notes, "`plan()`"). A synthetic profile's samples have the same slack by construction."""
    return max(max(s["reserved_bytes"] - s["peak_memory_bytes"], 0.0) for s in profile.sampled.values())


def evaluate(
    layout: Layout,
    profile: Profile,
    cfg: LlamaConfig,
    seq: int,
    hardware: Hardware,
    usable_bytes: float,
    loop: TrainingLoop = PLAIN_LOOP,
) -> Evaluation:
    """The layout's figures from its stage's profile (see the module docstring), under `loop`."""
    stage_layers = max(cfg.layers // layout.pp, 1)
    f = profile.at(stage_layers)
    optimizer = f["optimizer_time"]
    per_micro = f["step_time"] - optimizer
    exposed = f["exposed_comm"]
    compute = per_micro - exposed
    m, p = layout.microbatches, layout.pp
    pipeline = 0.0
    if p > 1:
        activation = layout.micro_batch * seq * cfg.dim * 2  # bf16 hidden states between stages
        send = _send_seconds(activation, hardware)  # stages sit on different nodes
        pipeline = (p - 1) * per_micro + (m + p - 1) * 2 * send  # activations forward, their gradients back
    step = m * per_micro + pipeline + optimizer
    allocated = f["peak_memory_bytes"]
    states = f["shard_bytes"] * 2 + f["optimizer_state_bytes"]  # fp32 master shards, their gradients, the state
    gradients = f["gradient_bytes"]
    if loop.bf16_model:  # the traced peak holds the fp32 shards and optimizer state: half of them stays
        allocated -= (f["shard_bytes"] + f["optimizer_state_bytes"]) / 2
        states, gradients = states / 2, gradients / 2
    extra = 0.0
    if p == 1 and m > 1:
        # the previous micro-batches' gradients, kept for the next backward: their shards, or without gradient
        # sync every gradient unsharded in fp32 (FSDP2 accumulates in the reduce dtype): the shards' fp32 bytes
        # times the shard group
        extra = gradients if loop.sync_each_microbatch else f["shard_bytes"] * layout.dp_shard
    if p > 1:
        extra = (min(p, m) - 1) * f["transient_bytes"]
    if loop.holds_fp32_logits and p == 1:  # one micro-batch's whole logits (a pipeline's last stage: not modelled)
        extra += layout.micro_batch * seq * cfg.vocab * 4
    allocated += extra
    reserved = allocated + allocator_slack(profile)
    tokens = layout.dp_shard * layout.dp_replicate * layout.micro_batch * m * seq
    evaluation = Evaluation(
        layout,
        step,
        tokens / step / layout.world,
        allocated,
        reserved,
        {
            "compute": m * compute,
            "exposed communication": m * exposed,
            "optimizer": optimizer,
            "pipeline": pipeline,
        },
        {"model state": states, "activations and buffers": allocated - states},
    )
    if reserved > usable_bytes:
        evaluation.fits = False
        evaluation.reason = (
            f"needs {reserved / GIB:.1f} GiB reserved ({allocated / GIB:.1f} GiB allocated) > "
            f"{usable_bytes / GIB:.1f} GiB usable"
        )
    return evaluation
