"""The training text shipped with the package, as byte-level tokens (vocabulary 256), and its batches.

`data/corpus.txt` (~400 KB) is the project's own documentation (README, design notes) and Python source, one
file after another: real English and code that the package may redistribute, nothing downloaded.
"""

from __future__ import annotations

from importlib import resources

import torch

VOCAB = 256  # one token per byte


def load_tokens() -> torch.Tensor:
    """The whole corpus as a 1-D int64 tensor of byte values."""
    data = resources.files("fsdp_graph.train").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_at(
    tokens: torch.Tensor, step: int, seed: int, batch: int, seq: int, rank: int = 0, world: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets), each (batch, seq), of the global batch of step `step`: `batch * world`
    random windows of the corpus. A function of (seed, step) only, so a resumed run sees the same data as an
    uninterrupted one, and every world size splits the same global batch."""
    if tokens.numel() <= seq + 1:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too short for sequences of {seq}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch * world,), generator=gen)
    mine = starts[rank * batch : (rank + 1) * batch]
    windows = tokens[mine[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1], windows[:, 1:]
