"""Rank-side workers for FSDP2's per-module controls on sharded units (issue 12)."""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from fsdp_graph.runtime.unit import flat_params, sharded_units
from tests.workers.eager_reshard import DeepMLP, generate
from tests.workers.training import Case, full_grads, is_shard_view, shard_and_compile


def _sharded(mode: str) -> tuple[DeepMLP, DeepMLP, nn.Module, object]:
    torch.manual_seed(0)
    model = DeepMLP()
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model)
    if mode == "eager":
        return model, ref, model, None
    backend = fsdp_graph.make_backend(inductor=False)
    return model, ref, torch.compile(model, backend=backend, fullgraph=True), backend


def _train_step(run: nn.Module, ref: nn.Module, rank: int, world: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4 * world, 256, generator=gen), torch.randn(4 * world, 1, generator=gen)
    nn.functional.mse_loss(run(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    nn.functional.mse_loss(ref(x), y).backward()


def unshard_reshard(rank: int, world: int, mode: str) -> dict[str, float]:
    model, ref, run, backend = _sharded(mode)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    out: dict[str, float] = {
        "is_fsdp_module": float(all(isinstance(u, fsdp_graph.FSDPModule) for u in sharded_units(model)))
    }
    for step in range(3):
        _train_step(run, ref, rank, world, seed=step)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        block, ref_block = model.blocks[step], ref.blocks[step]
        if step == 1:  # asynchronous: the gather is issued, wait() exposes it
            counted = executed_collectives(lambda block=block: block.unshard(async_op=True).wait())
        else:
            counted = executed_collectives(block.unshard)
        out[f"gathers_{step}"] = float(counted.counts["all_gather"])
        out[f"full_shape_{step}"] = float(block[0].weight.shape == ref_block[0].weight.shape)
        out[f"full_diff_{step}"] = max(
            (block[0].weight - ref_block[0].weight).abs().max().item(),
            (block[0].bias - ref_block[0].bias).abs().max().item(),
        )
        out[f"others_sharded_{step}"] = float(is_shard_view(model, model.blocks[step + 1][0].weight))
        block.reshard()
        out[f"resharded_{step}"] = float(is_shard_view(model, block[0].weight) and not model._fsdp_root.unsharded)
    out["graphs"] = float(backend.dynamo_graphs if backend else 0)
    return out


def divide_factor(rank: int, world: int, mode: str) -> dict[str, float]:
    """Gradients with the default factor (the mean), with factor 1.0 (the sum) twice, and back to None."""
    model, ref, run, backend = _sharded(mode)
    out: dict[str, float] = {}
    for step, factor in enumerate((None, 1.0, 1.0, None)):
        for unit in sharded_units(model):
            unit.set_gradient_divide_factor(factor)
        _train_step(run, ref, rank, world, seed=step)
        expected_scale = world if factor == 1.0 else 1
        grads = full_grads(model)
        out[f"grad_diff_{step}"] = max(
            (grads[n] - expected_scale * p.grad).abs().max().item() for n, p in ref.named_parameters()
        )
        out[f"graphs_{step}"] = float(backend.dynamo_graphs if backend else 0)
        model.zero_grad()
        ref.zero_grad()
    out["factors"] = float(all(s.divide_factor is None for s in flat_params(model)))
    return out


def forward_method(rank: int, world: int) -> dict[str, float]:
    model, ref, _, _ = _sharded("eager")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    model.generate = types.MethodType(generate, model)
    out = {}
    with torch.no_grad():
        expected = generate(ref, x)
        try:  # the head's parameters are this rank's shards outside forward: an error, or a wrong result
            got = model.generate(x)
            out["unregistered_wrong"] = float(got.shape != expected.shape or not torch.allclose(got, expected))
        except RuntimeError:
            out["unregistered_wrong"] = 1.0
    fsdp_graph.register_fsdp_forward_method(model, "generate")
    with torch.no_grad():
        out["diff"] = (model.generate(x) - expected).abs().max().item()
    root = model._fsdp_root
    out["closed"] = float(root.forward_depth == 0 and not root.gathered and root.session is None)
    out["sharded_after"] = float(is_shard_view(model, model.head.weight))
    return out


def replica_all_reduce(rank: int, world: int, mode: str) -> dict[str, float]:
    """HYBRID_SHARD on a (2, world // 2) mesh: two microbatches with set_requires_all_reduce(False), then one with
    True, twice over; the gradients equal single-process training's over the three full batches."""
    torch.manual_seed(0)
    model = DeepMLP()
    ref = copy.deepcopy(model)
    run, backend = shard_and_compile(model, Case("mlp", strategy="HYBRID_SHARD", mode=mode))
    units = sharded_units(model)
    out: dict[str, float] = {}
    for round_ in range(2):
        for micro in range(3):
            all_reduce = micro == 2
            for unit in units:
                unit.set_requires_all_reduce(all_reduce)
            counted = executed_collectives(
                lambda seed=10 * round_ + micro: _train_step(run, ref, rank, world, seed=seed)
            )
            out[f"all_reduces_{round_}_{micro}"] = float(counted.counts["all_reduce"])
            if not all_reduce:
                out[f"grads_untouched_{round_}_{micro}"] = float(all(p.grad is None for p in model.parameters()))
        grads = full_grads(model)
        out[f"grad_diff_{round_}"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        out[f"partials_dropped_{round_}"] = float(all(s.partial.grad is None for s in flat_params(model)))
        model.zero_grad()
        ref.zero_grad()
    out["graphs"] = float(backend.dynamo_graphs if backend else 0)
    return out


def _accumulate(run: nn.Module, ref: nn.Module, rank: int, world: int, seed: int) -> tuple[int, int]:
    """One microbatch's forward and backward (and the reference's on the full batch): the all-gathers each ran."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4 * world, 256, generator=gen), torch.randn(4 * world, 1, generator=gen)
    losses = []
    forward = executed_collectives(
        lambda: losses.append(nn.functional.mse_loss(run(x.chunk(world)[rank]), y.chunk(world)[rank]))
    )
    backward = executed_collectives(lambda: losses.pop().backward())
    nn.functional.mse_loss(ref(x), y).backward()
    return forward.counts["all_gather"], backward.counts["all_gather"]


def reshard_after_backward(rank: int, world: int, strategy: str, mode: str) -> dict[str, float]:
    """Eager gradient accumulation with FSDP2's idiom `set_reshard_after_backward(is_last_microbatch)` over 3
    microbatches, twice with an SGD step between; then `reshard()`, and an optimizer step while gathers are kept.
    Compiled (`mode="aot"`): the same, with the graphs Dynamo compiled."""
    torch.manual_seed(0)
    model = DeepMLP()
    ref = copy.deepcopy(model)
    run, backend = shard_and_compile(model, Case("mlp", strategy=strategy, mode=mode))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    root = model._fsdp_root
    out: dict[str, float] = {"units": float(sum(s.world > 1 for s in flat_params(model)))}

    def grad_diff() -> float:
        grads = full_grads(model)
        return max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())

    def step() -> None:
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()

    try:
        model.set_reshard_after_backward(0)
        out["non_bool_refused"] = 0.0
    except TypeError:
        out["non_bool_refused"] = 1.0
    for round_ in range(2):
        for micro in range(3):
            model.set_reshard_after_backward(micro == 2)
            fwd, bwd = _accumulate(run, ref, rank, world, seed=10 * round_ + micro)
            out[f"fwd_{round_}_{micro}"], out[f"bwd_{round_}_{micro}"] = float(fwd), float(bwd)
        out[f"grad_diff_{round_}"] = grad_diff()
        out[f"kept_after_{round_}"] = float(len(root.held))
        step()
    model.set_reshard_after_backward(False)
    _accumulate(run, ref, rank, world, seed=100)
    out["kept"] = float(len(root.held))
    for unit in sharded_units(model):
        unit.reshard()
    out["kept_after_reshard"] = float(len(root.held))
    out["fwd_resharded"] = float(_accumulate(run, ref, rank, world, seed=101)[0])
    out["grad_diff_resharded"] = grad_diff()
    step()  # while gathers are kept: the next forward must see the stepped shards
    out["fwd_stepped"] = float(_accumulate(run, ref, rank, world, seed=102)[0])
    out["grad_diff_stepped"] = grad_diff()
    model.set_reshard_after_backward(True)
    out["fwd_released"] = float(_accumulate(run, ref, rank, world, seed=103)[0])
    out["grad_diff_released"] = grad_diff()
    out["kept_released"] = float(len(root.held))
    out["graphs"] = float(backend.dynamo_graphs if backend else 0)
    return out
