"""explain_by_depth: a deep model's plan from shallow plans of the same model equals explain() of the whole model,
and a figure that is not linear in depth is refused, not extrapolated. (Llama 3 8B and 405B, planned both ways
by benchmarks/scale_plans.py, agree to the byte: docs/scale-plans.md.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.planning.depth import FIGURES, figures_of

VOCAB, DIM, BATCH, SEQ = 512, 32, 4, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def explain_at(layers: int) -> fsdp_graph.ExplainReport:
    with torch.device("meta"):
        net = Net(layers)
    fsdp_graph.fully_shard(net, device="meta")
    idx = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")

    def lm_loss(logits: torch.Tensor) -> torch.Tensor:
        return -logits.log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

    return fsdp_graph.explain(net, idx, loss_fn=lm_loss, hardware="nvlink")


def test_extrapolated_plan_equals_the_whole_model(fake_pg):
    depth = fsdp_graph.explain_by_depth(explain_at, layers=8, samples=(4, 5, 6))
    whole = figures_of(explain_at(8))
    assert set(depth.figures) == set(FIGURES)
    for name in FIGURES:
        if name.endswith("time") or name == "exposed_comm":
            assert depth[name] == pytest.approx(whole[name], rel=1e-9), name
        else:  # bytes and counts: exact
            assert depth[name] == whole[name], name
    # Per layer: one more unit, gathered in forward and again in backward, reduced once; its activations add to
    # the peak.
    assert depth.per_layer["gathers"] == 2 and depth.per_layer["reduce_scatters"] == 1
    assert depth.per_layer["peak_memory_bytes"] > depth.per_layer["shard_bytes"] > 0
    assert depth.plan_seconds > 0 and sorted(depth.sampled) == [4, 5, 6]


def test_a_figure_that_bends_is_refused(fake_pg):
    # One block is not a unit of its own (the default wrap splits repeated blocks), two are: from 1 to 2 layers
    # the units, their collectives and the step time jump, then grow by a block's worth per layer.
    with pytest.raises(ValueError, match="is not linear in depth"):
        fsdp_graph.explain_by_depth(explain_at, layers=8, samples=(1, 2, 3))


@pytest.mark.parametrize(
    ("layers", "samples", "message"),
    [
        (8, (4, 5), "at least three increasing depths"),
        (8, (5, 4, 6), "at least three increasing depths"),
        (8, (0, 1, 2), "at least three increasing depths"),
        (6, (4, 5, 6), "not deeper than the samples"),
    ],
)
def test_bad_samples(layers, samples, message):
    with pytest.raises(ValueError, match=message):
        fsdp_graph.explain_by_depth(lambda n: pytest.fail("planned"), layers=layers, samples=samples)
