"""Rank-side workers for the main job's model (fsdp_graph.train.llama): parity with single-process training."""

from __future__ import annotations

import copy
import dataclasses

import torch

import fsdp_graph
from fsdp_graph.train.corpus import batch_at, load_tokens
from fsdp_graph.train.llama import Llama, LlamaConfig
from tests.workers.training import llama_step_beside_reference, max_param_diff

SMALL = LlamaConfig(dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=16)
# The main job's tests run it small and fast: eager kernels (no Inductor codegen), short sequences.
FAST = ["--preset", "tiny", "--batch", "2", "--seq", "32", "--backend-mode", "aot"]


def llama_parity(rank: int, world: int, tied: bool, strategy: str, steps: int = 4, batch: int = 2) -> dict:
    """Sharded + compiled (eager kernels) Llama vs the same model in one process on the full batch, AdamW."""
    cfg = dataclasses.replace(SMALL, tied=tied)
    torch.manual_seed(0)
    model = Llama(cfg)
    ref = copy.deepcopy(model)
    initial = copy.deepcopy(ref.state_dict())
    fsdp_graph.fully_shard(model, strategy=fsdp_graph.ShardingStrategy[strategy])
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = load_tokens()
    losses, ref_losses = [], []
    for step in range(steps):
        local = batch_at(tokens, step, 0, batch, cfg.seq, rank, world)
        full = batch_at(tokens, step, 0, batch * world, cfg.seq)  # the global batch: every rank's slice
        loss, ref_loss = llama_step_beside_reference(compiled, opt, local, ref, ref_opt, full, world)
        losses.append(loss)
        ref_losses.append(ref_loss)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "loss_drop": ref_losses[0] - ref_losses[-1],
        "param_diff": max_param_diff(model, ref),
        "param_change": max((v - initial[k]).abs().max().item() for k, v in ref.state_dict().items()),
        "dynamo_graphs": backend.dynamo_graphs,
        "units": len(fsdp_graph.runtime.unit.sharded_units(model)),
        "collectives": [(r.stage, dict(r.collectives.counts)) for r in backend.reports],
        "still_tied": model.output.weight is model.tok_embeddings.weight,
    }


def llama_meta_init(rank: int, world: int) -> dict:
    """A Llama built on the meta device and materialised by fully_shard with `init_module`: the init it gets,
    the rotary buffers, and its compiled logits against a single-process model holding the same weights."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(SMALL)
    fsdp_graph.fully_shard(model, param_init_fn=model.init_module)
    full = fsdp_graph.full_state_dict(model)
    ref = Llama(SMALL)
    ref.load_state_dict(full)
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    idx, _ = batch_at(load_tokens(), 0, 0, 2, SMALL.seq)
    with torch.no_grad():
        logits_diff = (compiled(idx) - ref(idx)).abs().max().item()
    return {
        "norms_one": all(v.eq(1).all().item() for k, v in full.items() if "norm" in k),
        "wq_std": full["blocks.0.attention.wq.weight"].std().item(),
        "wo_std": full["blocks.0.attention.wo.weight"].std().item(),
        "rope_diff": max(
            (model.rope.cos - ref.rope.cos).abs().max().item(), (model.rope.sin - ref.rope.sin).abs().max().item()
        ),
        "logits_diff": logits_diff,
        "finite": all(torch.isfinite(v).all().item() for v in full.values()),
    }


def llama_checks(rank: int, world: int) -> dict:
    """Every parity case plus the meta-init check, in one launch (each launch costs seconds of imports)."""
    return {
        "tied_full_shard": llama_parity(rank, world, tied=True, strategy="FULL_SHARD"),
        "untied_shard_grad_op": llama_parity(rank, world, tied=False, strategy="SHARD_GRAD_OP"),
        "meta": llama_meta_init(rank, world),
    }
