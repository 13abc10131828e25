"""Train a sharded model and a single-process full-batch reference side by side (run inside each rank)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._foreach_utils import _has_foreach_support

import fsdp_graph
from fsdp_graph import compat
from tests.workers.models import (
    GPT,
    Block,
    BNNet,
    CheckpointedGPT,
    ConvNet,
    GPTConfig,
    HFStyleNet,
    OddMLP,
    SharedBlockNet,
    SkipNet,
    gpt_loss,
)


@dataclass(frozen=True)
class Case:
    """One parity run. mode: "eager" (no compile), "aot" (make_backend(inductor=False)), "inductor"."""

    model: str
    optim: str = "adamw"
    strategy: str = "FULL_SHARD"
    mode: str = "aot"
    steps: int = 5
    wrap: str = "auto"
    reference: str = "single"  # "single": one process on the full batch; "ddp": DDP on the same local batches
    mp: bool = False  # MixedPrecision(param_dtype=bf16, reduce_dtype=fp32); the reference casts the same way
    freeze: tuple[str, ...] = ()  # parameters whose FQN starts with one of these are frozen (in both models)
    reshard: str = "default"  # a key of RESHARD: what fully_shard's reshard_after_forward gets
    dynamic: bool = False  # the per-rank batch size changes every step
    offload: bool = False  # CPUOffload(offload_params=True)
    separate_reduce_group: bool = False  # fully_shard's option
    activation_memory_budget: float | None = None  # make_backend's option
    bucket_bytes: int = 0  # make_backend(bucket_bytes=...): merge consecutive units' collectives
    verify_collectives: bool = True  # make_backend's option: ranks compare each graph's collectives at its first call
    layout: str | None = None  # fully_shard's layout ("flat" / "rows"); None: its default
    verify_timeout_s: float = 600.0  # make_backend's option
    # At step LONE_STEP the last rank alone recompiles: "shorter" (gpt: a shorter sequence, the same collectives;
    # the reference averages the ranks' mean losses, every step), "no_sync" (its backward without reduction: other
    # collectives, which the rank check refuses).
    lone_recompile: str = ""


LONE_STEP = 3

RESHARD = {
    "default": None,
    "keep_root": {"": False},
    "int2": 2,  # every unit keeps a 1/2 piece after forward; the backward gathers over pairs of ranks
    "int2_root": {"": 2},  # the root alone (the mapping form); the other units reshard fully
}


@dataclass
class CaseResult:
    case: Case
    losses: list[float]
    ref_losses: list[float]
    max_param_diff: float
    param_change: float  # max |final - initial| of the reference: parity is not vacuous
    reports: list = field(default_factory=list)
    dynamo_graphs: int = 0
    max_param_ndim: int = 0  # over model.parameters() after sharding: 1 with the flat layout, the original with rows
    foreach_by_default: bool = False  # torch_picks_foreach(model.parameters()) after sharding


def _mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def build(name: str) -> tuple[nn.Module, Callable, Callable[[torch.Generator, int], tuple]]:
    """(model, loss_fn, make_batch(generator, batch_size)) for a named test model."""
    if name == "gpt":
        cfg = GPTConfig()
        return (
            GPT(cfg),
            gpt_loss,
            lambda g, b: (
                torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g),
                torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g),
            ),
        )
    if name in ("gpt_ac", "gpt_sac"):
        cfg = GPTConfig()
        return (
            CheckpointedGPT(cfg, selective=name == "gpt_sac"),
            gpt_loss,
            lambda g, b: (
                torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g),
                torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g),
            ),
        )
    if name == "mlp":
        return OddMLP(), _mse, lambda g, b: (torch.randn(b, 7, generator=g), torch.randn(b, 5, generator=g))
    if name == "bn":
        return BNNet(), _mse, lambda g, b: (torch.randn(b, 6, generator=g), torch.randn(b, 3, generator=g))
    if name == "shared":
        return SharedBlockNet(), _mse, lambda g, b: (torch.randn(b, 5, generator=g), torch.randn(b, 3, generator=g))
    if name == "skip":

        def skip_loss(model, batch):
            x, y, use_extra = batch
            return F.mse_loss(model(x, use_extra=use_extra), y)

        return (
            SkipNet(),
            skip_loss,
            lambda g, b: (
                torch.randn(b, 8, generator=g),
                torch.randn(b, 3, generator=g),
                bool(torch.randint(0, 2, (1,), generator=g).item()),
            ),
        )
    if name in ("hf", "hf_dataclass"):

        def hf_loss(model, batch):
            ids, labels = batch
            out = model(input_ids=ids, labels=labels)
            return out.loss if name == "hf_dataclass" else out["loss"]

        return (
            HFStyleNet(return_dataclass=name == "hf_dataclass"),
            hf_loss,
            lambda g, b: (
                torch.randint(0, 32, (b, 6), generator=g),
                torch.randint(0, 32, (b, 6), generator=g),
            ),
        )
    if name == "conv":
        return ConvNet(), _mse, lambda g, b: (torch.randn(b, 3, 8, 8, generator=g), torch.randn(b, 5, generator=g))
    raise ValueError(name)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """`name`: "sgd" (momentum) or "adamw", each optionally "_foreach" or "_fused" (torch's multi-tensor kernels:
    on a GPU the default for plain parameters and for ours; on CPU torch's default is one tensor at a time)."""
    kind, _, kernels = name.partition("_")
    kwargs = {kernels: True} if kernels else {}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9, **kwargs)


