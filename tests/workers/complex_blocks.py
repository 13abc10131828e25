"""Rank-side worker: blocks holding a complex RoPE cache (torchtitan's `ComplexRoPE` arithmetic: a complex64 buffer
per block, sliced to the sequence and multiplied into `view_as_complex` queries and keys) share one body, and train
as without reuse. The model's input needs no gradient, so the first block's call differs from the others': its body
is called once, beside the body the other blocks share (the case Inductor got wrong; design-notes, "No complex
tensor in the body")."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

import fsdp_graph
from tests.workers.block_reuse import body_calls, sgd_momentum_steps

DIM, HEADS, SEQ, STEPS = 16, 2, 12, 3


class ComplexRope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        half = DIM // HEADS // 2
        freqs = torch.outer(torch.arange(4 * SEQ).float(), 1.0 / (10000 ** (torch.arange(half).float() / half)))
        self.register_buffer("cache", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * self.cache[:seq].view(1, seq, 1, -1)
        return torch.view_as_real(rotated).flatten(3).type_as(x)


class RopeBlock(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(4))
        self.rope = ComplexRope()
        self.norm = nn.LayerNorm(DIM) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x = self.norm(x)
        q, k = (self.rope(w(x).view(b, s, HEADS, -1)).transpose(1, 2) for w in (self.wq, self.wk))
        v = self.wv(x).view(b, s, HEADS, -1).transpose(1, 2)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.wo(attended.transpose(1, 2).reshape(b, s, DIM))


class RopeBlocks(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RopeBlock(norm=i == 0) for i in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def train(rank: int, world: int, reuse: bool, inductor: bool) -> dict:
    """STEPS SGD-with-momentum steps of `RopeBlocks`, sharded (`reuse_blocks=reuse`) and compiled (fullgraph, eager
    kernels or Inductor): the losses, the last step's full gradients, the final full parameters, and how many calls
    each body the Dynamo graph calls has."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(RopeBlocks(), reuse_blocks=reuse)
    backend = fsdp_graph.make_backend(inductor=inductor)
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex), fullgraph=True)
    gen = torch.Generator().manual_seed(1 + rank)
    losses, grads, params = sgd_momentum_steps(
        model, lambda: compiled(torch.randn(2, SEQ, DIM, generator=gen)).square().mean(), lr=0.1, steps=STEPS
    )
    uses = sorted(Counter(body_calls(graphs[0])).values()) if graphs else []
    return {"losses": losses, "grads": grads, "params": params, "body_uses": uses}


def train_both(rank: int, world: int) -> dict[str, tuple[dict, dict]]:
    """`train` with reuse, with eager kernels and under Inductor, each paired with one run without reuse with eager
    kernels. Not with an Inductor run without reuse of its own: the fault this guards against (a body inlined beside
    a shared complex body; design-notes, block reuse on the models people bring) put 0.108 into the weights, where
    Inductor's kernels against eager ones move them by float32 rounding (measured 6e-8), and that run cost 14% of
    the test's CPU."""
    plain = train(rank, world, False, False)
    return {
        label: (plain, train(rank, world, True, inductor))
        for label, inductor in (("eager kernels", False), ("inductor", True))
    }
