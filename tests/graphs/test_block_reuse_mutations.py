"""Blocks that write their buffers or their input in place share a body under the reuse default (issue 32): the
writes move out of the body (`passes.lift_region_mutations`), and training and a `no_grad` forward give bit for
bit the losses, parameters, buffers and inputs of `reuse_blocks=False` (1 gloo rank, eager
kernels, SGD with momentum). Before the pass every one of these models failed to compile with torch's "The
invoke_subgraph HigherOrderOperator does not currently support training with in-place input or buffer
mutations"."""

from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.runtime.block_region import ReuseBlocksError
from tests.workers.block_reuse import body_calls

DIM = 4


class Block(nn.Module):
    """A linear layer and one kind of in-place write, chosen by `kind` (a plain attribute: one body per kind)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(DIM, DIM)
        if kind == "batch_norm":
            self.norm = nn.BatchNorm1d(DIM)  # running_mean, running_var, num_batches_tracked
        self.register_buffer("counts", torch.zeros(DIM))  # tokens per expert, as torchtitan's MoE counts them
        self.register_buffer("last", torch.zeros(DIM))
        self.register_buffer("average", torch.ones(DIM))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(8, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "input":  # the forward's input written in place (the caller's own tensor), then read
            x.mul_(0.5)
            return self.lin(x).relu() + x
        if self.kind == "returned_input":  # written in place and returned: the caller gets its own tensor back
            return x.add_(self.average)
        h = self.lin(x)
        if self.kind == "buffers":
            with torch.no_grad():  # torchtitan's MoE: tokens per expert counted under no_grad
                self.counts.add_(h.detach().abs().sum(0))
            before = self.last * 1.0  # read before and after a copy_
            self.last.copy_(h.detach().mean(0))
            self.average.mul_(0.9).add_(0.1 * h.detach().square().mean(0))  # a moving average, read after it moves
            self.steps.add_(1)  # an integer step counter the output depends on
            return h / self.average.sqrt() / self.steps + x + before + self.last
        if self.kind == "batch_norm":
            return self.norm(h).relu() + x
        if self.kind == "cache":  # rows written through a view of the buffer, then all of it read
            self.cache[: x.shape[0]] = h.detach()
            return h.relu() + x + self.cache.sum(0)
        raise ValueError(self.kind)


KINDS = ["input", "buffers", "batch_norm", "cache", "returned_input"]


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        # three "input" blocks: the first is given the caller's tensor (no gradient: a body of its own, inlined), the
        # next two an activation that needs one (one shared body)
        self.blocks = nn.ModuleList(Block(kind) for kind in KINDS for _ in range(3 if kind == "input" else 2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _compiled_keeping_graphs(model: nn.Module) -> tuple[nn.Module, list[torch.fx.GraphModule]]:
    graphs: list[torch.fx.GraphModule] = []
    backend = fsdp_graph.make_backend(inductor=False)
    return torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or backend(gm, ex), fullgraph=True), graphs


def _run(reuse: bool | None) -> dict:
    """2 SGD steps with momentum and a no_grad forward (training mode: the buffers are written), compiled
    fullgraph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(Stack(), **({} if reuse is None else {"reuse_blocks": reuse}))
    compiled, graphs = _compiled_keeping_graphs(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses, inputs = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            inputs.append(torch.randn(3, DIM, generator=torch.Generator().manual_seed(step)))
            loss = compiled(inputs[-1])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            inputs.append(torch.randn(3, DIM, generator=torch.Generator().manual_seed(2)))
            losses.append(compiled(inputs[-1]).item())
    with fsdp_graph.summon_full_params(model):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "buffers": {name: b.clone() for name, b in model.named_buffers()},
        "inputs": inputs,  # the first block writes the caller's tensor
        "bodies": [sorted(Counter(body_calls(gm)).values()) for gm in graphs],
        "warnings": [str(w.message) for w in caught if "reuse_blocks" in str(w.message)],
    }


def test_blocks_writing_buffers_and_inputs_share_a_body_bit_for_bit(one_rank):
    """Two blocks of each kind call one body (two graphs: training, no_grad), no warning, and the losses,
    parameters, every buffer (BatchNorm's statistics, counters, the cache rows) and the inputs equal those of
    reuse_blocks=False exactly."""
    reused, plain = _run(None), _run(False)
    assert reused["losses"] == plain["losses"] and all(map(math.isfinite, reused["losses"]))
    for kind in ("params", "buffers"):
        assert reused[kind].keys() == plain[kind].keys()
        for name, value in plain[kind].items():
            torch.testing.assert_close(reused[kind][name], value, rtol=0, atol=0, msg=f"{kind}: {name}")
    for mine, theirs in zip(reused["inputs"], plain["inputs"]):
        assert torch.equal(mine, theirs)
    fresh = torch.randn(3, DIM, generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain["inputs"][0], fresh * 0.5)  # written by the first block, once
    # every buffer moved (the test would pass on a model that never wrote them otherwise)
    moved = {name.rsplit(".", 1)[-1] for name, b in plain["buffers"].items() if b.float().abs().sum() > 0}
    assert {"counts", "last", "average", "steps", "cache", "running_mean", "num_batches_tracked"} <= moved
    assert plain["bodies"] == [[]] * 2 and reused["warnings"] == []
    # under no_grad no input needs a gradient: the three "input" blocks call one body
    assert reused["bodies"] == [[2] * len(KINDS), [2] * (len(KINDS) - 1) + [3]], reused["bodies"]


