"""Small models for tests (the GPT lives in the package: fsdp_graph.models)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_graph.models import GPT, Block, GPTConfig, gpt_loss

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