def torch_picks_foreach(params) -> bool:
    """Whether torch's optimizers default to their foreach kernels for `params` on a device that has them, and
    torch's `clip_grad_norm_` takes them too. Both decide by exact type; CPU has no foreach kernels of its own, so
    the optimizer's device check is told that it has."""
    params = list(params)
    device = params[0].device
    with mock.patch("torch.optim.optimizer._get_foreach_kernels_supported_devices", return_value=[device.type]):
        _, foreach = _default_to_fused_or_foreach(params, differentiable=False)
    return foreach and _has_foreach_support(params, device)


def wrap_policy(name: str):
    if name == "auto":
        return None
    if name == "nested":  # blocks are units and so is every Linear inside them
        return fsdp_graph.ModuleWrapPolicy({Block, nn.Linear})
    if name == "linear":
        return fsdp_graph.ModuleWrapPolicy({nn.Linear})
    if name == "size":
        return fsdp_graph.size_based_wrap_policy(min_num_params=100)
    raise ValueError(name)


def shard_and_compile(model: nn.Module, case: Case):
    strategy = fsdp_graph.ShardingStrategy[case.strategy]
    mesh = None
    if strategy.is_hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    fsdp_graph.fully_shard(
        model,
        mesh,
        wrap=wrap_policy(case.wrap),
        strategy=strategy,
        mixed_precision=BF16 if case.mp else None,
        reshard_after_forward=RESHARD[case.reshard],
        cpu_offload=fsdp_graph.CPUOffload(offload_params=True) if case.offload else None,
        separate_reduce_group=case.separate_reduce_group,
        **({} if case.layout is None else {"layout": case.layout}),
    )
    if case.mode == "eager":
        return model, None
    backend = fsdp_graph.make_backend(
        inductor=case.mode == "inductor",
        bucket_bytes=case.bucket_bytes,
        activation_memory_budget=case.activation_memory_budget,
        verify_collectives=case.verify_collectives,
        verify_timeout_s=case.verify_timeout_s,
    )
    return torch.compile(model, backend=backend, fullgraph=True), backend


BF16 = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def freeze(model: nn.Module, prefixes: tuple[str, ...]) -> None:
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)


def _bf16_reference_loss(ref: nn.Module, loss_fn, batch) -> torch.Tensor:
    """The reference for mixed precision: compute with bf16 copies of the fp32 parameters (floating inputs cast
    too), then hand the fp32 parameters the bf16 gradients cast back, as FSDP's MixedPrecision does."""
    params = dict(ref.named_parameters())
    low = {n: p.detach().to(torch.bfloat16).requires_grad_(p.requires_grad) for n, p in params.items()}

    def cast(t):
        return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def call(*args, **kwargs):
        return torch.func.functional_call(
            ref, low, tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
        )

    loss = loss_fn(call, batch)
    loss.backward()
    for n, p in params.items():
        if low[n].grad is not None:
            p.grad = low[n].grad.float()
    return loss


