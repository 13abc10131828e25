"""Gradient clipping over a sharded model: the norm single-process training would compute."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_graph.unit import flat_params


def _local_norm_part(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """max |g| for the inf-norm, sum |g|^p otherwise (fp32, so a bf16 gradient does not overflow the sum)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float() for g in grads if g.numel()] or [torch.zeros(())]).max()
    return sum(torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads)


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of a sharded model in place; returns the total norm (a tensor, on every rank).

    Equal to `torch.nn.utils.clip_grad_norm_` on the unsharded model. Each flat parameter's gradient is
    partitioned over its shard group, so the local parts are summed (or maxed) over that group only: replicas
    (HYBRID_SHARD, NO_SHARD) hold identical reduced gradients. Parameters fully_shard did not shard (ignored
    ones) count once, with this rank's gradient.
    """
    states = flat_params(model)
    if not states:
        raise RuntimeError("clip_grad_norm_: the model is not sharded; use torch.nn.utils.clip_grad_norm_.")
    norm_type = float(norm_type)
    by_group: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)
    sharded = set()
    for state in states:
        sharded.update(id(v) for v in state.views)
        by_group[(state.group_name, state.world)].extend(v.grad for v in state.views if v.grad is not None)
    others = [p.grad for p in model.parameters() if id(p) not in sharded and p.grad is not None]

    parts = []
    for (group_name, world), grads in by_group.items():
        part = _local_norm_part(grads, norm_type)
        if world > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=dist.distributed_c10d._resolve_process_group(group_name))
        parts.append(part)
    parts.append(_local_norm_part(others, norm_type))
    if math.isinf(norm_type):
        total = torch.stack(parts).max()
    else:
        total = torch.stack(parts).sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is non-finite ({total.item()}).")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [g for gs in by_group.values() for g in gs] + others
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))
    return total
