"""Workers and helpers for the default wrap's embedding and head units (tests/graphs/test_edge_units.py,
tests/numerics/test_edge_units.py)."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

import fsdp_graph
from fsdp_graph.runtime.unit import sharded_units
from fsdp_graph.train.llama import Llama, preset
from passes.cost import iter_collectives
from tests.workers.training import llama_step_beside_reference, max_param_diff


def all_gather_bytes(gm: fx.GraphModule) -> list[int]:
    """The output bytes of every all-gather of a lowered graph (a bucketed gather counts once, whole)."""
    sizes = []
    for node, kind, _ in iter_collectives(gm):
        if kind == "all_gather":
            val = node.meta["val"]
            sizes.append(val.numel() * val.element_size())
    return sizes


def padded_bytes(module: nn.Module, world: int) -> int:
    """fp32 bytes of `module`'s parameters as one flat parameter padded to a multiple of `world` elements."""
    numel = sum(p.numel() for p in module.parameters())
    return -(-numel // world) * world * 4


def untied_llama_sgd_parity(rank: int, world: int, steps: int = 4, batch: int = 2) -> dict:
    """An untied Llama sharded with the default wrap and compiled (eager kernels), trained with SGD + momentum,
    against the same model in one process on the global batch; plus the largest all-gather of the step."""
    vocab, seq = 1024, 32
    torch.manual_seed(0)
    model = Llama(preset("tiny", tied=False, vocab=vocab, seq=seq))
    ref = copy.deepcopy(model)
    pieces = [model.tok_embeddings, model.output, *model.blocks]
    sizes = [padded_bytes(m, world) for m in pieces]
    fsdp_graph.fully_shard(model)
    backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    initial = copy.deepcopy(ref.state_dict())
    losses, ref_losses = [], []
    tokens = torch.randint(0, vocab, (batch * world, seq + 1), generator=gen)  # one batch: the loss must fall
    full = (tokens[:, :-1], tokens[:, 1:])
    local = (full[0][rank * batch : (rank + 1) * batch], full[1][rank * batch : (rank + 1) * batch])
    for _ in range(steps):
        loss, ref_loss = llama_step_beside_reference(compiled, opt, local, ref, ref_opt, full, world)
        losses.append(loss)
        ref_losses.append(ref_loss)
    gathers = [size for report in backend.reports for size in all_gather_bytes(report.graph)]
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "loss_drop": ref_losses[0] - ref_losses[-1],
        "param_diff": max_param_diff(model, ref),
        "param_change": max((v - initial[k]).abs().max().item() for k, v in ref.state_dict().items()),
        "units": len(sharded_units(model)),
        "largest_gather": max(gathers),
        "collectives": [(r.stage, dict(r.collectives.counts)) for r in backend.reports],
        "largest_piece": max(sizes),
        "embedding_plus_head": sizes[0] + sizes[1],
    }