def max_param_diff(model: nn.Module, ref: nn.Module) -> float:
    """Max abs difference over every floating-point state entry (parameters and this rank's buffers)."""
    full = fsdp_graph.full_state_dict(model)
    ref_sd = ref.state_dict()
    assert set(full) == set(ref_sd), set(full) ^ set(ref_sd)
    return max((full[k] - ref_sd[k]).abs().max().item() for k in ref_sd if ref_sd[k].is_floating_point())


def _mean_over_ranks_step(ref: nn.Module, loss_fn, rank_batches: list[tuple]) -> float:
    """The reference for ranks with batches of different shapes: the mean of the ranks' mean losses."""
    loss = sum(loss_fn(ref, batch) for batch in rank_batches) / len(rank_batches)
    loss.backward()
    return loss.item()


def _reference_step(case: Case, ref: nn.Module, loss_fn, full_batch, local_batch) -> float:
    if case.mp:
        return _bf16_reference_loss(ref, loss_fn, full_batch).item()
    if case.reference == "ddp":
        loss = loss_fn(ref, local_batch)
        loss.backward()
        value = loss.detach().clone()
        dist.all_reduce(value)
        return value.item() / dist.get_world_size()
    loss = loss_fn(ref, full_batch)
    loss.backward()
    return loss.item()


def run_case(case: Case, rank: int, world: int, per_rank_batch: int = 4) -> CaseResult:
    torch.manual_seed(0)
    model, loss_fn, make_batch = build(case.model)
    freeze(model, case.freeze)
    ref = copy.deepcopy(model)
    ref_module = ref
    initial = copy.deepcopy(ref.state_dict())
    if case.reference == "ddp":
        ref = nn.parallel.DistributedDataParallel(ref, broadcast_buffers=False)
    compiled, backend = shard_and_compile(model, case)
    opt = make_optimizer(case.optim, model.parameters())
    ref_opt = make_optimizer(case.optim, ref.parameters())
    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses = [], []
    for step in range(case.steps):
        batch_size = (per_rank_batch + step % 3) if case.dynamic else per_rank_batch
        full_batch = make_batch(gen, batch_size * world)
        if case.dynamic and case.model == "gpt":  # the sequence length changes too
            full_batch = tuple(t[:, : t.shape[1] - 4 * (step % 3)] for t in full_batch)
        local = tuple(t.chunk(world)[rank] if isinstance(t, torch.Tensor) else t for t in full_batch)
        lone = bool(case.lone_recompile) and step == LONE_STEP
        rank_batches = None
        if case.lone_recompile == "shorter":
            rank_batches = [tuple(t.chunk(world)[r] for t in full_batch) for r in range(world)]
            if lone:  # an epoch's last batch, shorter on one rank
                rank_batches[-1] = tuple(t[:, :-4] for t in rank_batches[-1])
            local = rank_batches[rank]
        alone = lone and rank == world - 1 and case.lone_recompile == "no_sync"
        with fsdp_graph.no_sync(model) if alone else contextlib.nullcontext():
            loss = loss_fn(compiled, local)
            loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        if rank_batches is None:
            ref_losses.append(_reference_step(case, ref, loss_fn, full_batch, local))
        else:
            ref_losses.append(_mean_over_ranks_step(ref, loss_fn, rank_batches))
        ref_opt.step()
        ref_opt.zero_grad()
    return CaseResult(
        case,
        losses,
        ref_losses,
        max_param_diff(model, ref_module),
        max((v - initial[k]).abs().max().item() for k, v in ref_module.state_dict().items() if v.is_floating_point()),
        reports=list(backend.reports) if backend else [],
        dynamo_graphs=backend.dynamo_graphs if backend else 0,
        max_param_ndim=max(p.ndim for p in model.parameters()),
        foreach_by_default=torch_picks_foreach(model.parameters()),
    )


def run_cases(rank: int, world: int, cases: list[Case]) -> list[CaseResult]:
    return [run_case(c, rank, world) for c in cases]


