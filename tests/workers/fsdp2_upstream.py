"""Rank-side checks re-creating torch's FSDP2 tests (test/distributed/_composable/fsdp/) on `fsdp_graph.fsdp2`
(issue 28): the same models, calling conventions and assertions, written here. One spawn runs every check, eager
and compiled; each check's result is a dict of floats under its name (an exception is recorded as `error`, so one
failing check does not hide the others; every check raises symmetrically on both ranks)."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import fsdp_graph
from fsdp_graph import fsdp2
from fsdp_graph.fsdp2 import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from tests.workers import upstream_common, upstream_registry

MODES = ("eager", "compiled")


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden or 4 * dim)
        self.out_proj = nn.Linear(hidden or 4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def mlp_stack(dim: int = 8, depth: int = 3) -> nn.Sequential:
    return nn.Sequential(*(MLP(dim) for _ in range(depth)))


class ParameterOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self) -> torch.Tensor:
        return self.weight @ self.weight


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (FSDP2's parameters and gradients), anything else as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def row_block(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """`full`'s Shard(0) block on `rank` (torch.chunk: the last ranks may get fewer rows or none)."""
    chunks = full.chunk(world)
    return chunks[rank] if rank < len(chunks) else full[:0]


def shard_blocks(model: nn.Module, **options) -> nn.Module:
    """FSDP2's convention: each child of the stack, then the root."""
    for child in model:
        fsdp2.fully_shard(child, **options)
    return fsdp2.fully_shard(model, **options)


def _runner(model: nn.Module, mode: str, out: dict[str, float]) -> nn.Module:
    """`model`, or compiled (one graph per step expected: `out["graphs"]` counts Dynamo's graphs as they come)."""
    if mode == "eager":
        return model
    torch._dynamo.reset()  # every check's models are new: no recompile limit carried over
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def run(*args):
        result = compiled(*args)
        out["graphs"] = float(backend.dynamo_graphs)
        return result

    return run


def _param_diff(model: nn.Module, ref: nn.Module, rank: int, world: int, fsdp_names: bool = True) -> float:
    params = dict(model.named_parameters())
    worst = 0.0
    for name, ref_param in ref.named_parameters():
        expected = row_block(ref_param.detach(), rank, world) if fsdp_names else ref_param.detach()
        mine = local(params[name].detach())
        if mine.shape != expected.shape:
            return float("inf")
        if mine.numel():
            worst = max(worst, (mine.double() - expected.double()).abs().max().item())
    return worst


