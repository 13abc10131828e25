"""Small models for tests (the GPT lives in the package: fsdp_graph.train.gpt)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_graph.train.gpt import GPT, Block, GPTConfig, gpt_loss

__all__ = ["GPT", "BNNet", "Block", "ConvNet", "GPTConfig", "OddMLP", "gpt_loss"]


class OddMLP(nn.Module):
    """Layer sizes not divisible by the world size: every unit's flat parameter needs padding."""

    def __init__(self, sizes=(7, 13, 11, 5)):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class BNNet(nn.Module):
    """BatchNorm buffers (running stats) stay replicated and unsharded."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.stem(x))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()),
        )
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.features(x), 4).flatten(1))


class SharedBlockNet(nn.Module):
    """One block (one unit) applied twice per forward: one gather, gradients of both uses reduced once."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.block(self.block(h)))


class SkipNet(nn.Module):
    """`extra` (a unit) runs only when asked: in some steps it has no gradient at all."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.extra = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        if use_extra:
            x = torch.relu(self.extra(x))
        return self.out(x)


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class HFStyleNet(nn.Module):
    """Hugging Face style: keyword inputs, the loss computed inside, a dict or a dataclass output."""

    def __init__(self, vocab: int = 32, dim: int = 8, return_dataclass: bool = False):
        super().__init__()
        self.return_dataclass = return_dataclass
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.lm_head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if self.return_dataclass:
            return CausalLMOutput(loss=loss, logits=logits)
        return {"logits": logits, "loss": loss}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedGPT(GPT):
    """Every block runs under torch.utils.checkpoint (non-reentrant); `selective` saves matmul outputs and
    recomputes the rest (selective activation checkpointing)."""

    def __init__(self, cfg: GPTConfig, selective: bool = False):
        super().__init__(cfg)
        self.selective = selective

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            if self.selective:
                # Dynamo wants context_fn as a partial of create_selective_checkpoint_contexts.
                context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                x = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
            else:
                x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln(x))
