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
    rank: int,
    world: int,
    family: str,
    flavor: str,
    layers: int | None = None,
    steps: int = 5,
    expert_hidden: int | None = None,
    modes: tuple[str, ...] = ("fsdp2",),
) -> dict[str, float]:
    """Losses, every weight and every buffer after `steps` SGD-with-momentum steps: torchtitan with torch's FSDP2
    (eager), against the same model compiled (fullgraph, default options: blocks share a body) in each of `modes`:
    "fsdp2", torchtitan's `apply_fsdp_to_decoder` with fsdp_graph.fsdp2.fully_shard (this rank's row block of each
    weight compared), "native", `fsdp_graph.fully_shard(model, mesh)` (full weights compared). `layers` and
    `expert_hidden`: see `titan.build`."""
    from collections import Counter

    from tests.workers.block_reuse import body_calls

    mesh = init_device_mesh("cpu", (world,))
    reference = titan.build(family, flavor, layers=layers, expert_hidden=expert_hidden)
    _apply_fsdp(reference, mesh, torch.distributed.fsdp.fully_shard)
    ref_losses = _train(reference, reference, rank, world, steps)
    ref_local = {n: p.to_local().detach() for n, p in reference.named_parameters()}
    ref_full = {n: p.full_tensor().detach() for n, p in reference.named_parameters()}
    ref_buffers = {n: b.clone() for n, b in reference.named_buffers()}

    out: dict[str, float] = {}
    for mode in modes:
        model = titan.build(family, flavor, layers=layers, expert_hidden=expert_hidden)
        if mode == "fsdp2":
            _apply_fsdp(model, mesh, fsdp_graph.fsdp2.fully_shard)
            out[f"{mode}_fsdp_modules"] = float(
                sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules())
            )
        else:
            fsdp_graph.fully_shard(model, mesh)
            for unit in model.modules():  # torchtitan's recipe sums the gradients (its loss is already divided)
                if unit.__dict__.get("_fsdp_states"):
                    unit.set_gradient_divide_factor(1.0)
        backend = fsdp_graph.make_backend(inductor=False)
        graphs: list[torch.fx.GraphModule] = []
        capture = lambda gm, ex, graphs=graphs, backend=backend: graphs.append(gm) or backend(gm, ex)  # noqa: E731
        run = torch.compile(model, backend=capture, fullgraph=True)
        losses = _train(run, model, rank, world, steps)
        out[f"{mode}_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        out[f"{mode}_graphs"] = float(backend.dynamo_graphs)
        out[f"{mode}_body_uses"] = sorted(Counter(body_calls(graphs[0])).values())
        if mode == "fsdp2":
            params = {n: p.to_local().detach() for n, p in model.named_parameters()}
            reference_params = ref_local
        else:
            with fsdp_graph.summon_full_params(model):
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
            reference_params = ref_full
        out[f"{mode}_same_names"] = float(sorted(params) == sorted(reference_params))
        out[f"{mode}_same_shapes"] = float(all(params[n].shape == reference_params[n].shape for n in reference_params))
        out[f"{mode}_weight_diff"] = max(
            (params[n] - p).abs().max().item() if p.numel() else 0.0 for n, p in reference_params.items()
        )
        buffers = dict(model.named_buffers())
        out[f"{mode}_same_buffer_names"] = float(sorted(buffers) == sorted(ref_buffers))
        out[f"{mode}_buffer_diff"] = max(
            ((buffers[n] - b).abs().max().item() for n, b in ref_buffers.items() if b.numel()), default=0.0
        )
    out["ref_fsdp_modules"] = float(sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in reference.modules()))
    out["loss_moved"] = ref_losses[0] - ref_losses[-1]
    # MoE layers count the tokens routed to each expert in place, in forward (aux-loss-free load balancing)
    out["tokens_counted"] = sum(b.sum().item() for n, b in ref_buffers.items() if n.endswith("tokens_per_expert_E"))
    return out