def train_parity(
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], object],
    rank: int,
    world: int,
    mode: str,
    steps: int = 4,
    inputs: Callable[[torch.Generator], torch.Tensor] | None = None,
    microbatches: int = 1,
    dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Training parity against the same model in one process on the whole batch (DDP's result), SGD with
    momentum: the largest loss and parameter (row block) differences over `steps`."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    shard(model)
    if dtype is not None:
        model.to(dtype)  # after fully_shard (TestFullyShardCastAfterInit)
        ref.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    out = {"loss_diff": 0.0, "param_diff": 0.0}
    run = _runner(model, mode, out)
    gen = torch.Generator().manual_seed(1)
    make = inputs or (lambda g: torch.randn(world * 4, 8, generator=g))
    for _ in range(steps):
        for micro in range(microbatches):
            x = make(gen)
            if dtype is not None and x.is_floating_point():
                x = x.to(dtype)
            last = micro == microbatches - 1
            if microbatches > 1:  # FSDP2's gradient accumulation idiom
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            loss = run(x.chunk(world)[rank]).float().pow(2).mean() / microbatches
            loss.backward()
            ref_losses = [ref(chunk).float().pow(2).mean() / microbatches for chunk in x.chunk(world)]
            (sum(ref_losses) / world).backward()
            out["loss_diff"] = max(out["loss_diff"], abs(loss.item() - ref_losses[rank].item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["param_diff"] = max(out["param_diff"], _param_diff(model, ref, rank, world))
    out["moved"] = float(any(not torch.equal(p, q.to(p.dtype)) for p, q in zip(ref.parameters(), initial.parameters())))
    out["dtensors"] = float(all(isinstance(p, DTensor) for p in model.parameters()))
    if dtype is not None:
        out["dtype_kept"] = float(all(p.dtype == local(p).dtype == dtype for p in model.parameters()))
    return out


def _mixed_precision(rank: int, world: int, mode: str) -> dict[str, float]:
    """bf16 compute, fp32 reduction: against torch's FSDP2 with the same policy (TestFullyShardMixedPrecisionTraining
    compares with a reference doing FSDP2's casts by hand; FSDP2 itself is that reference here)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = mlp_stack()
    ref = copy.deepcopy(model)
    shard_blocks(model, mp_policy=policy)
    for child in ref:
        torch.distributed.fsdp.fully_shard(child, mp_policy=policy)
    torch.distributed.fsdp.fully_shard(ref, mp_policy=policy)
    for module in ref.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    out = {"loss_diff": 0.0, "param_diff": 0.0, "out_bf16": 1.0}
    run = _runner(model, mode, out)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(world * 4, 8, generator=gen).chunk(world)[rank]
        y, ref_y = run(x), ref(x)
        out["out_bf16"] = min(out["out_bf16"], float(y.dtype == torch.bfloat16 == ref_y.dtype))
        loss, ref_loss = y.float().pow(2).mean(), ref_y.float().pow(2).mean()
        loss.backward()
        ref_loss.backward()
        out["loss_diff"] = max(out["loss_diff"], abs(loss.item() - ref_loss.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        mine = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            diff = (local(mine[name].detach()) - p.to_local().detach()).abs().max().item()
            out["param_diff"] = max(out["param_diff"], diff)
    return out


def _no_forward_inputs(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = ParameterOnly()
    ref = copy.deepcopy(model)
    fsdp2.fully_shard(model)
    out = model()
    out.sum().backward()
    ref().sum().backward()
    return {
        "shape": float(out.shape == (4, 4)),
        "out_diff": (out - ref()).abs().max().item(),
        "grad_diff": (local(model.weight.grad) - row_block(ref.weight.grad, rank, world)).abs().max().item(),
    }


def _cpu_offload(rank: int, world: int) -> dict[str, float]:
    return train_parity(mlp_stack, lambda m: shard_blocks(m, offload_policy=CPUOffloadPolicy()), rank, world, "eager")


def _classes(rank: int, world: int) -> dict[str, float]:
    model = nn.Sequential(nn.Embedding(16, 8), MLP(8), nn.LayerNorm(8), nn.Linear(8, 16))
    fsdp2.fully_shard(model[1])
    fsdp2.fully_shard([model[2], model[3]])
    result = fsdp2.fully_shard(model)
    called = [model[1], model[2], model[3], model]
    originals = [MLP, nn.LayerNorm, nn.Linear, nn.Sequential]
    out = {"returns_module": float(result is model)}
    list(model.parameters())  # the calls are sharded at first use
    out["fsdp_modules"] = float(all(isinstance(m, FSDPModule) for m in called))
    out["originals"] = float(all(isinstance(m, c) for m, c in zip(called, originals)))
    out["names"] = float(all(type(m).__name__ == f"FSDP{c.__name__}" for m, c in zip(called, originals)))
    out["others_plain"] = float(not isinstance(model[0], FSDPModule) and not isinstance(model[1].in_proj, FSDPModule))
    try:
        fsdp2.fully_shard(model[1])
        out["second_call_refused"] = 0.0
    except RuntimeError as error:
        out["second_call_refused"] = float("already" in str(error))
    return out


def _state_dict(rank: int, world: int) -> dict[str, float]:
    """Keys as unsharded, values DTensors sharded on dim 0; loading another model's state dict gives its weights."""
    torch.manual_seed(0)
    model, other = mlp_stack(), mlp_stack()
    ref_sd = {k: v.clone() for k, v in model.state_dict().items()}
    for m in (model, other):
        shard_blocks(m)
    sd = model.state_dict()
    out = {"keys": float(list(sd) == list(ref_sd))}
    out["dtensors"] = float(all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in sd.values()))
    out["full_diff"] = max((v.full_tensor() - ref_sd[k]).abs().max().item() for k, v in sd.items())
    other.load_state_dict(sd)
    out["load_diff"] = max(
        (local(p) - local(dict(model.named_parameters())[n])).abs().max().item() for n, p in other.named_parameters()
    )
    return out


CHECKS: dict[str, Callable[[int, int, str], dict[str, float]]] = {
    "mixed_precision": _mixed_precision,
    "to_float64": lambda rank, world, mode: train_parity(mlp_stack, shard_blocks, rank, world, mode, dtype=torch.float64),
    "grad_accumulation": lambda rank, world, mode: train_parity(
        mlp_stack, shard_blocks, rank, world, mode, microbatches=3
    ),
}
EAGER_ONLY: dict[str, Callable[[int, int], dict[str, float]]] = {
    "no_forward_inputs": _no_forward_inputs,
    "cpu_offload": _cpu_offload,
    "classes": _classes,
    "state_dict": _state_dict,
}


def upstream_checks(rank: int, world: int, part: str) -> dict[str, dict[str, float | str]]:
    """The re-created checks of one part: "trained" (eager and compiled) or "eager" (the others). Two spawns keep
    each under pytest's per-test timeout on a loaded machine."""
    results: dict[str, dict[str, float | str]] = {}
    if part == "trained":
        for mode in MODES:
            for name, check in {**CHECKS, **upstream_registry.TRAINED}.items():
                results[f"{name}[{mode}]"] = _recorded(check, rank, world, mode)
        return results
    for name, check in {**EAGER_ONLY, **upstream_registry.EAGER}.items():
        results[name] = _recorded(check, rank, world)
    return results


def upstream_checks_on_torch_fsdp2(rank: int, world: int) -> dict[str, dict[str, float | str]]:
    """The same checks, eager, with torch's `fully_shard` (how they were confirmed to pass on FSDP2, CPU, gloo)."""
    upstream_common.USE_TORCH_FSDP2 = True
    results: dict[str, dict[str, float | str]] = {}
    for name, check in upstream_registry.TRAINED.items():
        results[f"{name}[eager]"] = _recorded(check, rank, world, "eager")
    for name, check in upstream_registry.EAGER.items():
        results[name] = _recorded(check, rank, world)
    return results


def _recorded(check: Callable[..., dict[str, float]], *args) -> dict[str, float | str]:
    try:
        return check(*args)
    except Exception:  # recorded for the test that owns this check
        return {"error": traceback.format_exc(limit=6)}
    finally:
        fsdp2.calls._PENDING.clear()  # a failed check's calls must not shard with the next check's
        torch.distributed.barrier()  # a check that failed on one rank only must not pair collectives with the next