class Counting(nn.Module):
    """Counts its calls in a Python attribute: a side effect Dynamo applies once per traced body, not per block."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x).relu() + x


def test_blocks_writing_python_attributes_run_on_their_own(one_rank):
    """A block writing a Python attribute in forward cannot share a body (it would count the first block's calls
    only: [2, 0, 0] before): each block runs its own forward, with one warning naming the attribute, and counts as
    without reuse; `reuse_blocks=True` raises `ReuseBlocksError` instead."""
    counts = {}
    for reuse in (False, None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = fsdp_graph.fully_shard(nn.Sequential(*(Counting() for _ in range(3))), reuse_blocks=reuse)
        compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                compiled(torch.randn(3, DIM, requires_grad=True)).sum().backward()
        counts[reuse] = [block.calls for block in model]
        messages = [str(w.message) for w in caught if "reuse_blocks" in str(w.message)]
    assert counts[None] == counts[False] == [2, 2, 2], counts
    (message,) = messages
    assert "Counting is traced layer by layer" in message and "the Python attribute 'calls'" in message, message
    torch._dynamo.reset()
    model = fsdp_graph.fully_shard(nn.Sequential(*(Counting() for _ in range(3))), reuse_blocks=True)
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    with pytest.raises(ReuseBlocksError, match="reuse_blocks=True: Counting cannot share a body: its forward writes"):
        compiled(torch.randn(3, DIM, requires_grad=True))


class _Selector:
    """A module-global holder of the kernel a forward selects, set and put back around each forward as `kernels`'
    `use_kernelized_func` does on transformers' attention layers, or a counter of calls (`count`)."""

    def __init__(self):
        self.active = None
        self.count = 0


_SELECTOR = _Selector()


class Selecting(nn.Module):
    """`undo`: selects a kernel for its forward and puts the previous selection back; else counts its calls in the
    holder, which the model's own forward zeroed first (a write the trace had made before the body)."""

    def __init__(self, undo: bool):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.undo = undo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.undo:
            _SELECTOR.count = _SELECTOR.count + 1
            return self.lin(x).relu() + x
        previous = _SELECTOR.active
        _SELECTOR.active = "gelu"
        try:
            h = self.lin(x)
            return (nn.functional.gelu(h) if _SELECTOR.active == "gelu" else h.relu()) + x
        finally:
            _SELECTOR.active = previous


class Selected(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SELECTOR.count = 0
        return super().forward(x)


@pytest.mark.parametrize("undo", [True, False])
def test_a_python_write_put_back_shares_the_body_one_that_lasts_does_not(one_rank, undo):
    """A forward that sets a module-global attribute and puts it back shares one body for its three blocks, no
    warning, with the body's own outputs (not every intermediate, as for a write that lasts) and the gradients of
    reuse_blocks=False bit for bit. One that counts in an attribute the model's forward wrote before the blocks
    runs each block on its own, with one warning, and counts 3 as without reuse (1 before: the write was missed)."""
    results = {}
    for reuse in (False, None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = fsdp_graph.fully_shard(Selected(*(Selecting(undo) for _ in range(3))), reuse_blocks=reuse)
        compiled, graphs = _compiled_keeping_graphs(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(torch.randn(3, DIM, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        with fsdp_graph.summon_full_params(model, with_grads=True):
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[reuse] = {
            "grads": grads,
            "bodies": Counter(body_calls(graphs[0])),
            "outputs": [len(m.graph.output_node().args[0]) for n, m in graphs[0].named_children() if "subgraph" in n],
            "warnings": [str(w.message) for w in caught if "reuse_blocks" in str(w.message)],
            "count": _SELECTOR.count,
            "active": _SELECTOR.active,
        }
    reused, plain = results[None], results[False]
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(reused["grads"][name], grad, rtol=0, atol=0, msg=name)
    assert reused["active"] is None and plain["count"] == 3 * (not undo)
    if undo:
        assert reused["warnings"] == [] and list(reused["bodies"].values()) == [3], reused
        assert reused["outputs"] == [1], reused["outputs"]  # the block's output alone
    else:
        assert reused["count"] == 3 and reused["bodies"] == Counter(), reused
        (message,) = reused["warnings"]
        assert "Selecting is traced layer by layer" in message and "the Python attribute 'count'" in message
