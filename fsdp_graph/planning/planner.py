"""`plan()`: search the ways to lay a Llama-style model out on `world` GPUs, keep those that fit, rank by tokens/s.

Candidates (`fsdp_graph.planning.layouts.Layout`): tensor parallelism over 1, 2, 4, ... ranks of a node, pipeline
stages, FSDP over the remaining ranks or HSDP (sharded inside a node, replicated across nodes), activation
checkpointing none / selective / full, the micro-batch (its gradient accumulation or pipeline micro-batches),
resharding after forward, and compression. Each is costed from a traced profile of its shapes (`profiles`), so
the search traces only what it must:
- a layout whose memory lower bound (model state, a gathered block, the activations checkpointing keeps at least)
  exceeds the device is rejected without tracing;
- layouts are tried best throughput bound first (the step is at least its matmul flops at the matmul rate, and at
  least its busiest link's collectives one after another: `layouts.throughput_bound`); once one fits, a layout whose bound is
  below its throughput cannot beat it and is skipped (so fewer than `top` may be shown);
- for each setting the largest micro-batch is tried first and smaller ones only when it does not fit;
- a larger tensor-parallel degree is tried only where every smaller one did not fit at the same setting (more
  tensor parallelism costs activations' all-reduces and saves only memory);
- a profile is one plan at 4 blocks, and what one more block adds is read off its middle block (its compute,
  exposed waits, collectives and saved activations: `profiles.block_figures`); the best layout's profile is then
  planned at two more depths and checked to be linear (`explain_by_depth`'s check), and costed from that.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from fsdp_graph.planning.layouts import (
    AC_MODES,
    PLAIN_LOOP,
    Evaluation,
    Layout,
    TrainingLoop,
    evaluate,
    memory_lower_bound,
    throughput_bound,
)
from fsdp_graph.planning.profiles import Profiles
from fsdp_graph.train.llama import LLAMA3_VOCAB, PRESETS, Llama, LlamaConfig, preset
from passes.hardware import GIB, HARDWARE, Hardware

# Device memory the caching allocator cannot have: the CUDA context (~0.5 GiB) and NCCL's communicator buffers
# (channels x buffer size per peer; a few hundred MiB to over a GiB at scale).
MEMORY_HEADROOM_BYTES = 3 * GIB


@dataclass
class PlanResult:
    """What `plan()` found: the fitting layouts best first (`ranked`), those it rejected and why (`rejected`,
    traced or by bound), the plain-FSDP layout for comparison (`baseline`), and what the search cost."""

    config: LlamaConfig
    world: int
    hardware: Hardware
    global_batch: int
    seq: int
    usable_bytes: float
    ranked: list[Evaluation] = field(default_factory=list)
    rejected: list[Evaluation] = field(default_factory=list)
    baseline: Evaluation | None = None
    profiles_traced: int = 0
    profiles_cached: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    @property
    def best(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None

    def to_text(self, top: int = 5) -> str:
        cfg, hw = self.config, self.hardware
        lines = [
            f"fsdp_graph.plan: Llama dim {cfg.dim} x {cfg.layers} layers ({cfg.num_params() / 1e9:.1f} B parameters) "
            f"on {self.world} x {hw.name} ({hw.ranks_per_node or self.world} per node, "
            f"{(hw.memory_capacity_bytes or 0) / GIB:.0f} GiB, {self.usable_bytes / GIB:.1f} GiB usable), global batch "
            f"{self.global_batch} x {self.seq} tokens",
        ]
        if self.baseline is not None:
            b = self.baseline
            verdict = "fits" if b.fits else "does not fit"
            lines.append(
                f"FSDP alone ({b.layout.describe()}): {b.allocated_bytes / GIB:.1f} GiB allocated, "
                f"{b.reserved_bytes / GIB:.1f} GiB reserved per rank: {verdict}"
                + (f", {b.tokens_per_s_per_gpu:,.0f} tokens/s per GPU" if b.fits else "")
            )
        lines.append("")
        if not self.ranked:
            lines.append("no layout fits; closest:")
            shown = sorted((e for e in self.rejected if e.allocated_bytes), key=lambda e: e.reserved_bytes)[:top]
        else:
            shown = self.ranked[:top]
        header = (
            "#",
            "layout",
            "tokens/s/GPU",
            "step s",
            "compute",
            "exposed comm",
            "optimizer",
            "pipeline",
            "allocated GiB",
            "reserved GiB",
        )
        rows = [header]
        for i, e in enumerate(shown, 1):
            parts = e.breakdown
            rows.append(
                (
                    str(i),
                    e.layout.describe(),
                    f"{e.tokens_per_s_per_gpu:,.0f}",
                    f"{e.step_time:.3f}",
                    f"{parts['compute']:.3f}",
                    f"{parts['exposed communication']:.3f}",
                    f"{parts['optimizer']:.3f}",
                    f"{parts['pipeline']:.3f}",
                    f"{e.allocated_bytes / GIB:.1f}",
                    f"{e.reserved_bytes / GIB:.1f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if self.ranked:
            best = self.ranked[0]
            lines.append(
                f"best: {best.layout.describe()}: model state {best.memory_breakdown['model state'] / GIB:.1f} GiB, "
                f"activations and buffers {best.memory_breakdown['activations and buffers'] / GIB:.1f} GiB"
            )
        by_reason: dict[str, int] = {}
        for e in self.rejected:
            reason = e.reason.split(":")[0] if e.reason.startswith(("skipped", "lower bound")) else "over memory"
            by_reason[reason] = by_reason.get(reason, 0) + 1
        if by_reason:
            lines.append("rejected: " + ", ".join(f"{n} {reason}" for reason, n in sorted(by_reason.items())))
            for e in sorted(
                (e for e in self.rejected if not e.fits and e.allocated_bytes), key=lambda e: -e.reserved_bytes
            )[:3]:
                lines.append(f"  {e.layout.describe()}: {e.reason}")
        lines.append(
            f"planned in {self.seconds:.0f} s ({self.cpu_seconds:.0f} s CPU): {self.profiles_traced} profiles traced, "
            f"{self.profiles_cached} from the cache"
        )
        return "\n".join(lines)


def _config(model_or_config, seq: int | None) -> LlamaConfig:
    if isinstance(model_or_config, Llama):
        cfg = model_or_config.cfg
    elif isinstance(model_or_config, LlamaConfig):
        cfg = model_or_config
    elif isinstance(model_or_config, str):
        vocab = {"8b": LLAMA3_VOCAB, "70b": LLAMA3_VOCAB, "405b": LLAMA3_VOCAB}.get(model_or_config)
        cfg = preset(model_or_config, **({"vocab": vocab} if vocab else {}))
    else:
        raise TypeError(
            "fsdp_graph.plan(): pass a LlamaConfig, a Llama module or a preset name "
            f"({', '.join(PRESETS)}), got {type(model_or_config).__name__}; for another model, plan one layout "
            "with fsdp_graph.explain()"
        )
    if seq is not None and seq > cfg.seq:
        cfg = dataclasses.replace(cfg, seq=seq)
    return cfg


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    cfg: LlamaConfig,
    world: int,
    global_batch: int,
    hardware: Hardware,
    tp: tuple[int, ...] | None = None,
    pp: tuple[int, ...] | None = None,
    checkpoint: tuple[str, ...] = AC_MODES,
    hsdp: bool = True,
    reshard: tuple[bool, ...] = (True, False),
    compression: tuple[str | None, ...] = (None,),
    job: bool = False,
    micro_batch: tuple[int, ...] | None = None,
) -> list[Layout]:
    """Every layout of these options that divides the world and the batch (`job`: only what `python -m
    fsdp_graph train` runs: TP or PP not both, HSDP with 2 replicas, no gradient accumulation, no checkpointing
    with PP)."""
    node = hardware.ranks_per_node or world
    tps = tp or tuple(
        t for t in (1, 2, 4, 8, 16) if t <= node and not (cfg.kv_heads % t or cfg.hidden % t or cfg.heads % t)
    )
    pps = pp or tuple(p for p in (1, 2, 4, 8, 16) if cfg.layers % p == 0 and cfg.layers // p >= 2)
    layouts = []
    for t in tps:
        for p in pps:
            if world % (t * p) or (job and t > 1 and p > 1):
                continue
            dp = world // (t * p)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            replicas = [1]
            shard_in_node = max(node // t, 1)
            if hsdp and t == 1 and p == 1 and dp > shard_in_node and dp % shard_in_node == 0:
                replicas.append(2 if job else dp // shard_in_node)
            for r in replicas:
                if job and r > 1 and (t > 1 or dp % 2):
                    continue
                for mb in reversed(_divisors(per_rank)):
                    if micro_batch is not None and mb not in micro_batch:
                        continue
                    m = per_rank // mb
                    if (p > 1 and m < p) or (job and p == 1 and m > 1):
                        continue
                    for ac in checkpoint:
                        if job and p > 1 and ac != "none":
                            continue
                        for rs in reshard:
                            if not rs and (t > 1 or p > 1):
                                continue
                            for c in compression:
                                layouts.append(Layout(t, p, dp // r, r, ac, mb, m, rs, c))
    return layouts


def plan(
    model_or_config,
    *,
    world: int,
    hardware: str | Hardware = "h100",
    global_batch: int | None = None,
    seq: int | None = None,
    optimizer: str | None = "adamw",
    clip_grad: bool = True,
    bf16: bool = True,
    expandable_segments: bool = False,
    tp: tuple[int, ...] | None = None,
    pp: tuple[int, ...] | None = None,
    checkpoint: tuple[str, ...] = AC_MODES,
    hsdp: bool = True,
    reshard: tuple[bool, ...] = (True, False),
    compression: tuple[str | None, ...] = (None,),
    micro_batch: tuple[int, ...] | None = None,
    job: bool = False,
    top: int = 5,
    samples: tuple[int, ...] = (4,),
    memory_headroom: float = MEMORY_HEADROOM_BYTES,
    cache_dir: str | None = None,
    exhaustive: bool = False,
    baseline: bool = True,
    training_loop: TrainingLoop = PLAIN_LOOP,
    log=None,
) -> PlanResult:
    """Propose layouts for training `model_or_config` (a `LlamaConfig`, a `Llama` or a preset name: "8b", "70b" and
    "405b" with Llama 3's vocabulary) on `world` GPUs of `hardware` (a preset of `passes.hardware.HARDWARE`, e.g.
    "h100", "h200", "b200", "a100", or a `Hardware` with `memory_capacity_bytes` and `ranks_per_node`):
    `global_batch` sequences of `seq` tokens per step (default one sequence per GPU, the model's sequence length),
    the optimizer and clipping as `explain()` models them, bf16 compute with fp32 reduction (`bf16`).

    Searches the layouts of `candidate_layouts` (restrict with `tp`, `pp`, `checkpoint`, `hsdp`, `reshard`,
    `compression`, `micro_batch`; `job=True`: what the main job runs) as the module docstring says (`exhaustive=True` evaluates
    every candidate), rejects those whose reserved memory exceeds the device's less `memory_headroom`, ranks the
    rest by predicted tokens per second per GPU and returns a `PlanResult` (`print(result.to_text())`). It also
    plans plain FSDP (no TP, PP or checkpointing) for comparison (`baseline=False`: not). Traces run on the meta device with a fake process
    group in this process, which must not have one initialised. `cache_dir` keeps traced profiles on disk; `log`
    (e.g. `print`) is called with a line per traced profile. `training_loop`: what the loop around the model does
    to its memory (a bf16 model, accumulation without gradient sync, fp32 logits held; `layouts.TrainingLoop`).
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    cfg = _config(model_or_config, seq)
    seq = seq or cfg.seq
    hw = hardware if isinstance(hardware, Hardware) else HARDWARE.get(hardware)
    if hw is None:
        raise ValueError(f"plan(): unknown hardware {hardware!r}; use one of {sorted(HARDWARE)} or a Hardware")
    if not hw.memory_capacity_bytes:
        raise ValueError(f"plan(): hardware {hw.name!r} has no memory_capacity_bytes; use a GPU preset or set it")
    global_batch = global_batch or world
    usable = hw.memory_capacity_bytes - memory_headroom
    profiles = Profiles(hw, optimizer, clip_grad, expandable_segments, tuple(samples), cache_dir, log)
    result = PlanResult(cfg, world, hw, global_batch, seq, usable)
    layouts = candidate_layouts(
        cfg, world, global_batch, hw, tp, pp, tuple(checkpoint), hsdp, reshard, compression, job, micro_batch
    )
    if not layouts:
        raise ValueError(
            f"plan(): no layout of {world} ranks divides the global batch of {global_batch} sequences with these "
            "options; pick a global batch that is a multiple of the data-parallel sizes"
        )
    _search(result, layouts, profiles, cfg, seq, hw, usable, bf16, top, exhaustive, training_loop)
    if baseline:
        result.baseline = _baseline(cfg, world, global_batch, seq, hw, usable, bf16, profiles, training_loop)
    checked: set = set()
    while result.ranked and result.ranked[0].layout not in checked:
        # The best layout's profile is planned at two more depths; if that costs it throughput, layouts skipped for
        # a bound below its old figure may beat it now: search them again, then check the (new) best.
        best = result.ranked[0]
        checked.add(best.layout)
        if not profiles.extend(profiles.get(best.layout.profile_key(cfg, seq, bf16))):
            continue
        everything = [
            evaluate(e.layout, profiles.get(e.layout.profile_key(cfg, seq, bf16)), cfg, seq, hw, usable, training_loop)
            for e in result.ranked
        ]
        result.ranked = sorted((e for e in everything if e.fits), key=lambda e: -e.tokens_per_s_per_gpu)
        result.rejected += [e for e in everything if not e.fits]
        retry = [e.layout for e in result.rejected if e.reason.startswith("skipped: its throughput bound")]
        if retry:
            result.rejected = [e for e in result.rejected if e.layout not in set(retry)]
            _search(result, retry, profiles, cfg, seq, hw, usable, bf16, top, exhaustive, training_loop)
    result.profiles_traced = profiles.traced
    result.profiles_cached = sum(p.cached for p in profiles.profiles.values())
    result.seconds, result.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return result


def _search(result, layouts, profiles, cfg, seq, hw, usable, bf16, top, exhaustive, loop: TrainingLoop) -> None:
    bounds = {layout: throughput_bound(cfg, seq, layout, hw, bf16) for layout in layouts}
    fitting_settings: dict[tuple, int] = {}  # (everything but tp and the micro-batch) -> smallest fitting tp
    done_settings: set[tuple] = set()  # (everything but the micro-batch) that already fit with a larger one
    too_big: dict[tuple, Evaluation] = {}  # setting -> its evaluation at a larger micro-batch that did not fit
    ordered = sorted(layouts, key=lambda lay: (-bounds[lay], lay.tp, lay.pp, -lay.micro_batch, lay.dp_replicate))
    for layout in ordered:
        setting = (
            layout.tp,
            layout.pp,
            layout.dp_replicate,
            layout.checkpoint,
            layout.reshard_after_forward,
            layout.compression,
        )
        wider = setting[1:]
        lower = memory_lower_bound(cfg, seq, layout, bf16, loop)
        if lower > usable:
            result.rejected.append(_skipped(layout, f"lower bound: at least {lower / GIB:.1f} GiB"))
            continue
        if not exhaustive:
            if setting in done_settings:
                result.rejected.append(_skipped(layout, "skipped: a larger micro-batch fits"))
                continue
            if wider in fitting_settings and fitting_settings[wider] < layout.tp:
                result.rejected.append(_skipped(layout, f"skipped: TP {fitting_settings[wider]} fits"))
                continue
            if result.ranked and bounds[layout] < result.ranked[0].tokens_per_s_per_gpu:
                reason = f"skipped: its throughput bound, {bounds[layout]:,.0f} tokens/s/GPU, is below the best's"
                result.rejected.append(_skipped(layout, reason))
                continue
        if not exhaustive and setting in too_big:
            estimate = _scaled_reserved(too_big[setting], layout)
            if estimate > usable:
                reason = f"estimated {estimate / GIB:.1f} GiB reserved from micro-batch {too_big[setting].layout.micro_batch}"
                result.rejected.append(_skipped(layout, reason))
                continue
        profile = profiles.get(layout.profile_key(cfg, seq, bf16))
        evaluation = evaluate(layout, profile, cfg, seq, hw, usable, loop)
        if not evaluation.fits:
            too_big[setting] = evaluation
        if evaluation.fits:
            done_settings.add(setting)
            fitting_settings[wider] = min(fitting_settings.get(wider, layout.tp), layout.tp)
            result.ranked.append(evaluation)
            result.ranked.sort(key=lambda e: -e.tokens_per_s_per_gpu)
        else:
            result.rejected.append(evaluation)


def _scaled_reserved(traced: Evaluation, layout: Layout) -> float:
    """A smaller micro-batch's reserved memory from a traced larger one, scaling everything but the model state by
    the micro-batch ratio. Activations are linear in the batch; what else is counted with them (gathered blocks,
    buffers) does not shrink, so this underestimates: a layout it rejects does not fit."""
    state = traced.memory_breakdown["model state"]
    scale = layout.micro_batch / traced.layout.micro_batch
    return state + (traced.reserved_bytes - state) * scale


def _skipped(layout: Layout, reason: str) -> Evaluation:
    return Evaluation(layout, 0.0, 0.0, 0.0, 0.0, fits=False, reason=reason)


def _baseline(cfg, world, global_batch, seq, hw, usable, bf16, profiles, loop: TrainingLoop) -> Evaluation | None:
    if global_batch % world:
        return None
    layout = Layout(1, 1, world, 1, "none", global_batch // world, 1)
    return evaluate(layout, profiles.get(layout.profile_key(cfg, seq, bf16)), cfg, seq, hw, usable, loop)
