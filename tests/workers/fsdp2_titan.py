"""Rank-side worker: torchtitan's own `apply_fsdp_to_decoder`, unmodified, with `fsdp_graph.fsdp2.fully_shard` in
place of torch's, against torchtitan with torch's FSDP2 (issue 28)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
import fsdp_graph.fsdp2
from tests.workers import titan


def _batches(rank: int, world: int, steps: int, vocab: int, batch: int = 2, seq: int = 32):
    """One batch, seen at every step (random tokens: only memorising them lowers the loss)."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (world * batch, seq + 1), generator=gen)
    local = tokens.chunk(world)[rank]
    for _ in range(steps):
        yield local[:, :-1], local[:, 1:], tokens[:, 1:].numel()


def _apply_fsdp(model: nn.Module, mesh, fully_shard) -> None:
    titan.apply_fsdp(model, mesh, fully_shard)
    for module in model.modules():
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _train(run: nn.Module, model: nn.Module, rank: int, world: int, steps: int) -> list[float]:
    from torchtitan.components.loss import cross_entropy_loss

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for tokens, labels, global_tokens in _batches(rank, world, steps, model.tok_embeddings.num_embeddings):
        # torchtitan's recipe: a summed loss over the global token count, FSDP's own division disabled.
        loss = cross_entropy_loss(run(tokens, None, None), labels) / global_tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        summed = loss.detach().clone()
        torch.distributed.all_reduce(summed)
        losses.append(summed.item())
    return losses


def titan_parity(
    rank: int, world: int, family: str, flavor: str, layers: int | None = None, steps: int = 5
) -> dict[str, float]:
    """Losses and this rank's row block of every weight after `steps` SGD-with-momentum steps: torchtitan with torch's
    FSDP2 (eager), and with fsdp_graph.fsdp2 compiled (fullgraph). `layers`: the model's first that many layers only."""
    mesh = init_device_mesh("cpu", (world,))
    reference = titan.build(family, flavor, layers=layers)
    _apply_fsdp(reference, mesh, torch.distributed.fsdp.fully_shard)
    ref_losses = _train(reference, reference, rank, world, steps)
    ref_params = {n: p.to_local() for n, p in reference.named_parameters()}

    out: dict[str, float] = {}
    for mode in ("compiled",):  # eager: tests/numerics/test_fsdp2_upstream.py
        model = titan.build(family, flavor, layers=layers)
        _apply_fsdp(model, mesh, fsdp_graph.fsdp2.fully_shard)
        out[f"{mode}_fsdp_modules"] = float(
            sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules())
        )
        backend = fsdp_graph.make_backend(inductor=False)
        run = torch.compile(model, backend=backend, fullgraph=True)
        losses = _train(run, model, rank, world, steps)
        out[f"{mode}_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        params = dict(model.named_parameters())
        out[f"{mode}_same_names"] = float(sorted(params) == sorted(ref_params))
        local = {n: p.to_local().detach() for n, p in params.items()}
        out[f"{mode}_weight_diff"] = max(
            (local[n] - ref_params[n]).abs().max().item() if ref_params[n].numel() else 0.0 for n in ref_params
        )
        out[f"{mode}_same_shapes"] = float(all(local[n].shape == ref_params[n].shape for n in ref_params))
        if mode == "compiled":
            out["graphs"] = float(backend.dynamo_graphs)
    out["ref_fsdp_modules"] = float(sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in reference.modules()))
    out["loss_moved"] = ref_losses[0] - ref_losses[-1]
    return out
