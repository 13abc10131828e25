"""Rank-side workers for the training-loop features (issue 5)."""

from __future__ import annotations

import copy

import torch

import fsdp_graph
from tests.training import Case, build, full_grads, shard_and_compile


def clip_matches_pytorch(rank: int, world: int, strategy: str, mode: str) -> dict[str, float]:
    """Our clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_ on the full-batch reference, for several norms."""
    out = {}
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (1.0, 1e6)):
        torch.manual_seed(0)
        model, loss_fn, make_batch = build("gpt")
        ref = copy.deepcopy(model)
        compiled, _ = shard_and_compile(model, Case("gpt", strategy=strategy, mode=mode))
        full = make_batch(torch.Generator().manual_seed(9), 4 * world)
        loss_fn(compiled, tuple(t.chunk(world)[rank] for t in full)).backward()
        loss_fn(ref, full).backward()
        ours = fsdp_graph.clip_grad_norm_(model, max_norm, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        grads = full_grads(model)
        out[f"norm_{norm_type}"] = abs(ours.item() - theirs.item()) / theirs.item()
        out[f"grads_{norm_type}"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        out[f"clipped_{norm_type}"] = float(theirs.item() > max_norm)
    return out
