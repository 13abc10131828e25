"""Rank-side workers for eager FULL_SHARD (issue 12): reshard after each unit's forward, re-gather in backward."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives, peak_allocated_bytes
from tests.workers.training import max_param_diff

DIM, BLOCKS = 256, 6


class DeepMLP(nn.Module):
    """BLOCKS equal blocks (the default wrap policy makes each a unit) and a head on the root."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def unit_bytes() -> int:
    """One block's unsharded flat parameter (fp32; DIM*DIM + DIM is even, so unpadded at 2 ranks)."""
    return (DIM * DIM + DIM) * 4


def eager_reshard_parity(rank: int, world: int, strategy: str) -> dict[str, float]:
    """Eager training vs single-process SGD with momentum; gathers executed and peak memory of one step."""
    torch.manual_seed(0)
    model = DeepMLP()
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model, strategy=fsdp_graph.ShardingStrategy[strategy])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    out: dict[str, float] = {}
    forward_peaks, step_peaks = [], []
    for step in range(12):
        x, y = torch.randn(4 * world, DIM, generator=gen), torch.randn(4 * world, 1, generator=gen)
        local_x, local_y = x.chunk(world)[rank], y.chunk(world)[rank]

        def forward(local_x: torch.Tensor = local_x, local_y: torch.Tensor = local_y) -> torch.Tensor:
            return nn.functional.mse_loss(model(local_x), local_y)

        if step == 1:
            out["all_gathers"] = float(executed_collectives(lambda: forward().backward()).counts["all_gather"])
        elif 2 <= step < 7:  # what the forward gathers and leaves behind for the backward
            peak, loss = peak_allocated_bytes(forward)
            forward_peaks.append(peak)
            loss.backward()
        elif step >= 7:  # gradients persist (zero_grad(set_to_none=False)): the step's peak is the gathers
            step_peaks.append(peak_allocated_bytes(lambda: forward().backward())[0])
        else:
            forward().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # The least of 5 steps each: gloo frees a finished collective's buffers on its worker thread, a moment late, so
    # one step's peak can include a gathered block or a full gradient that is already dead (seen: 2 to 7 blocks
    # saved in single measurements on one machine).
    out["forward_peak_bytes"] = float(min(forward_peaks))
    out["step_peak_bytes"] = float(min(step_peaks))
    out["param_diff"] = max_param_diff(model, ref)
    out["moved"] = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), DeepMLP().parameters()))
    return out


def generate(model: DeepMLP, x: torch.Tensor) -> torch.Tensor:
    """A method other than forward reading a root parameter directly (the head's), as a sampling loop might."""
    return model.blocks[0](x) @ model.head.weight.t() + model.head.bias
