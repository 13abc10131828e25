"""Rank-side workers for strategy, precision and model-shape tests (each returns plain data)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_graph
from fsdp_graph.ir.ops import gradient_divide_factors
from fsdp_graph.planning.measure import executed_collectives
from fsdp_graph.runtime.unit import flat_params
from tests.workers.training import BF16, Case, build, full_grads, max_param_diff, shard_and_compile


def ignored_module_grads(rank: int, world: int, mode: str) -> dict[str, float]:
    """`head` ignored: it stays a full replicated Parameter and its gradient is this rank's own (not reduced)."""
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("mlp")
    ref = copy.deepcopy(model)
    ignored = model.layers[2]
    original = ignored.weight
    fsdp_graph.fully_shard(model, ignored_modules=[ignored])
    step_model = model if mode == "eager" else torch.compile(model, backend=fsdp_graph.make_backend(inductor=False))
    full_batch = make_batch(torch.Generator().manual_seed(2), 4 * world)
    local = tuple(t.chunk(world)[rank] for t in full_batch)
    loss_fn(step_model, local).backward()
    loss_fn(ref, local).backward()  # the local-batch gradient: what an unreduced parameter must get
    full_ref = copy.deepcopy(ref)
    full_ref.zero_grad()
    loss_fn(full_ref, full_batch).backward()
    return {
        "same_object": float(model.layers[2].weight is original and original.shape == (5, 11)),
        "ignored_vs_local": (model.layers[2].weight.grad - ref.layers[2].weight.grad).abs().max().item(),
        "ignored_vs_global": (model.layers[2].weight.grad - full_ref.layers[2].weight.grad).abs().max().item(),
        "sharded_units": float(len(flat_params(model))),
    }


def _deterministic_init(module: nn.Module) -> None:
    for i, p in enumerate(module.parameters(recurse=False)):
        gen = torch.Generator().manual_seed(p.numel() * 31 + i)
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def meta_init_parity(rank: int, world: int) -> dict[str, float]:
    """Built on the meta device, materialised shard by shard: equals a CPU model initialised the same way,
    before and after 3 steps of training."""
    from tests.workers.models import GPT, GPTConfig

    cfg = GPTConfig()
    with torch.device("meta"):
        model = GPT(cfg)
    ref = GPT(cfg)
    with torch.no_grad():
        for m in ref.modules():
            _deterministic_init(m)
    fsdp_graph.fully_shard(model, param_init_fn=_deterministic_init)
    before = max_param_diff(model, ref)
    _, loss_fn, make_batch = build("gpt")
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        full = make_batch(gen, 4 * world)
        loss_fn(compiled, tuple(t.chunk(world)[rank] for t in full)).backward()
        loss_fn(ref, full).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {
        "before": before,
        "after": max_param_diff(model, ref),
        "local_numel": float(sum(s.flat_shard.numel() for s in flat_params(model))),
        "full_numel": float(sum(p.numel() for p in ref.parameters())),
    }


def sync_states(rank: int, world: int, sync: bool) -> float:
    """Ranks start from different weights; with sync_module_states they all train rank 0's."""
    torch.manual_seed(100 + rank)
    model, _, _ = build("mlp")
    names = [n for n, _ in model.named_parameters()]
    rank0_weights = [p.detach().clone() for p in model.parameters()]
    for weight in rank0_weights:  # every rank learns rank 0's initial values
        dist.broadcast(weight, src=0)
    fsdp_graph.fully_shard(model, sync_module_states=sync)
    full = fsdp_graph.full_state_dict(model)
    return max((full[n] - w).abs().max().item() for n, w in zip(names, rank0_weights))