def is_shard_view(model: nn.Module, param: torch.Tensor) -> bool:
    """Whether `param` (read from its module) is the sharded `nn.Parameter` the optimizer holds, under either layout
    (a 1-D slice with "flat", a row block with "rows", which may have the full shape on a rank holding every row),
    rather than an unsharded parameter."""
    return any(param is view for state in fsdp_graph.runtime.unit.flat_params(model) for view in state.views)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every original parameter's full gradient, reassembled from the ranks' sharded `.grad` views."""
    out = {}
    for state in fsdp_graph.runtime.unit.flat_params(model):
        layout = state.layout
        if not state.flat_shard.requires_grad:
            continue
        local = torch.zeros(layout.shard_numel)
        for slot, view in zip(layout.slots, state.views):
            lo, hi = layout.local_range(slot)
            if view.grad is not None:
                local[lo:hi] = view.grad.reshape(-1)  # 1-D (flat) or the (rows, *trailing) row block (rows)
        full = torch.empty(layout.padded_numel)
        if state.world == 1:
            full = local
        else:
            group = dist.distributed_c10d._resolve_process_group(state.group_name)
            compat.all_gather_single(full, local, group=group)
        for slot, grad in zip(layout.slots, layout.unflatten(full)):
            for fqn in slot.fqns:
                out[fqn] = grad
    return out


def grad_semantics(rank: int, world: int, mode: str) -> dict[str, float]:
    """Max |grad - reference grad| after: two backwards without zero_grad (accumulation), then
    zero_grad(set_to_none=True) + backward, then zero_grad(set_to_none=False) + backward."""
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    ref = copy.deepcopy(model)
    compiled, _ = shard_and_compile(model, Case("gpt", mode=mode))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    batches = [make_batch(gen, 4 * world) for _ in range(4)]

    def backward(batch):
        loss_fn(compiled, tuple(t.chunk(world)[rank] for t in batch)).backward()
        loss_fn(ref, batch).backward()

    def diff() -> float:
        grads = full_grads(model)
        return max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())

    result = {}
    backward(batches[0])
    backward(batches[1])
    result["accumulated"] = diff()
    opt.step()
    ref_opt.step()
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    backward(batches[2])
    result["after_zero_grad_none"] = diff()
    opt.zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    backward(batches[3])
    result["after_zero_grad_zeros"] = diff()
    result["grad_norm"] = max(p.grad.abs().max().item() for p in ref.parameters())
    return result


def step_counts(rank: int, world: int, strategy: str, steps: int = 10) -> dict:
    """Train `steps` steps compiled without fullgraph; report graphs, graph breaks and collectives."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    case = Case("gpt", strategy=strategy, mode="aot")
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    fsdp_graph.fully_shard(model, strategy=fsdp_graph.ShardingStrategy[strategy])
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend)
    opt = make_optimizer(case.optim, model.parameters())
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        loss_fn(compiled, make_batch(gen, 4)).backward()
        opt.step()
        opt.zero_grad()
    return {
        "units": len(fsdp_graph.runtime.unit.sharded_units(model)),
        "dynamo_graphs": backend.dynamo_graphs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "reports": [(r.stage, dict(r.collectives.counts)) for r in backend.reports],
    }


def inference_outputs(rank: int, world: int, mode: str) -> float:
    """Max |sharded - reference| of logits under torch.no_grad (the compiled inference graph) and in eval."""
    torch.manual_seed(0)
    model, _, make_batch = build("gpt")
    ref = copy.deepcopy(model)
    compiled, backend = shard_and_compile(model, Case("gpt", mode=mode))
    idx, _ = make_batch(torch.Generator().manual_seed(5), 2)
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, expected = compiled(idx), ref(idx)
    if backend is not None:
        assert [r.stage for r in backend.reports] == ["inference"], backend.reports
        assert backend.reports[0].collectives.counts == {"all_gather": 3}
    return (out - expected).abs().max().item()


def llama_step_beside_reference(
    compiled, opt, local: tuple, ref, ref_opt, full: tuple, world: int
) -> tuple[float, float]:
    """One optimizer step of the sharded model on this rank's batch and of the single-process reference on the
    global one: (the loss averaged over ranks, the reference's loss)."""
    from fsdp_graph.train.llama import llama_loss

    loss = llama_loss(compiled, local)
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach().clone()
    torch.distributed.all_reduce(value)
    ref_loss = llama_loss(ref, full)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return value.item() / world, ref_loss.item()
