"""Blocks whose forward returns more than tensors under the reuse default (issue 25): a dict, a dataclass, a
transformers `ModelOutput`, a nested namedtuple with a constant and a returned argument share one body, and any other
object is traced layer by layer with one warning; all train bit for bit as with `reuse_blocks=False` (1 gloo
rank, eager kernels, 2 SGD steps with momentum)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
from transformers.utils import ModelOutput

import fsdp_graph
from tests.workers.block_reuse import body_calls


@dataclasses.dataclass
class Hidden:
    hidden: torch.Tensor
    extra: torch.Tensor | None = None


@dataclasses.dataclass
class HiddenOutput(ModelOutput):
    hidden: torch.Tensor | None = None
    attentions: torch.Tensor | None = None


class Pair(NamedTuple):
    hidden: torch.Tensor
    passed: tuple


class Opaque:
    """An object torch cannot return from a body, nor we rebuild."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


def _as_dict(x, h, gate):
    return {"hidden": x + h, "gate": gate.mean(), "cache": None}


OUTPUTS = {
    "dict": (_as_dict, lambda out: out["hidden"] + out["gate"]),
    "dataclass": (lambda x, h, gate: Hidden(x + h), lambda out: out.hidden),
    "model_output": (lambda x, h, gate: HiddenOutput(hidden=x + h), lambda out: out[0]),
    "namedtuple": (lambda x, h, gate: Pair(x + h, (x, 0.5, [gate])), lambda out: out.hidden * out.passed[1]),
    "opaque": (lambda x, h, gate: Opaque(x + h), lambda out: out.hidden),
}


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.up, self.down, self.kind = nn.Linear(4, 8), nn.Linear(8, 4), kind

    def forward(self, x: torch.Tensor):
        gate = torch.relu(self.up(x))
        return OUTPUTS[self.kind][0](x, self.down(gate), gate)


class Stack(nn.Module):
    """Two blocks of each output kind; a kind is a plain attribute, so each pair has a structure of its own."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(kind) for kind in OUTPUTS for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = OUTPUTS[block.kind][1](block(x))
        return self.head(x).square().mean()


def _train(reuse: bool | None) -> tuple[list, list, dict, list[str]]:
    """2 SGD steps with momentum: the losses, the Dynamo graphs' bodies, the parameters and the warnings."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fsdp_graph.fully_shard(Stack(), **({} if reuse is None else {"reuse_blocks": reuse}))
        backend = fsdp_graph.make_backend(inductor=False)
        graphs: list[torch.fx.GraphModule] = []
        compiled = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex), fullgraph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        losses = []
        for step in range(2):
            loss = compiled(torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    messages = [str(w.message) for w in caught if "reuse_blocks" in str(w.message)]
    return losses, [body_calls(gm) for gm in graphs], params, messages


def test_blocks_returning_dicts_dataclasses_and_model_outputs_share_a_body(one_rank):
    """Each pair of supported blocks calls one body twice (one Dynamo graph: no recompile in step 2); the opaque
    pair runs its own forward (its dead body calls are dropped before lowering), with one warning naming it."""
    losses, bodies, params, messages = _train(None)
    plain_losses, plain_bodies, plain_params, _ = _train(False)
    assert losses == plain_losses and all(map(math.isfinite, losses)) and plain_bodies == [[]]
    for name, value in plain_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
    (calls,) = bodies
    supported = len(OUTPUTS) - 1
    # pairs of one body (Dynamo installs the dataclass and ModelOutput pairs' identical bodies once)
    assert len(calls) >= 2 * supported and all(calls[i] == calls[i + 1] for i in range(0, 2 * supported, 2)), calls
    assert len(messages) == 1 and "Block is traced layer by layer" in messages[0], messages
    assert "its forward returns a Opaque" in messages[0], messages