def executed_bytes(rank: int, world: int, strategy: str, mp: bool) -> dict:
    """One training step of the GPT per strategy, counted from what executes (profiler)."""
    case = Case("gpt", strategy=strategy, mp=mp, mode="aot")
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    compiled, _ = shard_and_compile(model, case)
    batch = make_batch(torch.Generator().manual_seed(0), 4)
    loss_fn(compiled, batch).backward()  # compile outside the measurement
    states = flat_params(model)
    replicate = states[0].replicate_world
    group = states[0].world if states[0].world > 1 else replicate  # every group in these runs has this size
    measured = executed_collectives(
        lambda: loss_fn(compiled, batch).backward(), group_size_of_all_reduce=replicate, group_size=group
    )
    return {
        "counts": dict(measured.counts),
        "wire": dict(measured.wire_bytes),
        "dtypes": dict(measured.dtypes),
        "backend_wire": sum(measured.backend_wire_bytes.values()),
        "backend_counts": dict(measured.backend_counts),
        "params": sum(s.layout.numel for s in states),
        "padded": sum(s.layout.padded_numel for s in states),
        "units": len(states),
        "shard_world": states[0].world,
        "replicate_world": replicate,
        "param_bytes": 2 if mp else 4,
        "reduce_bytes": 4,
    }


__all__ = ["BF16", "executed_bytes", "ignored_module_grads", "meta_init_parity", "sync_states"]


def low_precision_grads(rank: int, world: int) -> dict[str, float]:
    """keep_low_precision_grads: `.grad` in bf16 on fp32 parameters, equal to the fp32-stored gradient rounded
    (after two backwards, so accumulation happens in the kept dtype)."""
    grads, dtypes_ok = {}, {}
    for keep in (False, True):
        torch.manual_seed(0)
        model, loss_fn, make_batch = build("gpt")
        mp = fsdp_graph.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=keep
        )
        fsdp_graph.fully_shard(model, mixed_precision=mp)
        compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
        batch = make_batch(torch.Generator().manual_seed(1), 4)
        for _ in range(2):
            loss_fn(compiled, batch).backward()
        grads[keep] = {n: p.grad.clone() for n, p in model.named_parameters()}
        expected = torch.bfloat16 if keep else torch.float32
        dtypes_ok[keep] = all(p.grad.dtype == expected and p.dtype == torch.float32 for p in model.parameters())
    present = [n for n in grads[True] if grads[True][n].numel()]  # a rank may hold none of a parameter
    return {
        "dtypes_ok": float(dtypes_ok[False] and dtypes_ok[True]),
        "diff": max((grads[True][n].float() - grads[False][n]).abs().max().item() for n in present),
        "scale": max(grads[False][n].abs().max().item() for n in present),
    }


def fp16_reduction(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Gradients reduced in fp16 whose plain sum over the ranks overflows (each rank's is 40000-60000, fp16's max
    is 65504): the divide factors keep the reduction finite. Per mode, the largest relative error of the
    reassembled `.grad` against the fp32 mean of the ranks' gradients, and whether the backward graph pre-divides."""
    out = {}
    for mode in ("compiled", "eager"):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        ref = copy.deepcopy(model)
        fsdp_graph.fully_shard(model, mixed_precision=fsdp_graph.MixedPrecision(reduce_dtype=torch.float16))
        backend = fsdp_graph.make_backend(inductor=False)
        run = model if mode == "eager" else torch.compile(model, backend=backend, fullgraph=True)
        gen = torch.Generator().manual_seed(3)
        batches = [torch.empty(2, 4).uniform_(1.0, 1.5, generator=gen) for _ in range(world)]
        scale = 20000.0  # bias gradient 2 * 20000 = 40000 per rank; weight 20000 * (2..3)
        (run(batches[rank]) * scale).sum().backward()
        for batch in batches:
            (ref(batch) * scale).sum().backward()
        grads = full_grads(model)
        mean = {n: p.grad / world for n, p in ref.named_parameters()}
        error = max(((grads[n] - m).abs() / m.abs()).max().item() for n, m in mean.items())
        pre, _ = gradient_divide_factors(world)
        bw = [r.code for r in backend.reports if r.stage == "bw"]
        pre_divides = bool(bw) and f"torch.ops.aten.div.Tensor(convert_element_type_default, {pre})" in bw[0]
        out[mode] = {"error": error, "pre_divides": float(pre_divides)}
    return out
